"""The examples run: examples/train_lm.py (as a user runs it) and the quick-start notebook;
every example's ``--help`` answers at once and explains every option; the front door (README,
the GPU plugin wording, what the guides leave in a clone)."""

import fnmatch
import importlib.util
import json
import pathlib
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
TINY = ["--size", "tiny", "--seq-len", "32", "--batch-size", "16", "--lr", "1e-2",
        "--eval-batches", "2", "--sample-bytes", "16", "--platform", "cpu", "--no-progress"]
STEPS, SAVE_EVERY = 24, 12


def run_lm(*args, timeout=300, flags=TINY, ok=True, cwd=ROOT) -> subprocess.CompletedProcess:
  proc = subprocess.run([sys.executable, str(EXAMPLES / "train_lm.py"), *flags, *args],
                        capture_output=True, text=True, timeout=timeout, cwd=cwd)
  if ok:
    assert proc.returncode == 0, f"train_lm.py failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
  return proc


def without(flags, *names):
  """``flags`` less each ``--name value`` pair in ``names``."""
  out = list(flags)
  for name in names:
    i = out.index(name)
    del out[i:i + 2]
  return out


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  """24 steps with checkpoints at 12 and 24."""
  tmp = tmp_path_factory.mktemp("lm")
  proc = run_lm("--steps", str(STEPS), "--save-every", str(SAVE_EVERY),
                "--ckpt-dir", str(tmp / "ckpt"), "--metrics-json", str(tmp / "metrics.json"))
  return tmp, proc.stdout, json.loads((tmp / "metrics.json").read_text())


def test_train_lm_loss_falls_and_reports_memory_and_samples(uninterrupted):
  _, out, m = uninterrupted
  losses = {int(k): v for k, v in m["losses"].items()}
  assert sorted(losses) == list(range(1, STEPS + 1))
  assert losses[1] > 5.0                              # about ln(257): a uniform guess
  assert max(losses[s] for s in range(STEPS - 3, STEPS + 1)) < losses[1] - 1.0
  assert m["eval_loss_after"] < m["eval_loss_before"] - 1.0   # held-out text too
  assert m["n_devices"] == 8 and m["stage"] == 2 and m["tokens_per_s"] > 0
  for row in ("| DP (replicated) |", "| ZeRO-1 |", "| ZeRO-2 |", "| ZeRO-3 |"):
    assert row in out
  assert "XLA's analysis of the compiled step" in out
  assert "sampled text" in out


def test_train_lm_resume_continues_to_the_same_params(uninterrupted, tmp_path):
  """Resuming at step 12 takes the same steps 13-24 as the run that was never stopped, also
  when told to train longer (--steps 26): the learning-rate schedule is the one the run
  started with (24 steps), held at its final value after step 24.

  The resumed run is not told --size and --seq-len: it takes them from the checkpoints.
  """
  src, _, full = uninterrupted
  ckpt = tmp_path / "ckpt"
  shutil.copytree(src / "ckpt", ckpt)
  assert (ckpt / str(STEPS)).is_dir() and (ckpt / str(SAVE_EVERY)).is_dir()
  assert json.loads((ckpt / "run.json").read_text())["schedule_steps"] == STEPS
  shutil.rmtree(ckpt / str(STEPS))   # as if the run had stopped after step 12
  proc = run_lm("--steps", str(STEPS + 2), "--save-every", str(SAVE_EVERY), "--resume",
                "--ckpt-dir", str(ckpt), "--metrics-json", str(tmp_path / "metrics.json"),
                flags=without(TINY, "--size", "--seq-len"))
  m = json.loads((tmp_path / "metrics.json").read_text())
  assert "--resume: using --size tiny --seq-len 32, as recorded in" in proc.stdout
  assert "ByteLM tiny: d_model=64, layers=2, heads=2, context=32" in proc.stdout
  assert f"resumed from {ckpt} at step {SAVE_EVERY}" in proc.stdout
  assert m["start_step"] == SAVE_EVERY and m["step"] == STEPS + 2
  resumed = {int(k): v for k, v in m["losses"].items()}
  assert sorted(resumed) == list(range(SAVE_EVERY + 1, STEPS + 3))
  for s in range(SAVE_EVERY + 1, STEPS + 1):
    assert resumed[s] == pytest.approx(full["losses"][str(s)], rel=1e-6, abs=1e-6), s
  assert (ckpt / str(STEPS)).is_dir() and (ckpt / str(STEPS + 2)).is_dir()  # its own saves


