"""Block quantization and the quantized collectives (zero_jax.comm.quantize) against numpy and lax.

References are computed without sharding (numpy sums of every device's rows) or
with the exact lax collectives; the error bounds asserted are the ones stated in
docs/guides/zeropp_error.md.
"""

import math
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from _compile import FULL_COMPILE
from zero_jax.comm import hlo
from zero_jax.comm import quantize as zq

ROOT = pathlib.Path(__file__).resolve().parent.parent
MESHES = [((8,), ("data",)), ((2, 4), ("replica", "data")), ((4, 2), ("replica", "data"))]
HOPS = {  # mesh shape -> hop sequences to try
    (8,): [[("data",)]],
    (2, 4): [[("data",), ("replica",)], [("replica",), ("data",)], [("replica", "data")],
             [("data", "replica")]],
    (4, 2): [[("data",), ("replica",)], [("replica",), ("data",)]],
}


def make_mesh(shape, names):
  return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape))


def per_device(mesh, fn, x):
  """``fn`` on every device's slice ``x[d]``; the results stacked: ``out[d]`` is device ``d``'s."""
  axes = mesh.axis_names
  f = jax.jit(jax.shard_map(lambda a: fn(a[0])[None], mesh=mesh, in_specs=P(axes),
                            out_specs=P(axes)))
  return np.asarray(f(jnp.asarray(x)))


def representable(rng, nblocks, block, bits):
  """Blocks of integers in [-qmax, qmax] times a power of two, each block's max at ±qmax·2^e."""
  qmax = zq.QMAX[bits]
  k = rng.integers(-qmax, qmax + 1, (nblocks, block))
  k[:, 0] = rng.choice([-qmax, qmax], nblocks)
  k[:, 1:] = rng.permuted(k[:, 1:], axis=1)
  return (k * 2.0 ** rng.integers(-20, 20, (nblocks, 1))).astype(np.float32)


def roundtrip(x, block_size, bits):
  q, s = zq.quantize(jnp.asarray(x), block_size=block_size, bits=bits)
  return np.asarray(zq.dequantize(q, s, shape=np.shape(x))), np.asarray(s)


