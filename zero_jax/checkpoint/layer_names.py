"""One tensor per layer: the ``{i}`` in a tensor name, as the Hub names a model's layers.

A stacked leaf (layers along its first dimension, ``make_sharded_train_step(...,
stacked=...)``) is one tensor in a safetensors file, or, when ``rename=`` gives it a name
holding `LAYER` (``"model.layers.{i}.mlp.up_proj.weight"``), one tensor per layer:
`apply_rename` checks what ``rename`` returned, `layer_tensors` makes a leaf's tensors
(`zero_jax.checkpoint.safetensors_format.Tensor`), one per layer, and `layer_of` reads a layer
index back from a file's tensor name. `zero_jax.checkpoint.safetensors_write` and
``safetensors_read`` use them; the file layout is `zero_jax.checkpoint.safetensors_format`'s.

Example:
  >>> name, transpose = apply_rename(lambda n: "h.{i}.w", "blocks.w", "['blocks']['w']", 3,
  ...                                stacked=True)
  >>> t = Tensor(name, (2,), np.dtype("f4"), "['blocks']['w']")
  >>> [u.name for u in layer_tensors(t, 3)], layer_of(name, "h.2.w")
  (['h.0.w', 'h.1.w', 'h.2.w'], 2)
"""

from __future__ import annotations

import re
from typing import Callable

import numpy as np

from zero_jax.checkpoint.safetensors_format import Tensor

LAYER = "{i}"  # in a name from rename=: one tensor per layer of a stacked leaf


def _check_braces(name: str, default: str, leaf: str) -> None:
  """Refuses braces in a name other than `LAYER`'s (another format field, an escape)."""
  if "{" in name.replace(LAYER, "") or "}" in name.replace(LAYER, ""):
    raise ValueError(f"rename({default!r}) for the leaf {leaf} returned {name!r}, which holds "
                     f"braces other than '{LAYER}': a tensor name may hold '{LAYER}' (replaced "
                     f"by the layer index of a stacked leaf, one tensor per layer) and no other "
                     f"'{{' or '}}' (no other field such as '{{j}}', '{{}}' or '{{i:02d}}').")


def apply_rename(rename: Callable | None, default: str, leaf: str, ndim: int, *,
                 stacked: bool = False) -> tuple[str, bool]:
  """``rename(default)`` checked: ``(name, transpose)``.

  ``rename`` returns a name, or ``(name, transpose)`` with ``transpose`` a bool (the
  file holds the 2-D leaf transposed: PyTorch's ``Linear.weight`` is ``(out, in)``,
  Flax's ``kernel`` ``(in, out)``). A name holding ``{i}`` on a ``stacked`` leaf (layers
  along its first dimension) names one tensor per layer (`layer_tensors`); ``transpose``
  then applies to each layer's 2-D slice.

  >>> apply_rename(lambda n: ("model.layers.{i}.w", True), "blocks.w", "params['blocks']",
  ...              3, stacked=True)
  ('model.layers.{i}.w', True)
  """
  if rename is None:
    return default, False
  out = rename(default)
  name, transpose = (out if isinstance(out, tuple) and len(out) == 2 else (out, False))
  if not isinstance(name, str) or not name or not isinstance(transpose, (bool, np.bool_)):
    raise TypeError(f"rename({default!r}) for the leaf {leaf} returned {out!r}; it must return "
                    f"a non-empty str, or (name, transpose) with transpose a bool.")
  if name == "__metadata__":
    raise ValueError(f"rename({default!r}) for the leaf {leaf} returned '__metadata__', the "
                     f"name of a safetensors file's metadata entry; give the tensor another name.")
  _check_braces(name, default, leaf)
  layers = LAYER in name
  if layers and not stacked:
    raise ValueError(f"rename({default!r}) for the leaf {leaf} returned {name!r}, whose "
                     f"'{LAYER}' asks for one tensor per layer, but the step does not hold "
                     f"{leaf} as a stack of layers. Mark it with make_sharded_train_step(..., "
                     f"stacked=...) if its first dimension is the layers, or return a name "
                     f"without '{LAYER}'.")
  if transpose and ndim - layers != 2:
    what = (f"named per layer ('{LAYER}'), whose layers have {ndim - 1} dimensions" if layers
            else f"which has {ndim} dimensions")
    raise ValueError(f"rename({default!r}) asks to transpose the leaf {leaf}, {what}; only "
                     f"2-D {'layers' if layers else 'leaves'} (kernels) can be transposed.")
  return name, bool(transpose)


def layer_tensors(t: Tensor, layers: int) -> list[Tensor]:
  """The per-layer tensors of a stacked leaf's ``t`` (its name holding `LAYER`, its shape
  a layer's in the file): ``{i}`` replaced by 0, 1, ..., ``layers - 1``.

  >>> [u.name for u in layer_tensors(Tensor("h.{i}.w", (2,), np.dtype("f4"), "w"), 3)]
  ['h.0.w', 'h.1.w', 'h.2.w']
  """
  return [t._replace(name=t.name.replace(LAYER, str(i)), layer=i,
                     leaf=f"{t.leaf} (layer {i} of {layers})") for i in range(layers)]


def layer_of(template: str, name: str) -> int | None:
  """The layer index ``name`` has under ``template`` (``"h.{i}.w"``, ``"h.12.w"`` -> 12), or
  None when it is not one of its names (a layer index as `layer_tensors` writes it: no
  leading zeros)."""
  first, *rest = (re.escape(p) for p in template.split(LAYER))
  fields = ["(?P<i>0|[1-9][0-9]*)"] + ["(?P=i)"] * (len(rest) - 1)
  m = re.fullmatch(first + "".join(f + p for f, p in zip(fields, rest)), name)
  return int(m.group("i")) if m else None
