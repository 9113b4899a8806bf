"""A ``lookup=`` table compiled for 8 compile-only H100s at Llama-3-8B's shapes: the step sends
the looked-up rows (tokens x d), never the table.

Llama-3-8B's untied embedding is 128256 x 4096; gathered whole in bf16 at stage 3 it costs each
GPU 7/8 of 1002 MiB each way per step. With ``lookup=`` and ``zj.take`` each GPU's 4 x 2048
tokens travel as rows of 4096 bf16 features: 7/8 of 64 MiB each way.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax

import zero_jax as zj
from zero_jax.comm import hlo

VOCAB, D, SEQS, SEQ = 128256, 4096, 4, 2048
MIB = 2 ** 20
_ARRAY = re.compile(r"\b(bf16|f32|s32|u32|f16|pred)\[([\d,]*)\]")
_ITEM = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "pred": 1}


def sent(c) -> float:
  """Bytes one device sends for collective ``c``: from its result, which an async start's
  tuple lists after its operands (``hlo.sent_bytes`` counts both)."""
  arrays = _ARRAY.findall(c.shape_text)
  if c.shape_text.startswith("(") and len(arrays) % 2 == 0 and len(arrays) > 1:
    arrays = arrays[len(arrays) // 2:]
  nbytes = sum(_ITEM[t] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
               for t, dims in arrays)
  return hlo.sent_bytes(c._replace(nbytes=nbytes))


def lookup_loss(p, b):
  h = zj.take(p["embed"], b["ids"])                      # [4, 2048, 4096] per GPU
  return jnp.mean((h @ p["w"]).astype(jnp.float32) ** 2)


def indexing_loss(p, b):                                 # the table gathered whole
  return jnp.mean((p["embed"][b["ids"]] @ p["w"]).astype(jnp.float32) ** 2)


def collectives(loss_fn, **kw):
  mesh = zj.compile_only_mesh((8,), ("data",), gpu="h100")
  step = zj.make_sharded_train_step(loss_fn, optax.adam(1e-4), mesh=mesh, stage=3,
                                    precision="bf16", **kw)
  params = {"embed": jax.ShapeDtypeStruct((VOCAB, D), jnp.float32),
            "w": jax.ShapeDtypeStruct((D, 8), jnp.float32)}
  batch = {"ids": jax.ShapeDtypeStruct((8 * SEQS, SEQ), jnp.int32)}
  return hlo.collectives(step.lower(step.abstract_state(params), batch).compile().as_text())


def test_llama3_8b_embedding_lookup_sends_rows_not_the_table():
  colls = collectives(lookup_loss, lookup={"embed": True, "w": False})
  rows = 7 / 8 * SEQS * SEQ * D * 2                      # 56 MiB: 7/8 of the bf16 rows
  assert [sent(c) for c in colls if c.op == "all-to-all"] == [rows, rows], colls
  # the rows each way, the ids (7/8 of 4 x 2048 int32: 0.2 MiB) and the small layer's
  # collectives (0.1 MiB)
  total = sum(sent(c) for c in colls)
  assert 2 * rows < total < 2 * rows + 1 * MIB, [(c.op, c.shape_text) for c in colls]
  table = 7 / 8 * VOCAB * D * 2                          # 877 MiB
  plain = collectives(indexing_loss)
  assert sum(sent(c) for c in plain) >= 2 * table        # gathered, gradient reduce-scattered
