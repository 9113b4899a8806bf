"""The package's import graph has no cycle and no upward arrow (tools/import_graph.py)."""

import importlib.util
import pathlib

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "tools" / "import_graph.py"


def _graph():
  spec = importlib.util.spec_from_file_location("import_graph", SCRIPT)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod, mod.graph()


def test_no_module_imports_itself_back_through_others():
  mod, edges = _graph()
  assert mod.cycles(edges) == []


def test_the_layers_point_down_the_way_data_flows():
  _, edges = _graph()
  s = lambda *names: {f"step.{n}" for n in names}
  below = {  # module: modules it must not import (they sit above it)
      "step.placement": s("spec", "state", "offload", "update", "train_step"),
      "step.spec": s("offload", "state", "grads", "update", "train_step"),
      "step.state": s("offload", "grads", "update", "train_step"),
      "comm.collectives": s("spec", "state", "grads", "update", "train_step"),
      "comm.quantize": {"comm.collectives"} | s("spec", "state", "grads"),
      "checkpoint.format": s("train_step"),
  }
  for name, above in below.items():
    assert not edges[name] & above, (name, edges[name] & above)


def test_the_folders_point_one_way_comm_at_the_bottom_checkpoint_at_the_top():
  mod, edges = _graph()
  assert mod.upward(edges) == []
  assert {mod.folder(m) for m in edges} <= set(mod.ORDER)
  folders = mod.folder_edges(edges)
  assert folders["comm"] == set(), folders["comm"]        # imports nothing of the step
  assert mod.cycles(folders) == []
  # No module outside the checkpoint family imports it (the package's __init__ re-exports).
  users = {m for m, deps in edges.items() if any(d.startswith("checkpoint") for d in deps)}
  assert all(m.startswith("checkpoint") for m in users), users


def test_the_upward_check_finds_an_upward_import():
  mod, _ = _graph()
  assert mod.upward({"comm.hlo": {"step.spec"}, "step.spec": {"comm.hlo"}}) == [
      ("comm.hlo", "step.spec")]


def test_no_module_sits_flat_beside_the_families():
  mod, edges = _graph()
  flat = sorted(m for m in edges if "." not in m)
  assert set(flat) <= set(mod.ORDER), flat


def test_the_cycle_finder_finds_a_cycle():
  mod, _ = _graph()
  assert mod.cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
