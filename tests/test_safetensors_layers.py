"""Stacked leaves under per-layer Hub names: ``rename`` returning a name with ``{i}``.

`zj.export_safetensors` writes a stacked leaf (layers along its first dimension, marked by
the step's ``stacked=``) as one tensor per layer, ``{i}`` the layer index, as the Hub names
them (``model.layers.7.mlp.up_proj.weight``); `zj.load_safetensors` stacks them back into the
split leaf, each device reading its rows of each layer. The reference is computed without
any sharding: the parameters as numpy arrays, cut into layers (and transposed) on the host,
and the files read with the safetensors library's own ``safe_open``/``load_file``. Nothing
is computed on the way (only copied, transposed or rounded once by ``astype``), so every
comparison is bit for bit.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from safetensors import safe_open
from safetensors.numpy import save_file

import zero_jax as zj
from zero_jax.checkpoint import blocks, layer_names
from zero_jax.checkpoint import safetensors_files
from zero_jax.checkpoint import safetensors_format as fmt

LAYERS = 3
# "w" is split along its 16 rows at stage 3 and written transposed per layer (PyTorch's
# (out, in)); the others are uneven on purpose (9, 10 and 7 rows do not divide over 8
# devices: padded blocks, loaded replicated); "scale" is a scalar per layer.
SHAPES = {"embed": (10, 6), "layers": {"w": (LAYERS, 16, 7), "b": (LAYERS, 9),
                                       "scale": (LAYERS,)}, "head": (6, 4)}
HUB = {"layers.w": ("model.layers.{i}.mlp.up_proj.weight", True),
       "layers.b": "model.layers.{i}.mlp.up_proj.bias",
       "layers.scale": "model.layers.{i}.input_layernorm.weight",
       "embed": "model.embed_tokens.weight", "head": ("lm_head.weight", True)}


def rename(name):
  return HUB[name]


def make_params():
  rng = np.random.default_rng(7)
  return jax.tree.map(lambda s: rng.normal(size=s).astype(np.float32), SHAPES,
                      is_leaf=lambda s: isinstance(s, tuple))


def like_of(params, dtype=None):
  return jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, dtype or v.dtype), params)


def hub_tensors(params, dtype=np.float32) -> dict:
  """What the files must hold, cut into layers and transposed on the host (no sharding)."""
  out = {"model.embed_tokens.weight": params["embed"], "lm_head.weight": params["head"].T}
  for i in range(LAYERS):
    out[f"model.layers.{i}.mlp.up_proj.weight"] = params["layers"]["w"][i].T
    out[f"model.layers.{i}.mlp.up_proj.bias"] = params["layers"]["b"][i]
    out[f"model.layers.{i}.input_layernorm.weight"] = params["layers"]["scale"][i]
  return {k: np.array(v, order="C").astype(dtype) for k, v in out.items()}


def read_files(directory) -> dict:
  """Every tensor of the export in ``directory``, read with the safetensors library."""
  got = {}
  for f in sorted(os.listdir(directory)):
    if f.endswith(".safetensors"):
      with safe_open(os.path.join(directory, f), "np") as g:
        got.update({k: g.get_tensor(k) for k in g.keys()})
  return got


def assert_bitwise(got: dict, expected: dict) -> None:
  assert sorted(got) == sorted(expected)
  for k, v in expected.items():
    assert got[k].dtype == v.dtype and got[k].shape == v.shape, (k, got[k].shape, v.shape)
    assert got[k].tobytes() == v.tobytes(), k


def loss_fn(p, b):
  return sum(jnp.sum(x.astype(jnp.float32)) for x in jax.tree.leaves(p)) * jnp.mean(b)


STACKED = lambda path, _: "layers" in jax.tree_util.keystr(path)
CONFIGS = {
    "stage1_8": dict(mesh=((8,), ("data",)), stage=1),
    "stage2_8": dict(mesh=((8,), ("data",)), stage=2),
    "stage3_8": dict(mesh=((8,), ("data",)), stage=3),
    "stage3_bf16_8": dict(mesh=((8,), ("data",)), stage=3, precision="bf16"),
    "stage3_replica_2x4": dict(mesh=((2, 4), ("replica", "data")), stage=3,
                               replica_axis="replica"),
    "stage3_hpz_2x4": dict(mesh=((2, 4), ("host", "data")), stage=3,
                           axis_name=("host", "data"), hpz_axis="data"),
    "stage3_model_4x2": dict(mesh=((4, 2), ("data", "model")), stage=3,  # layers' rows on
                             param_specs={"embed": P(), "head": P(),     # "model" too
                                          "layers": {"w": P(None, "model", None), "b": P(),
                                                     "scale": P()}}),
}


def make_step(name, stacked=STACKED):
  kw = dict(CONFIGS[name])
  shape, axes = kw.pop("mesh")
  return zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), mesh=jax.make_mesh(shape, axes),
                                    stacked=stacked, **kw)


# ------------------------------------------------------------------ round trips
@pytest.mark.parametrize("max_shard_bytes", [None, 300], ids=["one_file", "index"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_stacked_leaf_goes_out_as_one_tensor_per_layer_and_comes_back_bit_for_bit(
    name, max_shard_bytes, tmp_path, monkeypatch):
  params = make_params()
  step = make_step(name)
  state = step.init(params)
  kw = {"max_shard_bytes": max_shard_bytes} if max_shard_bytes else {}
  files = zj.export_safetensors(step, state, tmp_path, rename=rename, chunk_bytes=64, **kw)
  assert (fmt.INDEX in files) == bool(max_shard_bytes), files
  assert_bitwise(read_files(tmp_path), hub_tensors(params))
  if max_shard_bytes:  # the index places every layer's tensor in the file holding it
    weight_map = json.loads((tmp_path / fmt.INDEX).read_text())["weight_map"]
    assert set(weight_map) == set(hub_tensors(params))
    for k, f in weight_map.items():
      with safe_open(str(tmp_path / f), "np") as g:
        assert k in g.keys(), (k, f)

  reads = []  # (tensor, box) of every read: each layer read by blocks, never whole
  fill = safetensors_files.OpenFiles._fill  # pylint: disable=protected-access
  monkeypatch.setattr(safetensors_files.OpenFiles, "_fill",
                      lambda self, t, boxes, outs: (reads.extend((t, b) for b in boxes),
                                                    fill(self, t, boxes, outs))[1])
  loaded = zj.load_safetensors(tmp_path, like_of(params), step=step, rename=rename)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a).view(np.uint32),
                                                          b.view(np.uint32)), loaded, params)
  # Each layer's tensor is read as the blocks the devices hold of that layer.
  w = loaded["layers"]["w"]
  held = {blocks.layer_box(tuple(s.indices(n)[:2] for s, n in zip(idx, w.shape)), i)
          for idx in w.sharding.devices_indices_map(w.shape).values() for i in range(LAYERS)}
  for i in range(LAYERS):
    got = {b for t, b in reads if t.name == f"model.layers.{i}.mlp.up_proj.weight"}
    assert got and got <= held - {None}, (i, got)
  if CONFIGS[name]["stage"] == 3:  # split along its rows: no device reads a whole layer
    assert w.sharding.spec[1] is not None, w.sharding.spec
    assert all(b != ((0, 16), (0, 7)) for t, b in reads if t.layer is not None and t.transpose)
  back = step.get_params(step.init(loaded))
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), back, params)


@pytest.mark.parametrize("name", ["stage2_8", "stage3_bf16_8"])
def test_per_layer_names_with_dtype_write_each_layer_converted(name, tmp_path):
  """dtype=bfloat16: each layer's tensor is the float32 layer rounded once (numpy's astype on
  the host is the reference), and loads back as bfloat16 or, cast=True, as float32."""
  params = make_params()
  step = make_step(name)
  zj.export_safetensors(step, step.init(params), tmp_path, rename=rename, dtype=jnp.bfloat16,
                        max_shard_bytes=200)
  expected = hub_tensors(params, jnp.bfloat16)
  assert_bitwise(read_files(tmp_path), expected)
  back = zj.load_safetensors(tmp_path, like_of(params, jnp.bfloat16), step=step, rename=rename)
  assert back["layers"]["w"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(back["layers"]["w"]).astype(np.float32),
                                params["layers"]["w"].astype(jnp.bfloat16).astype(np.float32))
  back = zj.load_safetensors(tmp_path, like_of(params), step=step, rename=rename, cast=True)
  np.testing.assert_array_equal(np.asarray(back["layers"]["b"]),
                                params["layers"]["b"].astype(jnp.bfloat16).astype(np.float32))


class Block(nnx.Module):
  def __init__(self, rngs):
    self.up = nnx.Linear(6, 10, rngs=rngs)
    self.norm = nnx.LayerNorm(10, rngs=rngs)

  def __call__(self, x):
    return self.norm(nnx.gelu(self.up(x)))


class Stacked(nnx.Module):
  """3 blocks made with nnx.vmap: every Block variable is (3, ...)."""

  def __init__(self, rngs):
    self.embed = nnx.Embed(11, 6, rngs=rngs)

    @nnx.split_rngs(splits=LAYERS)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return Block(rngs)
    self.blocks = make(rngs)


NNX_HUB = {"embed.embedding": "model.embed_tokens.weight",
           "blocks.up.kernel": ("model.layers.{i}.mlp.up_proj.weight", True),
           "blocks.up.bias": "model.layers.{i}.mlp.up_proj.bias",
           "blocks.norm.scale": "model.layers.{i}.post_attention_layernorm.weight",
           "blocks.norm.bias": "model.layers.{i}.post_attention_layernorm.bias"}


@pytest.mark.parametrize("name", ["stage3_8", "stage3_hpz_2x4", "stage1_8"])
def test_an_nnx_vmap_model_round_trips_through_per_layer_names(name, tmp_path):
  model = Stacked(nnx.Rngs(0))
  step = make_step(name, stacked=nnx.PathContains("blocks"))
  ref = {jax.tree_util.keystr(p): np.asarray(v)
         for p, v in jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]}
  zj.export_safetensors(step, step.init(model), tmp_path, rename=NNX_HUB.__getitem__,
                        max_shard_bytes=400)
  kernel = ref["['blocks']['up']['kernel'].value"]
  expected = {"model.embed_tokens.weight": ref["['embed']['embedding'].value"]}
  for i in range(LAYERS):
    expected[f"model.layers.{i}.mlp.up_proj.weight"] = np.ascontiguousarray(kernel[i].T)
    expected[f"model.layers.{i}.mlp.up_proj.bias"] = ref["['blocks']['up']['bias'].value"][i]
    for part in ("scale", "bias"):
      expected[f"model.layers.{i}.post_attention_layernorm.{part}".replace(
          "scale", "weight")] = ref[f"['blocks']['norm']['{part}'].value"][i]
  assert_bitwise(read_files(tmp_path), expected)
  # Into a model initialised otherwise: every parameter is the exported one, bit for bit.
  loaded = zj.load_safetensors(tmp_path, lambda: Stacked(nnx.Rngs(5)), step=step,
                               rename=NNX_HUB.__getitem__)
  got = {jax.tree_util.keystr(p): np.asarray(v)
         for p, v in jax.tree_util.tree_flatten_with_path(nnx.state(loaded, nnx.Param))[0]}
  assert sorted(got) == sorted(ref)
  for k in ref:
    assert got[k].tobytes() == ref[k].tobytes(), k


def test_per_layer_tensors_written_as_transformers_writes_them_load_stacked(tmp_path):
  """A Hub checkpoint: per-layer (out, in) weights in two files with an index, written with
  the safetensors library (as save_pretrained writes them), loaded into the stacked split
  leaf at stage 3."""
  params = make_params()
  tensors = hub_tensors(params)
  names = sorted(tensors)
  files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
  weight_map = {k: files[j % 2] for j, k in enumerate(names)}  # layers across both files
  for f in files:
    save_file({k: tensors[k] for k in names if weight_map[k] == f}, str(tmp_path / f),
              metadata={"format": "pt"})
  (tmp_path / fmt.INDEX).write_text(json.dumps(
      {"metadata": {"total_size": sum(v.nbytes for v in tensors.values())},
       "weight_map": weight_map}))
  step = make_step("stage3_8")
  loaded = zj.load_safetensors(tmp_path, like_of(params), step=step, rename=rename)
  for i in range(LAYERS):
    np.testing.assert_array_equal(np.asarray(loaded["layers"]["w"])[i],
                                  tensors[f"model.layers.{i}.mlp.up_proj.weight"].T)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), loaded, params)
  assert loaded["layers"]["w"].sharding.spec[0] is None  # the layers stay whole per device


# ------------------------------------------------------------------ refused
@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  params = make_params()
  step = make_step("stage3_8")
  state = step.init(params)
  d = tmp_path_factory.mktemp("hub")
  zj.export_safetensors(step, state, d, rename=rename)
  return dict(step=step, state=state, dir=d, params=params)


def test_layer_names_on_a_leaf_that_is_not_stacked_are_refused_naming_it(exported, tmp_path):
  step = make_step("stage3_8", stacked=lambda path, _: "['w']" in jax.tree_util.keystr(path))
  state = step.init(exported["params"])
  match = (r"returned 'model.layers.\{i\}.mlp.up_proj.bias', whose '\{i\}' asks for one tensor "
           r"per layer, but the step does not hold params\['layers'\]\['b'\] as a stack of "
           r"layers.*stacked=")
  with pytest.raises(ValueError, match=match):
    zj.export_safetensors(step, state, tmp_path / "x", rename=rename)
  assert not (tmp_path / "x").exists()
  with pytest.raises(ValueError, match=match):
    zj.load_safetensors(exported["dir"], like_of(exported["params"]), step=step, rename=rename)


@pytest.mark.parametrize("bad", ["h.{j}.w", "h.{}.w", "h.{i:02d}.w", "h.{{i}}.w", "h.{i}.w}",
                                 "h{.{i}"])
def test_other_braces_and_format_fields_are_refused_naming_the_leaf(bad, exported, tmp_path):
  ren = lambda n: bad if n == "layers.b" else rename(n)
  match = (rf"rename\('layers.b'\) for the leaf params\['layers'\]\['b'\] returned "
           rf"'{bad.replace('{', '[{]').replace('}', '[}]').replace('.', '[.]')}', which "
           rf"holds braces other than '\{{i\}}'")
  with pytest.raises(ValueError, match=match):
    zj.export_safetensors(exported["step"], exported["state"], tmp_path, rename=ren)
  with pytest.raises(ValueError, match=match):
    zj.load_safetensors(exported["dir"], like_of(exported["params"]), step=exported["step"],
                        rename=ren)


def test_names_colliding_across_layers_or_leaves_are_refused_naming_both(exported, tmp_path):
  # A layer's name is another leaf's name.
  ren = lambda n: "model.layers.1.mlp.up_proj.bias" if n == "embed" else rename(n)
  with pytest.raises(ValueError, match=r"the leaves params\['embed'\] and params\['layers'\]"
                                       r"\['b'\] \(layer 1 of 3\) both map to the tensor name "
                                       r"'model.layers.1.mlp.up_proj.bias'"):
    zj.export_safetensors(exported["step"], exported["state"], tmp_path, rename=ren)
  # Two stacked leaves under one per-layer name.
  ren = lambda n: "model.layers.{i}.x" if n.startswith("layers.") else rename(n)
  with pytest.raises(ValueError, match=r"params\['layers'\]\['b'\] \(layer 0 of 3\) and "
                                       r"params\['layers'\]\['scale'\] \(layer 0 of 3\) both "
                                       r"map to the tensor name 'model.layers.0.x'"):
    zj.load_safetensors(exported["dir"], like_of(exported["params"]), step=exported["step"],
                        rename=ren)
  # Transposing a layer that is not 2-D.
  ren = lambda n: ("model.layers.{i}.b", True) if n == "layers.b" else rename(n)
  with pytest.raises(ValueError, match=r"transpose the leaf params\['layers'\]\['b'\], named "
                                       r"per layer \('\{i\}'\), whose layers have 1 dimensions"):
    zj.export_safetensors(exported["step"], exported["state"], tmp_path, rename=ren)


def _rewrite(src, dst, edit) -> None:
  """The export in ``src`` as one file in ``dst``, its tensors edited by ``edit(dict)``."""
  tensors = read_files(src)
  edit(tensors)
  os.makedirs(dst, exist_ok=True)
  save_file(tensors, os.path.join(dst, fmt.SINGLE), metadata={"format": "pt"})


def test_a_missing_layer_is_named_with_its_index_and_the_template(exported, tmp_path):
  _rewrite(exported["dir"], tmp_path, lambda t: t.pop("model.layers.1.mlp.up_proj.bias"))
  with pytest.raises(KeyError, match=r"the stacked leaf params\['layers'\]\['b'\] \(3 layers\) "
                                     r"reads one tensor per layer, "
                                     r"'model.layers.\{i\}.mlp.up_proj.bias' for \{i\} = 0..2, "
                                     r"and \S+ lacks layer\(s\) \[1\]: "
                                     r"'model.layers.1.mlp.up_proj.bias'"):
    zj.load_safetensors(tmp_path, like_of(exported["params"]), step=exported["step"],
                        rename=rename)


@pytest.mark.parametrize("what", ["shape", "dtype"])
def test_layers_of_different_shapes_or_dtypes_are_named(what, exported, tmp_path):
  def edit(t):
    k = "model.layers.2.mlp.up_proj.bias"
    t[k] = np.zeros(10, np.float32) if what == "shape" else t[k].astype(np.float16)
  _rewrite(exported["dir"], tmp_path, edit)
  shown = r"\[10\]" if what == "shape" else "F16"
  first = r"\[9\]" if what == "shape" else "F32"
  for cast in (False, True):
    with pytest.raises(ValueError, match=rf"the per-layer tensors of the stacked leaf "
                                         rf"params\['layers'\]\['b'\] differ in {what}: "
                                         rf"'model.layers.0.mlp.up_proj.bias' is {first} and "
                                         rf"'model.layers.2.mlp.up_proj.bias' is {shown}"):
      zj.load_safetensors(tmp_path, like_of(exported["params"]), step=exported["step"],
                          rename=rename, cast=cast)


def test_layers_past_the_leafs_first_dimension_are_an_error_or_with_strict_false_a_warning(
    exported, tmp_path):
  def edit(t):
    t["model.layers.3.mlp.up_proj.weight"] = t["model.layers.2.mlp.up_proj.weight"]
  _rewrite(exported["dir"], tmp_path, edit)
  like = like_of(exported["params"])
  match = (r"holds layers past the 3 of the stacked leaf params\['layers'\]\['w'\] \(its first "
           r"dimension\), which reads one tensor per layer, "
           r"'model.layers.\{i\}.mlp.up_proj.weight' for \{i\} = 0..2: "
           r"'model.layers.3.mlp.up_proj.weight'")
  with pytest.raises(ValueError, match=match + r". Give `like` a leaf of 4 layers, or pass "
                                               r"strict=False"):
    zj.load_safetensors(tmp_path, like, step=exported["step"], rename=rename)
  with pytest.warns(UserWarning, match=match + r". They are left unread \(strict=False\)"):
    back = zj.load_safetensors(tmp_path, like, step=exported["step"], rename=rename,
                               strict=False)
  np.testing.assert_array_equal(np.asarray(back["layers"]["w"]), exported["params"]["layers"]["w"])


def test_layer_index_of_a_name_under_a_template():
  assert layer_names.layer_of("h.{i}.w", "h.12.w") == 12
  assert layer_names.layer_of("h.{i}.w", "h.012.w") is None  # not a name {i} makes
  assert layer_names.layer_of("h.{i}.w.{i}", "h.1.w.1") == 1
  assert layer_names.layer_of("h.{i}.w.{i}", "h.1.w.2") is None
  assert layer_names.layer_of("h.{i}.w", "h.1.w.x") is None


def test_layers_sliced_on_their_devices_give_the_same_bytes(tmp_path, monkeypatch):
  """The path for accelerators (each layer's piece sliced, transposed and converted on its
  device), forced on CPU: the same files as through numpy views."""
  from zero_jax.checkpoint import safetensors_write  # pylint: disable=g-import-not-at-top
  step = make_step("stage3_hpz_2x4")
  state = step.init(make_params())
  for views in (True, False):
    monkeypatch.setattr(safetensors_write, "HOST_VIEWS", views)
    zj.export_safetensors(step, state, tmp_path / str(views), rename=rename, dtype=jnp.bfloat16,
                          chunk_bytes=40)
  assert (tmp_path / "True" / fmt.SINGLE).read_bytes() == \
      (tmp_path / "False" / fmt.SINGLE).read_bytes()
  assert_bitwise(read_files(tmp_path / "False"), hub_tensors(make_params(), jnp.bfloat16))


def test_an_offloaded_master_is_brought_to_each_device_once_for_all_its_layers(
    tmp_path, monkeypatch):
  """offload="optimizer" keeps the float32 master in pinned_host: the path for accelerators
  brings a device's block to the device to slice it, once for all the layers of a leaf (not
  once per layer), and writes the same bytes."""
  from zero_jax.checkpoint import safetensors_write  # pylint: disable=g-import-not-at-top
  params = make_params()
  step = zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), mesh=jax.make_mesh((8,), ("data",)),
                                    stage=3, precision="bf16", offload="optimizer",
                                    stacked=STACKED)
  state = step.init(params)
  assert {m.sharding.memory_kind for m in state.master if m is not None} == {"pinned_host"}
  moves = []
  put = jax.device_put
  monkeypatch.setattr(jax, "device_put",
                      lambda x, *a, **k: (moves.append(x), put(x, *a, **k))[1])
  monkeypatch.setattr(safetensors_write, "HOST_VIEWS", False)
  zj.export_safetensors(step, state, tmp_path, rename=rename)
  assert_bitwise(read_files(tmp_path), hub_tensors(params))
  # Each block moved once, whatever its layers (the stacked leaves' blocks among them).
  assert moves and len({id(x) for x in moves}) == len(moves), len(moves)
  assert any(x.ndim == 3 for x in moves)


def test_a_stack_of_no_layers_writes_no_tensor_and_refuses_layers_in_the_files(tmp_path):
  params = {"s": np.zeros((0, 8), np.float32), "w": np.arange(64, dtype=np.float32).reshape(8, 8)}
  step = zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), mesh=jax.make_mesh((8,), ("data",)),
                                    stage=3, stacked={"s": True, "w": False})
  ren = lambda n: "l.{i}.s" if n == "s" else n
  zj.export_safetensors(step, step.init(params), tmp_path / "a", rename=ren)
  assert sorted(read_files(tmp_path / "a")) == ["w"]
  back = zj.load_safetensors(tmp_path / "a", like_of(params), step=step, rename=ren)
  assert back["s"].shape == (0, 8) and back["s"].dtype == np.float32
  np.testing.assert_array_equal(np.asarray(back["w"]), params["w"])
  _rewrite(tmp_path / "a", tmp_path / "b", lambda t: t.update({"l.0.s": np.zeros(8, np.float32)}))
  with pytest.raises(ValueError, match=r"holds layers past the 0 of the stacked leaf "
                                       r"params\['s'\] \(its first dimension\), which reads no "
                                       r"tensor of 'l.\{i\}.s' \(its first dimension is 0\): "
                                       r"'l.0.s'. Give `like` a leaf of 1 layers"):
    zj.load_safetensors(tmp_path / "b", like_of(params), step=step, rename=ren)