def block_absmax(x, block_size):
  """(..., L) -> (..., L): each element's block absmax (blocks along the last axis)."""
  L = x.shape[-1]
  nb = -(-L // block_size)
  xb = np.pad(np.abs(x), [(0, 0)] * (x.ndim - 1) + [(0, nb * block_size - L)])
  m = xb.reshape(*x.shape[:-1], nb, block_size).max(-1)
  return np.repeat(m, block_size, axis=-1)[..., :L]


def gaussian_bound(block_size, bits, hops=1):
  """The documented relative error for normal data: sqrt(hops·2 ln B) / (sqrt(12)·qmax)."""
  return math.sqrt(hops * 2 * math.log(block_size)) / (math.sqrt(12) * zq.QMAX[bits])


# ------------------------------------------------------------ single device
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("shape,block", [((4, 64), 64), ((3, 50), 32), ((1000,), 256)])
def test_representable_values_round_trip_exactly(bits, shape, block):
  rng = np.random.default_rng(0)
  n = math.prod(shape)
  x = representable(rng, -(-n // block), block, bits).reshape(-1)[:n].reshape(shape)
  got, _ = roundtrip(x, block, bits)
  np.testing.assert_array_equal(got, x)
  got16, _ = roundtrip(x.astype(jnp.bfloat16), block, bits)  # k·2^e with |k| ≤ 127 fits bf16
  np.testing.assert_array_equal(got16, x)


@pytest.mark.parametrize("bits", [8, 4])
def test_zeros_stay_exactly_zero_without_nan(bits):
  rng = np.random.default_rng(1)
  x = rng.standard_normal((6, 32)).astype(np.float32)
  x[1] = 0.0                                   # a whole block of zeros
  x[3, ::3] = 0.0                              # zeros among other values
  got, scale = roundtrip(x, 32, bits)
  assert np.isfinite(got).all() and np.isfinite(scale).all()
  assert scale[1] == 0.0
  np.testing.assert_array_equal(got[x == 0], 0.0)
  assert not np.signbit(got[1]).any()


@pytest.mark.parametrize("bits", [8, 4])
def test_non_finite_values_poison_their_block_only(bits):
  """A NaN or ±inf makes its whole block NaN (never finite); the other blocks are untouched."""
  rng = np.random.default_rng(2)
  x = rng.standard_normal((6, 16)).astype(np.float32)
  x[1, 3], x[3, 0], x[4, 15] = np.nan, np.inf, -np.inf
  got, scale = roundtrip(x, 16, bits)
  assert np.isnan(got[[1, 3, 4]]).all() and np.isnan(scale[[1, 3, 4]]).all()
  ok = [0, 2, 5]
  assert np.isfinite(got[ok]).all()
  assert (np.abs(got[ok] - x[ok]) <= block_absmax(x[ok], 16) / (2 * zq.QMAX[bits]) * 1.0001).all()


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block", [64, 256, 2048])
def test_every_element_within_half_a_step_of_its_block(bits, block):
  """|deq - x| <= absmax(block) / (2 qmax), on data spanning many magnitudes."""
  rng = np.random.default_rng(3)
  x = (rng.standard_normal(5 * block + 7) * 10.0 ** rng.integers(-6, 6, 5 * block + 7))
  x = x.astype(np.float32)
  got, scale = roundtrip(x, block, bits)
  bound = block_absmax(x[None], block)[0] / (2 * zq.QMAX[bits])
  assert (np.abs(got - x) <= bound * (1 + 1e-5)).all()
  np.testing.assert_allclose(scale, block_absmax(x[None], block)[0][::block] / zq.QMAX[bits],
                             rtol=1e-6)


@pytest.mark.parametrize("bits", [8, 4])
def test_tiny_blocks_round_to_within_half_a_step_or_to_zero(bits):
  """Below qmax * float32's smallest normal the scale is subnormal (XLA:CPU flushes it to 0):
  such a block becomes zeros, never wrapped-around int8 garbage."""
  qmax = zq.QMAX[bits]
  tiny = qmax * np.finfo(np.float32).tiny
  for m in (1e3 * tiny, tiny, tiny / 10):
    x = (np.array([1.0, -1 / 3, 0.5, 1 / 7]) * m).astype(np.float32)
    got, _ = roundtrip(x, 4, bits)
    err = np.abs(got - x).max()
    assert err <= m / (2 * qmax) * 1.001 or (err <= tiny and (got == 0).all()), (m, got)


@pytest.mark.parametrize("bits", [8, 4])
def test_an_outlier_costs_only_its_own_block(bits):
  rng = np.random.default_rng(4)
  qmax, block = zq.QMAX[bits], 64
  x = rng.standard_normal((4, block)).astype(np.float32)
  plain, plain_scale = roundtrip(x, block, bits)
  for outlier in (1e4, 30.0):
    y = x.copy()
    y[2, 17] = outlier
    got, scale = roundtrip(y, block, bits)
    step = outlier / qmax
    assert scale[2] == pytest.approx(step, rel=1e-6)
    assert (np.abs(got[2] - y[2]) <= step / 2 * (1 + 1e-5)).all()   # the documented bound
    big = np.abs(y[2]) >= step / 2   # values at least half a step keep their sign
    assert (np.sign(got[2][big]) == np.sign(y[2][big])).all()
    others = [0, 1, 3]
    np.testing.assert_array_equal(got[others], plain[others])      # other blocks unaffected
    np.testing.assert_array_equal(scale[others], plain_scale[others])


# -------------------------------------------------------------- collectives
@pytest.mark.parametrize("shape,names", MESHES)
@pytest.mark.parametrize("bits", [8, 4])
def test_all_gather_rows_is_lax_all_gather_on_representable_values(shape, names, bits):
  mesh = make_mesh(shape, names)
  rng = np.random.default_rng(5)
  x = representable(rng, 8 * 3, 32, bits).reshape(8, 3 * 32)[:, :90]
  for axes in [names, names[::-1], names[-1]]:   # any order given: mesh order used
    got = per_device(mesh, lambda r: zq.all_gather_rows(r, axes, block_size=32, bits=bits,
                                                        to="varying"), x)
    want = per_device(mesh, lambda r: jax.lax.all_gather(r, zq.mesh_order(axes), axis=0,
                                                         to="varying"), x)
    np.testing.assert_array_equal(got, want)
  full = jax.jit(jax.shard_map(
      lambda r: zq.all_gather_rows(r[0], names, block_size=32, bits=bits), mesh=mesh,
      in_specs=P(names), out_specs=P()))(x)   # to="invarying": returnable with P()
  np.testing.assert_array_equal(np.asarray(full), x)


@pytest.mark.parametrize("bits", [8, 4])
def test_all_gather_rows_error_within_the_bound_on_normal_data(bits):
  mesh = make_mesh((2, 4), ("replica", "data"))
  x = np.random.default_rng(6).standard_normal((8, 8192)).astype(np.float32)
  for block in (64, 256, 2048):
    got = per_device(mesh, lambda r: zq.all_gather_rows(r, ("replica", "data"),
                                                        block_size=block, bits=bits,
                                                        to="varying"), x)
    assert (got == got[0]).all()   # every device sees the same values
    rel = np.linalg.norm(got[0] - x) / np.linalg.norm(x)
    assert rel <= gaussian_bound(block, bits), (block, rel)
    assert (np.abs(got[0] - x) <= block_absmax(x, block) / (2 * zq.QMAX[bits]) * 1.0001).all()


def test_all_gather_any_dimension_matches_lax():
  mesh = make_mesh((2, 4), ("replica", "data"))
  x = representable(np.random.default_rng(7), 8, 30, 8).reshape(8, 2, 15)
  for axis in (0, 1):
    got = per_device(mesh, lambda b: zq.all_gather(b, ("data",), axis=axis, block_size=30,
                                                   to="varying"), x)
    want = per_device(mesh, lambda b: jax.lax.all_gather(b, "data", axis=axis, tiled=True,
                                                         to="varying"), x)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("shape,names", MESHES)
@pytest.mark.parametrize("bits", [8, 4])
def test_psum_scatter_rows_is_lax_psum_scatter_on_representable_values(shape, names, bits):
  """Every device holds the same representable rows: each hop's partial sums stay exactly
  representable (sums over a power-of-two of devices), so the result is exact and the row
  each device keeps must be the one lax.psum_scatter over the mesh-ordered axes gives it."""
  mesh = make_mesh(shape, names)
  rows = representable(np.random.default_rng(8), 8 * 2, 16, bits).reshape(8, 32)
  x = np.broadcast_to(rows, (8, 8, 32))
  want = per_device(mesh, lambda r: jax.lax.psum_scatter(r, names, scatter_dimension=0,
                                                         tiled=True)[0], x)
  np.testing.assert_array_equal(want, 8 * rows)   # lax: row d to device d (mesh order)
  for hops in HOPS[shape]:
    got = per_device(mesh, lambda r: zq.psum_scatter_rows(r, hops, block_size=16, bits=bits), x)
    np.testing.assert_array_equal(got, want, err_msg=str(hops))


def rs_bound(x, block, bits, n_hops):
  """|err| <= hops · Σ_devices absmax(device's block) / (2 qmax), to first order."""
  qmax = zq.QMAX[bits]
  return n_hops * block_absmax(x, block).sum(0) / (2 * qmax) * (1 + 1.0 / qmax)


@pytest.mark.parametrize("shape,names", MESHES)
@pytest.mark.parametrize("bits", [8, 4])
def test_psum_scatter_rows_sums_every_device_within_the_bound(shape, names, bits):
  mesh = make_mesh(shape, names)
  rng = np.random.default_rng(9)
  x = rng.standard_normal((8, 8, 200)) * rng.uniform(0.1, 10, (8, 1, 1))  # device, row, L
  x = (x + 10.0 * np.arange(8)[None, :, None]).astype(np.float32)          # rows differ
  exact = x.sum(0)
  for hops in HOPS[shape]:
    got = per_device(mesh, lambda r: zq.psum_scatter_rows(r, hops, block_size=64, bits=bits), x)
    assert (np.abs(got - exact) <= rs_bound(x, 64, bits, len(hops))).all(), hops


@pytest.mark.parametrize("bits", [8, 4])
def test_psum_scatter_rows_error_within_the_bound_on_normal_data(bits):
  mesh = make_mesh((2, 4), ("replica", "data"))
  x = np.random.default_rng(10).standard_normal((8, 8, 4096)).astype(np.float32)
  exact = x.sum(0)
  for block in (64, 256, 2048):
    for hops in ([("replica", "data")], [("data",), ("replica",)]):
      got = per_device(mesh, lambda r: zq.psum_scatter_rows(r, hops, block_size=block,
                                                            bits=bits), x)
      rel = np.linalg.norm(got - exact) / np.linalg.norm(exact)
      assert rel <= gaussian_bound(block, bits, len(hops)), (block, hops, rel)


# ------------------------------------------------- non-finite values, explicitly
# XLA:CPU's vectorized max drops a NaN (in blocks of 64 and more: the max of the others, or
# -inf, when a reduction holds 64 blocks or more), so finiteness must be carried
# explicitly. A row is a bucket of four leaves: one element (it travels exactly), 64 whole
# blocks, one short block, and a block plus a short one. Each output gets at most one
# poisoned value per block, over the outputs at every position class: first, second,
# middle, second-to-last and last of a block, in the second and a later block of a leaf,
# in a short block, in the one-element leaf.
NB = 64
SEGS = (1, 64 * NB, 10, NB + 10)
WIDTH = sum(SEGS)
POSITIONS = [  # per leaf of SEGS: per block of it, the position poisoned for output o
    [[0, 0, None, None, None, None, 0, None]],
    [[0, 1, 7, NB // 2, NB - 2, NB - 1, None, 0],
     [NB, None, NB + 7, 2 * NB - 1, NB + 1, NB + 7, None, 2 * NB - 1],
     [None, 41 * NB + 3, None, 41 * NB, 42 * NB - 1, None, 41 * NB + 30, None]],
    [[None, 0, 5, None, 9, 9, 0, None]],
    [[NB - 1, None, 0, NB // 2, None, 1, None, NB - 2],
     [None, NB, None, NB + 9, NB + 4, None, NB + 9, None]],
]
BAD = [np.nan, np.inf, -np.inf, np.nan, np.nan, -np.inf, np.inf, np.nan]


def poison(row, o):
  """Poisons ``row`` (WIDTH,) in place at output ``o``'s positions."""
  for start, leaf in zip(np.cumsum((0,) + SEGS[:-1]), POSITIONS):
    for k, block in enumerate(leaf):
      if block[o] is not None:
        row[start + block[o]] = BAD[(o + k) % 8]


def block_ids(bits, parts=1):
  """Per element of a SEGS row, the block it travels in (-1: an exact leaf, every element
  on its own); ``parts``: each leaf first cut into that many parts (`zq.psum`)."""
  ids = []
  for j, size in enumerate(SEGS):
    i = np.arange(size)
    if not zq.sends_quantized(size, itemsize=4, block_size=NB, bits=bits, parts=parts):
      ids.append(np.full(size, -1))
      continue
    chunk = -(-size // parts)
    ids.append(j * 10**6 + (i // chunk) * 1000 + (i % chunk) // NB)
  return np.concatenate(ids)


def blocks_hit(bad_mask, ids):
  """Every element whose block holds a non-finite value (an exact element: only itself)."""
  return (np.isin(ids, ids[bad_mask]) & (ids >= 0)) | bad_mask


RS_CASES = {  # hops over the (2, 4) mesh; "across only": the rows of one hop over hosts
    "within_then_across": [("data",), ("replica",)],
    "across_then_within": [("replica",), ("data",)],
    "one_hop": [("replica", "data")],
    "across_only": [("replica",)],
}


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("case", RS_CASES)
def test_psum_scatter_rows_never_hides_a_nan_or_inf(case, bits):
  mesh = make_mesh((2, 4), ("replica", "data"))
  hops = RS_CASES[case]
  rng = np.random.default_rng(20)
  rows = 2 if case == "across_only" else 8
  x = rng.standard_normal((8, rows, WIDTH)).astype(np.float32)
  sources = {}   # output device -> the (device, row) pairs summed into it
  for o in range(8):
    if case == "across_only":
      sources[o] = [(o % 4, o // 4), (o % 4 + 4, o // 4)]
    else:
      sources[o] = [(d, o) for d in range(8)]
    d, r = sources[o][-1] if o < 4 else sources[o][0]   # a device of the other host
    poison(x[d, r], o)
  got = per_device(mesh, lambda r: zq.psum_scatter_rows(r, hops, block_size=NB, bits=bits,
                                                        segments=SEGS), x)
  for o in range(8):
    with np.errstate(invalid="ignore"):
      exact = sum(x[d, r].astype(np.float64) for d, r in sources[o])
    want = blocks_hit(~np.isfinite(exact), block_ids(bits))
    assert want.any()
    np.testing.assert_array_equal(~np.isfinite(got[o]), want, err_msg=f"output {o}")


@pytest.mark.parametrize("bits", [8, 4])
def test_all_gather_rows_and_psum_never_hide_a_nan_or_inf(bits):
  mesh = make_mesh((2, 4), ("replica", "data"))
  x = np.random.default_rng(21).standard_normal((8, WIDTH)).astype(np.float32)
  for o in range(8):
    poison(x[o], o)
  got = per_device(mesh, lambda r: zq.all_gather_rows(r, ("replica", "data"), block_size=NB,
                                                      bits=bits, to="varying",
                                                      segments=SEGS), x)
  for o in range(8):
    want = blocks_hit(~np.isfinite(x[o]), block_ids(bits))
    assert (~np.isfinite(got[:, o]) == want).all(), o   # on every device alike
  summed = per_device(mesh, lambda r: zq.psum(r, "replica", block_size=NB, bits=bits,
                                              segments=SEGS), x)
  for o in range(8):   # the all-reduce across hosts: a reduce-scatter, then an all-gather
    with np.errstate(invalid="ignore"):
      exact = x[o % 4].astype(np.float64) + x[o % 4 + 4]
    want = blocks_hit(~np.isfinite(exact), block_ids(bits, parts=2))
    np.testing.assert_array_equal(~np.isfinite(summed[o]), want, err_msg=f"device {o}")


def test_psum_scatter_any_dimension_matches_lax():
  mesh = make_mesh((2, 4), ("replica", "data"))
  rows = representable(np.random.default_rng(12), 8, 12, 8)   # one block a row
  x = np.broadcast_to(rows.reshape(32, 3).T, (8, 3, 32))       # rows along dimension 1
  hops = [("data",), ("replica",)]
  got = per_device(mesh, lambda g: zq.psum_scatter(g, hops, scatter_dimension=1,
                                                   block_size=12), x)
  want = per_device(mesh, lambda g: jax.lax.psum_scatter(g, ("replica", "data"),
                                                         scatter_dimension=1, tiled=True), x)
  np.testing.assert_array_equal(got, want)
  with pytest.raises(ValueError, match="multiple of the 8 devices"):   # dimension 0 is 3
    per_device(mesh, lambda g: zq.psum_scatter(g, hops, scatter_dimension=0, block_size=12), x)


# ------------------------------------------------------------- compiled HLO
def compiled_collectives(mesh, fn, x):
  axes = mesh.axis_names
  f = jax.jit(jax.shard_map(lambda a: fn(a[0])[None], mesh=mesh, in_specs=P(axes),
                            out_specs=P(axes)))
  return hlo.collectives(f.lower(jnp.asarray(x)).compile().as_text())


def test_hlo_two_hop_reduce_scatter_sends_int8_within_then_across_hosts():
  mesh = make_mesh((2, 4), ("replica", "data"))
  L, block = 1024, 256
  x = np.zeros((8, 8, L), np.float32)
  nbytes = {}
  for bits in (8, 4):
    cs = compiled_collectives(mesh, lambda r: zq.psum_scatter_rows(
        r, [("data",), ("replica",)], block_size=block, bits=bits), x)
    assert [c.op for c in cs] == ["all-to-all", "all-to-all"], cs
    assert all(re.fullmatch(r"\(?(s8\[[\d,]*\](\{[\d,]*\})?,? ?)+\)?", c.shape_text)
               for c in cs), [c.shape_text for c in cs]
    within, across = cs
    assert sorted(within.groups) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert sorted(across.groups) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    per_block = block * bits // 8 + 4   # values and one float32 scale
    assert within.nbytes == 8 * (L // block) * per_block      # all 8 rows, int8 + scales
    assert across.nbytes == 2 * (L // block) * per_block      # only the 2 partial sums
    nbytes[bits] = within.nbytes + across.nbytes
  assert nbytes[4] < 0.52 * nbytes[8]


def test_hlo_a_bucket_sends_what_the_rule_says_never_more_than_exact():
  """Segments of a bucket: tiny leaves travel exactly, the others quantized with a short last
  block; the all-to-all's buffer is the rule's bytes, below the exact bytes."""
  mesh = make_mesh((8,), ("data",))
  segs = (1, 3, 4, 5, 300, 1000)   # bf16: up to 4 elements exact (4 + 4 bytes > 8)
  x = np.zeros((8, 8, sum(segs)), jnp.bfloat16)
  cs = compiled_collectives(mesh, lambda r: zq.psum_scatter_rows(
      r, [("data",)], block_size=256, segments=segs), x)
  rule = [zq.quantized_bytes(s, block_size=256) if zq.sends_quantized(
      s, itemsize=2, block_size=256) else 2 * s for s in segs]
  assert rule == [2, 6, 8, 9, 300 + 8, 1000 + 16]
  assert [c.op for c in cs] == ["all-to-all"] and cs[0].nbytes == 8 * sum(rule)
  assert cs[0].nbytes < 8 * 2 * sum(segs)


def test_psum_sums_exact_and_quantized_leaves():
  mesh = make_mesh((2, 4), ("replica", "data"))
  segs = (1, 2, 130)   # f32: the 1-element leaf is summed exactly, the others in int8
  rng = np.random.default_rng(17)
  x = rng.standard_normal((8, sum(segs))).astype(np.float32)
  got = per_device(mesh, lambda r: zq.psum(r, "replica", block_size=64, segments=segs), x)
  exact = x + np.roll(x, 4, axis=0)   # device d and d +- 4 (the other host)
  np.testing.assert_array_equal(got[:, 0], exact[:, 0])
  err = np.abs(got - exact)[:, 1:]   # rounded twice: the reduce-scatter and the all-gather
  assert (err <= 2 * 2 * np.abs(x).max() / (2 * 127) * 1.01).all() and err.max() > 0
  assert (got == got[np.arange(8) % 4]).all()   # both hosts hold the same sum


def test_psum_of_float16_sums_in_float32_to_the_end():
  """A sum beyond float16's range comes back finite: the partial sums are gathered from
  float32 (they were cast back to float16, overflowed, and poisoned their blocks)."""
  mesh = make_mesh((8,), ("data",))
  x = np.full((8, 512), 20000, np.float16)
  got = per_device(mesh, lambda r: zq.psum(r, "data", block_size=64), x)
  np.testing.assert_allclose(got, 8 * 20000.0, rtol=1e-2)


def test_the_bucket_forms_check_dtype_block_size_and_bits():
  mesh = make_mesh((8,), ("data",))
  call = lambda x, **kw: per_device(mesh, lambda r: zq.join_pieces(zq.gather_pieces(
      [r, r], "data", **kw))[0], x)
  with pytest.raises(ValueError, match=r"block_size"):
    call(np.ones((8, 64), np.float32), block_size=63, bits=4)
  with pytest.raises(ValueError, match=r"bits"):
    call(np.ones((8, 64), np.float32), block_size=64, bits=3)
  with pytest.raises(TypeError, match=r"non-float.*pieces has dtype int32"):
    call(np.ones((8, 64), np.int32), block_size=64)


def test_hlo_quantized_gather_is_an_int8_all_gather():
  mesh = make_mesh((8,), ("data",))
  cs = compiled_collectives(mesh, lambda r: zq.all_gather_rows(r, "data", block_size=128,
                                                               to="varying"),
                            np.zeros((8, 512), np.float32))
  assert [c.op for c in cs] == ["all-gather"] and cs[0].shape_text.startswith("s8[")
  assert cs[0].nbytes == 8 * 4 * (128 + 4)


# ---------------------------------------------------- differentiable gather
def grads_through(mesh, gather, x, w):
  """jax.grad of sum(w_d · gather(row_d) + gathered²/2) on every device d: its row's gradient."""
  axes = mesh.axis_names

  def local(r, wd):
    return jax.grad(lambda r: jnp.sum(wd * gather(r) + 0.5 * gather(r) ** 2))(r)

  f = jax.jit(jax.shard_map(lambda r, wd: local(r[0], wd[0])[None], mesh=mesh,
                            in_specs=(P(axes), P(axes)), out_specs=P(axes)))
  return np.asarray(f(jnp.asarray(x), jnp.asarray(w)))


@pytest.mark.parametrize("shape,names", MESHES)
def test_gather_rows_vjp_gradient_is_the_reduced_gradient(shape, names):
  mesh = make_mesh(shape, names)
  rng = np.random.default_rng(13)
  x = representable(rng, 8 * 2, 32, 8).reshape(8, 64) / 2.0 ** 10   # gathers exactly
  w = rng.standard_normal((8, 8, 64)).astype(np.float32)            # device, row, L
  want = w.sum(0) + 8 * x            # single-device reference: d/dx_d Σ_dev loss_dev
  exact = grads_through(mesh, lambda r: jax.lax.all_gather(r, names, axis=0, to="varying"), x, w)
  np.testing.assert_allclose(exact, want, rtol=1e-5, atol=1e-5)
  got = grads_through(mesh, lambda r: zq.gather_rows_vjp(r, names, block_size=32), x, w)
  np.testing.assert_array_equal(got, exact)   # same forward values, same reduce-scatter
  for hops in HOPS[shape]:
    q = grads_through(mesh, lambda r: zq.gather_rows_vjp(
        r, names, block_size=32, backward="quantized", hops=hops), x, w)
    cts = w + x[None]   # every device's cotangent of the gathered rows
    assert (np.abs(q - want) <= rs_bound(cts, 32, 8, len(hops))).all(), hops
    assert not np.array_equal(q, exact)


def test_gather_rows_vjp_over_the_inner_axis_only():
  """hpZ-like: gather within a host; the gradient is reduced within that host only."""
  mesh = make_mesh((2, 4), ("replica", "data"))
  rng = np.random.default_rng(14)
  x = representable(rng, 8, 32, 8).reshape(8, 32)
  w = rng.standard_normal((8, 4, 32)).astype(np.float32)
  got = grads_through(mesh, lambda r: zq.gather_rows_vjp(r, "data", block_size=32), x, w)
  host = np.arange(8) // 4
  want = np.stack([w[host == host[d], d % 4].sum(0) + 4 * x[d] for d in range(8)])
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backward", ["exact", "quantized"])
def test_gather_rows_vjp_in_a_checkpointed_scan_over_layers(backward):
  """The stage-3 stacked path: one gather per layer inside a jax.checkpoint-ed lax.scan."""
  mesh = make_mesh((2, 4), ("replica", "data"))
  names = mesh.axis_names
  rng = np.random.default_rng(16)
  blocks = (representable(rng, 8 * 3, 16, 8) / 2.0 ** 12).reshape(8, 3, 16)  # device, layer
  h0 = rng.standard_normal((8, 128)).astype(np.float32)                    # device's batch

  def grads(gather):
    def local(b, h):
      def loss(b):
        @jax.checkpoint
        def layer(h, row):
          return jnp.tanh(h * gather(row).reshape(-1)), None
        return jnp.sum(jax.lax.scan(layer, h, b)[0] ** 2)
      return jax.grad(loss)(b)

    f = jax.jit(jax.shard_map(lambda b, h: local(b[0], h[0])[None], mesh=mesh,
                              in_specs=(P(names), P(names)), out_specs=P(names)),
                compiler_options=FULL_COMPILE)  # bit for bit: as users compile
    return np.asarray(f(jnp.asarray(blocks), jnp.asarray(h0)))

  exact = grads(lambda r: jax.lax.all_gather(r, names, axis=0, to="varying"))
  got = grads(lambda r: zq.gather_rows_vjp(r, names, block_size=16, backward=backward,
                                           hops=None if backward == "exact" else
                                           [("data",), ("replica",)]))
  if backward == "exact":
    np.testing.assert_array_equal(got, exact)
  else:
    rel = np.linalg.norm(got - exact) / np.linalg.norm(exact)
    assert 0 < rel <= gaussian_bound(16, 8, 2), rel   # measured 0.28%, bound 0.76%


def test_gather_rows_vjp_keeps_a_bfloat16_row_bfloat16():
  mesh = make_mesh((8,), ("data",))
  x = representable(np.random.default_rng(15), 8, 16, 8).astype(jnp.bfloat16)

  def fn(r):
    out, pull = jax.vjp(lambda r: zq.gather_rows_vjp(r, "data", block_size=16), r)
    assert out.dtype == jnp.float32 and pull(out)[0].dtype == jnp.bfloat16
    return out

  got = per_device(mesh, fn, x)
  np.testing.assert_array_equal(got, np.broadcast_to(x.astype(np.float32), (8, 8, 16)))


# ------------------------------------------------------------------ misuse
def test_clear_errors_for_what_cannot_be_quantized():
  with pytest.raises(TypeError, match=r"non-float leaf: params\['step'\] has dtype int32"):
    zq.check_quantizable(jnp.int32, block_size=256, bits=8, name="params['step']")
  with pytest.raises(TypeError, match="non-float leaf: x has dtype bool"):
    zq.quantize(jnp.ones(4, bool), block_size=4)
  for bad in (0, -8, 2.5, True, "256"):
    with pytest.raises(ValueError, match=f"block_size={bad!r}.*positive int"):
      zq.quantize(jnp.ones(4), block_size=bad)
  with pytest.raises(ValueError, match="block_size=131072 for x: at most 65536"):
    zq.quantize(jnp.ones(4), block_size=2**17)
  with pytest.raises(ValueError, match="block_size=7 .*int4 packs two values a byte.*use 8"):
    zq.quantize(jnp.ones(4), block_size=7, bits=4)
  with pytest.raises(ValueError, match="bits=3 .*expected 8 .*or 4"):
    zq.quantize(jnp.ones(4), block_size=4, bits=3)


def test_differentiating_the_plain_quantizers_is_refused_not_zero():
  with pytest.raises(TypeError, match="zero derivative.*gather_rows_vjp"):
    jax.grad(lambda x: zq.dequantize(*zq.quantize(x, block_size=4), shape=4).sum())(jnp.ones(4))
  mesh = make_mesh((8,), ("data",))
  with pytest.raises(TypeError, match="silently give zero gradients"):
    per_device(mesh, lambda r: jax.grad(lambda r: zq.all_gather_rows(
        r, "data", block_size=8, to="varying").sum())(r), np.ones((8, 8), np.float32))
  stopped = jax.grad(lambda x: zq.dequantize(*zq.quantize(jax.lax.stop_gradient(x),
                                                          block_size=4), shape=4).sum() + x.sum())
  np.testing.assert_array_equal(stopped(jnp.ones(4)), 1.0)


def test_clear_errors_for_hops_that_do_not_fit():
  mesh = make_mesh((2, 4), ("replica", "data"))
  x = np.zeros((8, 8, 16), np.float32)
  call = lambda fn: per_device(mesh, fn, x)
  with pytest.raises(ValueError, match=r"got 8 rows, but the hops' axes \('data',\) span 4"):
    call(lambda r: zq.psum_scatter_rows(r, [("data",)], block_size=8))
  with pytest.raises(ValueError, match="each axis in one hop"):
    call(lambda r: zq.psum_scatter_rows(r, [("data",), ("data", "replica")], block_size=8))
  with pytest.raises(ValueError, match="cover exactly the gathered axes"):
    call(lambda r: zq.gather_rows_vjp(r[0], "data", block_size=8, backward="quantized",
                                      hops=[("replica",)]))
  with pytest.raises(ValueError, match="backward='quantized' only"):
    call(lambda r: zq.gather_rows_vjp(r[0], "data", block_size=8, hops=[("data",)]))
  with pytest.raises(ValueError, match="expected 'exact' or 'quantized'"):
    call(lambda r: zq.gather_rows_vjp(r[0], "data", block_size=8, backward="int8"))


# -------------------------------------------------------------------- docs
def test_docs_page_snippets_run():
  text = (ROOT / "docs" / "guides" / "zeropp_error.md").read_text()
  blocks = re.findall(r"```python\n(.*?)```", text, re.S)
  assert blocks
  for code in blocks:
    exec(compile(code, "zeropp_error.md", "exec"), {})