def load_train_lm():
  spec = importlib.util.spec_from_file_location("train_lm", EXAMPLES / "train_lm.py")
  train_lm = importlib.util.module_from_spec(spec)
  sys.modules["train_lm"] = train_lm  # flax's dataclasses look their module up
  try:
    spec.loader.exec_module(train_lm)
  finally:
    del sys.modules["train_lm"]
  return train_lm


def test_train_lm_resume_keeps_the_schedule_length_the_run_started_with(tmp_path):
  train_lm = load_train_lm()
  (tmp_path / "run.json").write_text(json.dumps(
      {"size": "tiny", "seq_len": 32, "precision": "fp32", "schedule_steps": 300}))
  resumed = train_lm.parse_args(["--steps", "600", "--resume", "--ckpt-dir", str(tmp_path)])
  assert train_lm.schedule_steps(resumed, str(tmp_path)) == 300
  fresh = train_lm.parse_args(["--steps", "600", "--ckpt-dir", str(tmp_path)])
  assert train_lm.schedule_steps(fresh, str(tmp_path)) == 600
  lr = train_lm.lr_schedule(1e-2, 300)
  assert float(lr(30)) == pytest.approx(1e-2)                      # the peak, after warmup
  for s in (300, 301, 450, 600):
    assert float(lr(s)) == pytest.approx(1e-3), s                  # held at lr/10 after its end


def test_train_lm_held_out_loss_is_the_single_device_loss_of_its_parameters(uninterrupted):
  """The held-out loss before training (``step.evaluate`` on the split state, stage 2 here)
  is the plain jit loss of the initial parameters on one device over the same held-out
  batches. Tolerance: each batch's loss is a float32 mean of 16 x 32 = 512 positive
  cross-entropies, whose sum in any order is within (n - 1) u = 511 * 2**-24 = 3.0e-5 of the
  exact one, relatively; the logits of a row do not depend on which device computes it."""
  import jax
  import jax.numpy as jnp
  _, _, m = uninterrupted
  train_lm = load_train_lm()
  args = train_lm.parse_args([*TINY, "--steps", str(STEPS)])
  d_model, layers, heads = train_lm.SIZES[args.size]
  model = train_lm.ByteLM(d_model, layers, heads, max_len=args.seq_len, prefetch=args.prefetch,
                          remat=args.remat)
  dummy = jnp.zeros((1, args.seq_len), jnp.int32)
  params = jax.jit(model.init)(jax.random.key(args.seed), dummy)["params"]
  _, held = train_lm.load_corpus()
  loss = jax.jit(train_lm.make_loss_fn(model))
  want = np.mean([float(loss(params, train_lm.get_batch(held, i, args.batch_size, args.seq_len,
                                                         args.seed + 1)))
                  for i in range(args.eval_batches)])
  assert m["eval_loss_before"] == pytest.approx(want, rel=3e-5)


def test_train_lm_resume_refuses_flags_the_checkpoints_contradict(uninterrupted):
  """--resume with another --size or --precision exits before any work, naming the flags."""
  src, _, _ = uninterrupted
  proc = run_lm("--resume", "--precision", "bf16", "--ckpt-dir", str(src / "ckpt"),
                flags=[*without(TINY, "--size"), "--size", "small"], ok=False)
  assert proc.returncode != 0
  assert "were written with --size tiny --seq-len 32 --precision fp32" in proc.stderr
  assert "this run asks for --size small --precision bf16" in proc.stderr
  assert "Leave those flags out" in proc.stderr


