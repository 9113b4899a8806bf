"""zj.export_safetensors(dtype=...) into a floating dtype of smaller range than the leaves'."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from safetensors.numpy import load_file

import zero_jax as zj


@pytest.mark.parametrize("stage,precision", [(1, "fp32"), (3, "fp32"), (3, "bf16")])
def test_a_value_past_the_export_dtypes_range_is_refused_naming_the_leaf_and_writes_nothing(
    tmp_path, stage, precision):
  """float32 1e5 exported as float16 was written as inf (numpy's overflow warning naming
  nothing; on GPUs without a word), as float8_e4m3fn as NaN. Now refused before anything is
  written, naming the leaf, its largest value and the dtype's; infinities and NaNs the leaf
  holds itself, and values that round into the range, are written as they are."""
  step = zj.make_sharded_train_step(lambda p, b: 0.0, optax.sgd(0.1),
                                    mesh=jax.make_mesh((8,), ("data",)), stage=stage,
                                    precision=precision)
  big = step.init({"w": np.array([[1.0, -1e5]] * 8, np.float32), "b": np.ones(3, np.float32)})
  for dtype, shown in [(jnp.float16, "inf"), (jnp.float8_e4m3fn, "nan")]:
    with pytest.raises(ValueError, match=rf"export_safetensors\(dtype={np.dtype(dtype).name}\): "
                                         rf"params\['w'\] holds 100000 \(in magnitude\), past "
                                         rf"the largest {np.dtype(dtype).name} \(\d+\): it would "
                                         rf"be written as -?{shown}.*nothing was written"):
      zj.export_safetensors(step, big, tmp_path / "big", dtype=dtype)
    assert not (tmp_path / "big").exists() or not list((tmp_path / "big").iterdir())
  odd = np.array([[65519.0, np.inf, np.nan, -2.0]] * 4, np.float32)
  state = step.init({"w": odd, "b": np.ones(3, np.float32)})
  zj.export_safetensors(step, state, tmp_path / "odd", dtype=jnp.float16)
  got = load_file(tmp_path / "odd" / "model.safetensors")["w"]
  np.testing.assert_array_equal(got, odd.astype(np.float16))
  assert got[0, 0] == 65504  # rounded into the range


def test_metadata_is_added_to_the_format_transformers_needs(tmp_path):
  """transformers 4.x refuses a file whose __metadata__ has no "format" ("does not contain the
  valid metadata"): metadata= adds to {"format": "pt"} instead of replacing it, and sets the
  format only when it names one."""
  from safetensors import safe_open
  step = zj.make_sharded_train_step(lambda p, b: 0.0, optax.sgd(0.1),
                                    mesh=jax.make_mesh((8,), ("data",)))
  state = step.init({"w": np.ones((8, 2), np.float32)})
  for metadata, want in [(None, {"format": "pt"}), ({}, {"format": "pt"}),
                         ({"author": "me"}, {"format": "pt", "author": "me"}),
                         ({"format": "flax"}, {"format": "flax"})]:
    out = tmp_path / str(len(want)) / str(metadata)
    zj.export_safetensors(step, state, out, metadata=metadata)
    with safe_open(out / "model.safetensors", "np") as f:
      assert f.metadata() == want, metadata
