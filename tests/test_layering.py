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
  below = {  # module: modules it must not import (they sit above it)
      "placement": {"spec", "state", "offload", "update", "train_step"},
      "spec": {"offload", "state", "grads", "update", "train_step"},
      "state": {"offload", "grads", "update", "train_step"},
      "comm.collectives": {"spec", "state", "grads", "update", "train_step"},
      "comm.quantize": {"comm.collectives", "spec", "state", "grads"},
      "checkpoint.format": {"train_step"},
  }
  for name, above in below.items():
    assert not edges[name] & above, (name, edges[name] & above)


def test_the_folders_point_one_way_comm_at_the_bottom_checkpoint_at_the_top():
  mod, edges = _graph()
  folders = mod.folder_edges(edges)
  assert folders["comm"] == set(), folders["comm"]        # imports nothing of the step
  assert "checkpoint" not in folders[""]                  # the step never imports it
  assert mod.cycles(folders) == []
  # The package's __init__ re-exports; no module of the step imports the checkpoint family.
  users = {m for m, deps in edges.items() if any(d.startswith("checkpoint") for d in deps)}
  assert all(m.startswith("checkpoint") for m in users), users


def test_the_cycle_finder_finds_a_cycle():
  mod, _ = _graph()
  assert mod.cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