def test_train_lm_new_run_keeps_another_runs_checkpoints(uninterrupted, tmp_path):
  """A new run refuses a directory with another run's checkpoints; --overwrite says it deletes."""
  src, _, _ = uninterrupted
  ckpt = tmp_path / "ckpt"
  shutil.copytree(src / "ckpt", ckpt)
  for extra in ((), ("--precision", "bf16")):   # same flags or not: not the default directory
    proc = run_lm("--steps", "2", "--ckpt-dir", str(ckpt), *extra, ok=False)
    assert proc.returncode != 0
    assert f"holds the checkpoints (steps [{SAVE_EVERY}, {STEPS}]) of another run" in proc.stderr
    assert "with --size tiny --seq-len 32 --precision fp32" in proc.stderr
    assert "--overwrite" in proc.stderr
    assert sorted(p.name for p in ckpt.iterdir() if p.name.isdigit()) == ["12", "24"]
  quick = ("--steps", "2", "--save-every", "0", "--eval-batches", "0", "--sample-bytes", "0")
  proc = run_lm(*quick, "--precision", "bf16", "--ckpt-dir", str(ckpt), "--overwrite")
  assert f"deleting the checkpoints (steps [{SAVE_EVERY}, {STEPS}])" in proc.stdout
  assert sorted(p.name for p in ckpt.iterdir() if p.name.isdigit()) == ["2"]
  assert json.loads((ckpt / "run.json").read_text()) == {
      "size": "tiny", "seq_len": 32, "precision": "bf16", "schedule_steps": 2}


def test_train_lm_default_directory_replaces_only_the_same_runs_checkpoints(
    uninterrupted, tmp_path):
  """The README command run twice works; after a run with other flags it refuses instead."""
  src, _, _ = uninterrupted
  default = tmp_path / "checkpoints" / "train_lm"   # the default --ckpt-dir, under the cwd
  shutil.copytree(src / "ckpt", default)
  quick = ("--steps", "2", "--save-every", "0", "--eval-batches", "0", "--sample-bytes", "0")
  proc = run_lm(*quick, "--precision", "bf16", cwd=tmp_path, ok=False)
  assert proc.returncode != 0 and "with --size tiny --seq-len 32 --precision fp32" in proc.stderr
  assert sorted(p.name for p in default.iterdir() if p.name.isdigit()) == ["12", "24"]
  proc = run_lm(*quick, cwd=tmp_path)
  assert f"deleting the checkpoints (steps [{SAVE_EVERY}, {STEPS}]) of an earlier run in " \
         f"{default}" in proc.stdout
  assert sorted(p.name for p in default.iterdir() if p.name.isdigit()) == ["2"]


def test_train_lm_help_lists_every_option(capsys):
  train_lm = load_train_lm()
  with pytest.raises(SystemExit) as e:
    train_lm.parse_args(["--help"])
  assert e.value.code == 0
  out = capsys.readouterr().out
  for opt in ("--stage", "--precision", "--size", "--steps", "--batch-size", "--devices",
              "--resume", "--ckpt-dir", "--overwrite"):
    assert opt in out
  defaults = train_lm.parse_args([])
  assert defaults.stage == 2 and defaults.precision == "fp32" and defaults.resume is None


HELP_PROBE = """
import argparse, json, runpy, sys
for name in ("jax", "jaxlib", "flax", "optax", "zero_jax"):
  sys.modules[name] = None  # importing any of them fails: --help must answer before
script, out = sys.argv[1:]
seen = []
print_help = argparse.ArgumentParser.print_help

def record(self, file=None):
  print_help(self, file)
  formatter = self._get_formatter()
  seen.extend({"option": (a.option_strings or [a.dest])[-1], "default": a.default,
               "help": formatter._expand_help(a) if a.help else None}
              for a in self._actions if a.dest != "help" and a.help != argparse.SUPPRESS)
argparse.ArgumentParser.print_help = record
sys.argv = [script, "--help"]
try:
  runpy.run_path(script, run_name="__main__")
except SystemExit as e:
  code = e.code
json.dump({"code": code, "actions": seen}, open(out, "w"), default=repr)
"""


