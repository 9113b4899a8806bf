"""zj.load_safetensors on files as transformers (and the safetensors library) write them: the
headers' edges the library refuses, and leaves JAX holds in another dtype than `like` says.

Files are written with ``safetensors.numpy`` (``metadata={"format": "pt"}``, as
``save_pretrained`` writes it) or byte by byte where the library would not write them.
"""

import json
import os
import pathlib
import re
import struct

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from safetensors.numpy import load_file, save_file

import zero_jax as zj

S = jax.ShapeDtypeStruct


@pytest.fixture(scope="module")
def step():
  loss = lambda p, b: sum(jnp.sum(x.astype(jnp.float32)) for x in jax.tree.leaves(p)) * b
  return zj.make_sharded_train_step(loss, optax.sgd(0.1), mesh=jax.make_mesh((8,), ("data",)),
                                    stage=3)


def write(path, header: dict, data: bytes) -> str:
  """A safetensors file of ``header`` (a dict, written as JSON) and ``data``, byte by byte."""
  text = json.dumps(header).encode()
  text += b" " * (-len(text) % 8)
  path.write_bytes(struct.pack("<Q", len(text)) + text + data)
  return str(path)


@pytest.mark.skipif(jax.config.jax_enable_x64, reason="JAX keeps 64-bit leaves with x64 on")
def test_a_64_bit_leaf_jax_makes_32_bit_is_refused_unless_cast_then_values_must_fit(
    tmp_path, step):
  """With jax_enable_x64 off JAX makes an int64 (float64) leaf of `like` int32 (float32): the
  load used to wrap 2**40 + 7 into 7 without a word. Now such a leaf is refused naming it and
  the flag; with cast=True it is a conversion like any other (integers only when every value
  fits)."""
  path = str(tmp_path / "ids.safetensors")
  save_file({"big": np.array([2**40 + 7, 3] * 4, np.int64),
             "ids": np.arange(8, dtype=np.int64)[None],
             "f": np.full(8, 1 + 2**-30, np.float64)}, path, metadata={"format": "pt"})
  for name, shape, dtype in [("big", (8,), np.int64), ("f", (8,), np.float64)]:
    with pytest.raises(TypeError, match=rf"`like` holds params\['{name}'\] of dtype "
                                        rf"{np.dtype(dtype).name}, which JAX makes \w+32 "
                                        rf"\(jax_enable_x64 is off\).*jax_enable_x64.*cast=True"):
      zj.load_safetensors(path, {name: S(shape, dtype)}, step=step, strict=False)
  with pytest.raises(ValueError, match=r"'big' in \S+ is int64 and holds 1099511627783, which "
                                       r"int32 .*cannot hold.*turn on .*jax_enable_x64"):
    zj.load_safetensors(path, {"big": S((8,), np.int64)}, step=step, cast=True, strict=False)
  got = zj.load_safetensors(path, {"ids": np.zeros((1, 8), np.int64), "f": S((8,), np.float64)},
                            step=step, cast=True, strict=False)
  assert got["ids"].dtype == jnp.int32 and got["f"].dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(got["ids"]), np.arange(8)[None])
  np.testing.assert_array_equal(np.asarray(got["f"]), np.full(8, 1 + 2**-30, np.float32))


@pytest.mark.parametrize("meta", [{"format": 1}, [1], {"format": "pt", "note": None}, "pt"],
                         ids=["int-value", "list", "null-value", "string"])
def test_metadata_that_is_not_an_object_of_strings_is_refused_as_the_library_refuses_it(
    tmp_path, step, meta):
  w = np.arange(8, dtype=np.float32)
  path = write(tmp_path / "m.safetensors", {"__metadata__": meta, "w": {
      "dtype": "F32", "shape": [8], "data_offsets": [0, 32]}}, w.tobytes())
  with pytest.raises(Exception, match="invalid JSON in header"):
    load_file(path)  # the library's own verdict
  with pytest.raises(ValueError, match=r"m.safetensors is not a valid safetensors file: its "
                                       r"__metadata__ \(.*\) is not an object of strings"):
    zj.load_safetensors(path, {"w": S((8,), jnp.float32)}, step=step)


@pytest.mark.parametrize("meta", [None, {}, {"format": "pt"}], ids=["null", "empty", "pt"])
def test_metadata_null_empty_or_of_strings_loads(tmp_path, step, meta):
  w = np.arange(8, dtype=np.float32)
  path = write(tmp_path / "m.safetensors", {"__metadata__": meta, "w": {
      "dtype": "F32", "shape": [8], "data_offsets": [0, 32]}}, w.tobytes())
  np.testing.assert_array_equal(load_file(path)["w"], w)
  got = zj.load_safetensors(path, {"w": S((8,), jnp.float32)}, step=step)
  np.testing.assert_array_equal(np.asarray(got["w"]), w)


