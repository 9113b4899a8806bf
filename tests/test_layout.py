"""How leaves are split: least padding, scalars replicated, pad/unpad exact."""

import jax.numpy as jnp
import numpy as np
import pytest

import zero_jax as zj
from zero_jax.comm import layout as lay


@pytest.mark.parametrize("shape,n,dim,padded", [
    ((50257, 768), 8, 1, 768),     # the dimension that divides: no padding
    ((768, 50257), 8, 0, 768),
    ((9, 7), 8, 1, 8),             # 9 x 8 = 72 elements beats 16 x 7 = 112
    ((5,), 8, 0, 8),
    ((3, 4), 1, 1, 4),             # one device: nothing padded, the largest dim
    ((16, 16), 8, 0, 16),          # ties: the first dimension
])
def test_split_dimension_minimises_padding(shape, n, dim, padded):
  assert zj.leaf_layout(shape, n) == zj.Layout(shape, dim, padded)


def test_scalars_are_replicated():
  layout = zj.leaf_layout((), 8)
  assert layout.dim is None and layout.spec("data") == lay.P()
  assert layout.storage_shape == ()


@pytest.mark.parametrize("shape", [(9, 7), (5,), (50257, 3), (2, 3, 5)])
def test_pad_then_unpad_is_exact_and_padding_is_zero(shape):
  x = jnp.asarray(np.random.default_rng(0).normal(size=shape), jnp.float32)
  layout = zj.leaf_layout(shape, 8)
  stored = lay.pad(x, layout)
  assert stored.shape == layout.storage_shape
  assert stored.shape[layout.dim] % 8 == 0
  np.testing.assert_array_equal(lay.unpad(stored, layout), x)
  assert float(jnp.abs(stored).sum()) == pytest.approx(float(jnp.abs(x).sum()))
  assert lay.local_storage_shape(layout, 8)[layout.dim] == layout.padded // 8