@pytest.mark.parametrize("script", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_every_examples_help_answers_before_jax_and_explains_every_option(script, tmp_path):
  """``--help`` with JAX, Flax, optax and zero_jax unimportable: it answers (before any of
  them is imported; train_lm.py's took 5.6 s when it imported them first), and every option
  has a help text that shows its default (one that is not None or False: 0 is one to
  show, as ``--seed``'s was not)."""
  out = tmp_path / "help.json"
  proc = subprocess.run([sys.executable, "-c", HELP_PROBE, str(EXAMPLES / script), str(out)],
                        capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)
  assert proc.returncode == 0 and out.exists(), proc.stderr[-3000:]
  got = json.loads(out.read_text())
  assert got["code"] == 0 and "usage:" in proc.stdout and len(got["actions"]) >= 2, got
  for action in got["actions"]:
    assert action["help"], (script, action)
    if action["default"] is not None and action["default"] is not False:
      assert f"default: {action['default']}" in action["help"], (script, action)


def test_compile_only_users_are_told_the_two_plugin_wheels_not_jax_cuda12():
  """jax[cuda12] brings the multi-GB nvidia-* wheels; compiling for a GPU without one needs
  only jax-cuda12-plugin and jax-cuda12-pjrt: the no-plugin error, the module that raises it
  and both guides say so."""
  import jax
  from zero_jax.gpu import targets
  message = str(targets._plugin_error(ImportError("no module named jax_plugins")))  # pylint: disable=protected-access
  assert f'"jax-cuda12-plugin=={jax.__version__}" "jax-cuda12-pjrt=={jax.__version__}"' in message
  pages = {"the error": message, "zero_jax/gpu/targets.py": targets.__doc__,
           **{f"docs/guides/{p}": (ROOT / "docs" / "guides" / p).read_text()
              for p in ("planning.md", "gpu_compile.md")}}
  for where, text in pages.items():
    assert "jax-cuda12-plugin" in text and "jax-cuda12-pjrt" in text, where
    assert not re.search(r"pip install\s+[\"']?jax\[cuda", text), where


def _git_ignored(name: str) -> bool:
  """Whether the repository's .gitignore ignores ``name`` at its root (its simple patterns)."""
  patterns = [line.strip() for line in (ROOT / ".gitignore").read_text().splitlines()
              if line.strip() and not line.startswith(("#", "!"))]
  return any(fnmatch.fnmatch(name, p.strip("/")) for p in patterns)


@pytest.mark.skipif(not (ROOT / ".gitignore").exists(), reason="a copy without .gitignore")
def test_what_the_docs_write_in_their_directory_is_ignored_by_git():
  """A reader who runs the README's or a guide's code in the clone gets checkpoint and export
  folders (ckpt/, export/, ...) there: git ignores each."""
  written = set()
  for page in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]:
    for block in re.findall(r"```python\n(.*?)```", page.read_text(), re.S):
      for path in re.findall(r"(?:CheckpointManager|export_params|export_safetensors)\(\s*"
                             r"[\"']([^\"']+)[\"']", block):
        written.add(path.split("/")[0])
  assert {"ckpt", "export", "checkpoints"} <= written, written
  assert [w for w in sorted(written) if not _git_ignored(w)] == []


def test_the_readme_says_how_to_check_an_install_run_the_gpu_tier_and_pick_a_stage():
  """Within its 200 lines: a quick check of an install (a test file that exists, with the
  number of tests said), the suite's time, how to run the GPU-tier tests the test command
  skips (as many as said), and which stage to start with."""
  text = (ROOT / "README.md").read_text()
  assert len(text.splitlines()) <= 200
  quick = re.search(r"Check an install in about two minutes: `python -m pytest -q (\S+)`[^;]*; "
                    r"(\d+) tests", text)
  gpu = re.search(r"It skips the (\d+) tests of the GPU compile tier \(`tests/gpu`.*"
                  r"`bash ci/gpu_tier.sh`", text, re.S)
  assert quick and gpu and (ROOT / "ci" / "gpu_tier.sh").exists()
  assert "took about 8 minutes on an idle 2-core machine" in text
  for path, n in ((quick.group(1), quick.group(2)), ("tests/gpu", gpu.group(1))):
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", path],
                          capture_output=True, text=True, cwd=ROOT, timeout=120, check=False)
    assert f"\n{n} tests collected" in "\n" + proc.stdout, (path, proc.stdout[-300:])
  stage = text[text.index("## Which stage"):].split("\n## ", 1)[0]
  assert "Start with the default, stage 2" in stage and "Move to" in stage and "stage 3" in stage


def test_the_readme_names_every_example_and_how_to_run_the_notebook():
  text = (ROOT / "README.md").read_text()
  examples = sorted(p.name for p in EXAMPLES.iterdir() if p.suffix in (".py", ".ipynb"))
  assert [n for n in examples if f"`examples/{n}`" not in text] == []
  assert "jupyter execute examples/quickstart.ipynb" in text