def test_a_file_of_metadata_only_is_named_as_holding_no_tensors(tmp_path, step):
  path = str(tmp_path / "empty.safetensors")
  save_file({}, path, metadata={"format": "pt"})
  assert zj.load_safetensors(path, {}, step=step) == {}
  with pytest.raises(KeyError, match=r"'w' \(for params\['w'\]\)\. The files hold no tensors\."):
    zj.load_safetensors(path, {"w": S((8,), jnp.float32)}, step=step)


def test_an_index_placing_a_tensor_in_a_file_it_does_not_list_says_so(tmp_path, step):
  """The index moves 'b' (alone in its file) to the file of 'a': the file holding 'b' is no
  longer listed, so it is not that no file holds 'b' but that no listed file does."""
  save_file({"a": np.ones(8, np.float32)}, str(tmp_path / "model-00001-of-00002.safetensors"),
            metadata={"format": "pt"})
  save_file({"b": np.ones(8, np.float32)}, str(tmp_path / "model-00002-of-00002.safetensors"),
            metadata={"format": "pt"})
  (tmp_path / "model.safetensors.index.json").write_text(json.dumps({
      "metadata": {"total_size": 64},
      "weight_map": {"a": "model-00001-of-00002.safetensors",
                     "b": "model-00001-of-00002.safetensors"}}))
  like = {k: S((8,), jnp.float32) for k in "ab"}
  with pytest.raises(ValueError, match=r"'b' is placed in \S+model-00001-of-00002.safetensors, "
                                       r"but none of the files the index lists holds it"):
    zj.load_safetensors(tmp_path, like, step=step)


@pytest.mark.parametrize("transpose", [False, True], ids=["rows", "transposed"])
def test_a_float_past_the_leafs_range_is_refused_naming_it_not_made_inf(tmp_path, step,
                                                                        transpose):
  """cast=True into a floating dtype of smaller range: float32 1e5 into float16 became inf
  (with numpy's overflow warning, naming nothing) and into float8_e4m3fn NaN (without a word).
  Now refused naming the tensor, the value and the leaf; rounding (1e-10 to 0, NaN and inf
  themselves) still converts, and a widening conversion is unchecked."""
  path = str(tmp_path / "w.safetensors")
  big = np.array([[1.0, 2.0], [-1e5, 3.0]] * 4, np.float32)
  fine = np.array([[1e-10, np.nan], [np.inf, -65504.0]] * 4, np.float32)
  fine_bf16 = np.array([[1e-10, np.nan], [np.inf, -6e4]] * 4, np.float32).astype(jnp.bfloat16)
  save_file({"big": big, "fine": fine, "big_bf16": big.astype(jnp.bfloat16),
             "fine_bf16": fine_bf16}, path, metadata={"format": "pt"})
  rename = (lambda name: (name, True)) if transpose else None
  shape = (2, 8) if transpose else (8, 2)
  for dtype, result in [(jnp.float16, "-inf"), (jnp.float8_e4m3fn, "nan")]:
    with pytest.raises(ValueError, match=rf"tensor 'big' in \S+ is float32 and holds -100000.0, "
                                         rf"past the largest {np.dtype(dtype).name} \(.*the leaf "
                                         rf"params\['big'\] in `like`\): cast=True would make it "
                                         rf"{result}"):
      zj.load_safetensors(path, {"big": S(shape, dtype)}, step=step, cast=True, strict=False,
                          rename=rename)
  with pytest.raises(ValueError, match=r"'big_bf16' in \S+ is bfloat16 and holds -99840.0, past "
                                       r"the largest float16"):
    zj.load_safetensors(path, {"big_bf16": S(shape, jnp.float16)}, step=step, cast=True,
                        strict=False, rename=rename)
  got = zj.load_safetensors(path, {"fine": S(shape, jnp.float16), "fine_bf16": S(
      shape, jnp.float16)}, step=step, cast=True, strict=False, rename=rename)
  for name, src in (("fine", fine), ("fine_bf16", fine_bf16)):
    want = src.astype(np.float16)
    assert want[0, 0] == 0 and np.isfinite(want[1, 1])
    np.testing.assert_array_equal(np.asarray(got[name]), want.T if transpose else want)
  got = zj.load_safetensors(path, {"big": S(shape, jnp.bfloat16)}, step=step, cast=True,
                            strict=False, rename=rename)
  want = big.astype(jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(got["big"]), want.T if transpose else want)