def test_the_readme_and_the_gpu_tier_script_give_the_tier_the_same_time():
  figure = "about 3 minutes on an idle 2-core machine, up to 20 on a loaded one"
  for path in (ROOT / "README.md", ROOT / "ci" / "gpu_tier.sh"):
    assert figure in " ".join(path.read_text().replace("#", " ").split()), path


def test_quickstart_notebook_runs_end_to_end():
  nbformat = pytest.importorskip("nbformat")
  nbclient = pytest.importorskip("nbclient")
  nb = nbformat.read(EXAMPLES / "quickstart.ipynb", as_version=4)
  client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                                   resources={"metadata": {"path": str(EXAMPLES)}})
  client.execute()  # raises CellExecutionError, with the cell and traceback, on any error
  outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
  text = "\n".join(o.get("text", "") + o.get("data", {}).get("text/markdown", "")
                   for o in outputs)
  assert "largest difference from single-device optax" in text
  assert "MLP: loss" in text and "largest difference from nnx.Optimizer" in text
  assert "| ZeRO-3 |" in text
  images = [o for o in outputs if "image/png" in o.get("data", {})]
  assert images, "the notebook's plot produced no image"


def test_train_nnx_learns_evaluates_and_restores():
  proc = subprocess.run([sys.executable, str(EXAMPLES / "train_nnx.py"), "--steps", "30"],
                        capture_output=True, text=True, timeout=300, cwd=ROOT)
  assert proc.returncode == 0, f"train_nnx.py failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
  assert "model state: ['BatchStat', 'RngCount', 'RngKey']" in proc.stdout
  assert "| ZeRO-3 |" in proc.stdout
  assert "restored into a ZeRO-3 step at step 30: the same model" in proc.stdout


def test_train_lm_remat_keeps_the_numbers_of_every_policy():
  """``--remat`` (zj.scan's ``policy=``) changes what the blocks keep, not the loss or the
  gradient: each equals the ``nn.scan(nn.remat(...))`` path's, and zj.plan's policies map
  back to the flag."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  train_lm = load_train_lm()
  tokens = np.random.default_rng(0).integers(0, 256, size=(4, 17)).astype(np.int32)
  base = train_lm.ByteLM(32, 2, 2, 16)
  params = base.init(jax.random.key(0), tokens[:, :-1])["params"]
  grads = lambda model: jax.grad(train_lm.make_loss_fn(model))(params, {"tokens": tokens})
  want = grads(base)
  for remat in train_lm.REMAT:
    got = grads(base.clone(prefetch=1, remat=remat))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, want)
    assert train_lm.remat_name(train_lm.remat_policy(remat)) == remat


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_train_lm_attention_written_out_equals_jax_dot_product_attention(kv_heads):
  """``--attention``'s implementations compute the same causal attention: the written-out one
  (the default on CPUs) against ``jax.nn.dot_product_attention(implementation="xla")`` (what
  ``cudnn`` fuses on GPUs), multi-head and grouped-query, values and gradients, float32.
  Bound: both are float32 softmax-weighted sums of at most 16 terms whose weights sum to 1;
  each output element differs by a few float32 roundings of the largest |v| (about 1e-7
  relative per operation, under 40 operations on the path): 1e-5 of max|v|."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  train_lm = load_train_lm()
  r = np.random.default_rng(0)
  q = jnp.asarray(r.normal(size=(2, 16, 4, 8)), jnp.float32)
  k, v = (jnp.asarray(r.normal(size=(2, 16, kv_heads, 8)), jnp.float32) for _ in range(2))
  f = lambda impl: lambda q, k, v: jnp.sum(train_lm.causal_attention(q, k, v, impl) ** 2)
  for impl_out in (lambda i: train_lm.causal_attention(q, k, v, i),
                   lambda i: jax.grad(f(i), argnums=(0, 1, 2))(q, k, v)):
    got, want = impl_out("written"), impl_out("xla")
    jax.tree.map(lambda a, b: np.testing.assert_allclose(
        a, b, rtol=0, atol=1e-5 * float(jnp.max(jnp.abs(b)))), got, want)
  with pytest.raises(ValueError, match="'flash'.*expected one of"):
    train_lm.causal_attention(q, k, v, "flash")