def test_a_0_d_tensor_is_converted_with_the_same_checks_as_any_other(tmp_path, step):
  """A 0-d tensor was assigned straight into its leaf: -1 became 255 in a uint8 leaf and 1e5
  inf in a float16 one without a word (numpy's overflow warning naming nothing). Now it goes
  through the checks of every other tensor."""
  path = str(tmp_path / "s.safetensors")
  save_file({"i": np.array(2**40 + 7, np.int64), "n": np.array(-1, np.int8),
             "f": np.array(1e5, np.float32), "ok": np.array(-3, np.int64)}, path,
            metadata={"format": "pt"})
  load = lambda name, dtype: zj.load_safetensors(path, {name: S((), dtype)}, step=step,
                                                 cast=True, strict=False)[name]
  for name, dtype, value in [("i", jnp.int32, "1099511627783"), ("n", jnp.uint8, "-1"),
                             ("f", jnp.float16, "100000.0")]:
    with pytest.raises(ValueError, match=rf"tensor '{name}' in \S+ is \w+ and holds {value}"):
      load(name, dtype)
  assert load("ok", jnp.int8) == -3 and load("f", jnp.bfloat16) == jnp.bfloat16(1e5)


def test_an_integer_that_wraps_into_a_dtype_of_the_same_width_is_refused(tmp_path, step):
  """cast=True checked integers by converting back: -1 into uint8 is 255, and 255 back into
  int8 is -1 again, so int8 -1 loaded as 255 (uint32 3e9 as int32 -1294967296) without a
  word. Now every value is checked against the leaf dtype's range."""
  path = str(tmp_path / "i.safetensors")
  save_file({"i8": np.array([3, -1] * 4, np.int8),
             "u32": np.array([1, 3_000_000_000] * 4, np.uint32),
             "i64": np.array([5, -2] * 4, np.int64), "fits": np.array([0, 127] * 4, np.uint8)},
            path, metadata={"format": "pt"})
  for name, dtype, value in [("i8", jnp.uint8, "-1"), ("u32", jnp.int32, "3000000000"),
                             ("i64", jnp.uint32, "-2")]:
    with pytest.raises(ValueError, match=rf"tensor '{name}' in \S+ is \w+ and holds {value}, "
                                         rf"which {np.dtype(dtype).name} "):
      zj.load_safetensors(path, {name: S((8,), dtype)}, step=step, cast=True, strict=False)
  got = zj.load_safetensors(path, {"fits": S((8,), jnp.int8)}, step=step, cast=True,
                            strict=False)["fits"]
  np.testing.assert_array_equal(np.asarray(got), [0, 127] * 4)


# ------------------------------------------------------------ an index stays in its folder
def _sharded(folder, weight_map, tensors):
  """An index in ``folder`` with ``weight_map``; each file it names holds its tensors."""
  for f in set(weight_map.values()):
    path = folder / f if not os.path.isabs(f) else pathlib.Path(f)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: tensors[k] for k, g in weight_map.items() if g == f}, str(path),
              metadata={"format": "pt"})
  (folder / "model.safetensors.index.json").write_text(json.dumps(
      {"metadata": {"total_size": 64}, "weight_map": weight_map}))


TENSORS = {"a": np.arange(8, dtype=np.float32), "b": np.ones(8, np.float32)}
LIKE = {k: S((8,), jnp.float32) for k in TENSORS}


@pytest.mark.parametrize("where", ["parent", "absolute", "through_subfolder"])
def test_an_index_naming_a_file_outside_its_folder_is_refused_naming_the_entry(
    tmp_path, step, where):
  """A weight_map naming "../other/model-x.safetensors" (or an absolute path) read a file
  outside the checkpoint's folder without a word. Shard names are files in the folder."""
  folder = tmp_path / "ckpt"
  folder.mkdir()
  outside = {"parent": "../other/model-x.safetensors",
             "absolute": str(tmp_path / "other" / "model-x.safetensors"),
             "through_subfolder": "sub/../../other/model-x.safetensors"}[where]
  _sharded(folder, {"a": "model-00001-of-00002.safetensors", "b": outside}, TENSORS)
  why = "an absolute path" if where == "absolute" else "a path through '..'"
  with pytest.raises(ValueError, match=rf"index.json places tensor 'b' in '{re.escape(outside)}'"
                                       rf", {why}: shard names in an index are file names "
                                       rf"inside its folder {re.escape(str(folder))}"):
    zj.load_safetensors(folder, LIKE, step=step)


@pytest.mark.parametrize("link", ["file", "folder"])
def test_a_symlink_leaving_the_folder_is_refused_naming_the_entry_and_its_target(
    tmp_path, step, link):
  folder, other = tmp_path / "ckpt", tmp_path / "other"
  folder.mkdir()
  other.mkdir()
  save_file({"b": TENSORS["b"]}, str(other / "model-00002-of-00002.safetensors"),
            metadata={"format": "pt"})
  if link == "file":
    (folder / "model-00002-of-00002.safetensors").symlink_to(
        other / "model-00002-of-00002.safetensors")
    name = "model-00002-of-00002.safetensors"
  else:
    (folder / "shards").symlink_to(other)
    name = "shards/model-00002-of-00002.safetensors"
  save_file({"a": TENSORS["a"]}, str(folder / "model-00001-of-00002.safetensors"),
            metadata={"format": "pt"})
  (folder / "model.safetensors.index.json").write_text(json.dumps(
      {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": name}}))
  target = os.path.realpath(other / "model-00002-of-00002.safetensors")
  with pytest.raises(ValueError, match=rf"places tensor 'b' in '{name}', which is a symbolic "
                                       rf"link \(or in a linked folder\) resolving to "
                                       rf"{re.escape(target)}, outside the index's folder "
                                       rf"{re.escape(str(folder))}"):
    zj.load_safetensors(folder, LIKE, step=step)


def test_files_in_a_subfolder_and_a_hugging_face_cache_snapshot_load(tmp_path, step):
  """Inside the folder is fine (a subfolder, a link within it); so is the Hugging Face cache,
  whose snapshot files link into the repository's blobs/ folder."""
  folder = tmp_path / "ckpt"
  folder.mkdir()
  _sharded(folder, {"a": "shards/model-00001-of-00002.safetensors",
                    "b": "./model-00002-of-00002.safetensors"}, TENSORS)
  got = zj.load_safetensors(folder, LIKE, step=step)
  np.testing.assert_array_equal(np.asarray(got["a"]), TENSORS["a"])
  # huggingface_hub's cache: models--org--name/{blobs/<hash>, snapshots/<rev>/<file> -> blob}
  repo = tmp_path / "models--org--tiny"
  blobs, snap = repo / "blobs", repo / "snapshots" / "0123abcd"
  blobs.mkdir(parents=True)
  snap.mkdir(parents=True)
  _sharded(blobs, {"a": "h1", "b": "h2"}, TENSORS)
  (blobs / "model.safetensors.index.json").rename(blobs / "h3")
  for f, h in [("model-00001-of-00002.safetensors", "h1"),
               ("model-00002-of-00002.safetensors", "h2")]:
    (snap / f).symlink_to(f"../../blobs/{h}")
  (blobs / "h3").write_text(json.dumps({"metadata": {"total_size": 64}, "weight_map": {
      "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
  (snap / "model.safetensors.index.json").symlink_to("../../blobs/h3")
  got = zj.load_safetensors(snap, LIKE, step=step)
  np.testing.assert_array_equal(np.asarray(got["b"]), TENSORS["b"])


@pytest.mark.parametrize("index,message", [
    ({"weight_map": ["model-00001-of-00001.safetensors"]},
     r"its weight_map is an array; it must be a JSON object \{tensor name: file name\}"),
    ({"metadata": ["total_size", 64], "weight_map": {"a": "m.safetensors"}},
     r"its metadata is an array; it must be a JSON object"),
    ({"weight_map": {"a": 3}}, r"maps 'a' to 3, a number; a weight_map maps each tensor name "
                               r"to the name of its file, a non-empty string"),
    ({"weight_map": {"a": None}}, r"maps 'a' to None, null; a weight_map"),
    ({"weight_map": {}}, r"its weight_map is empty"),
    ({"metadata": {}}, r"has no weight_map; it is not a safetensors index"),
    ("weight_map", r"is not a safetensors index: it holds a string, and an index is an object"),
], ids=["map_list", "metadata_list", "file_number", "file_null", "empty", "no_map", "string"])
def test_an_index_of_the_wrong_shape_says_what_it_found(tmp_path, step, index, message):
  """A weight_map that is a list was reported as "has no weight_map"."""
  (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
  with pytest.raises(ValueError, match=r"model.safetensors.index.json:? " + message):
    zj.load_safetensors(tmp_path, LIKE, step=step)
