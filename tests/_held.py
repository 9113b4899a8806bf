"""The values a compiled program holds in memory, read from its optimized HLO text.

Those are the results of instructions outside fused computations: inside a fusion XLA computes
each element where it is used (a convert followed by a slice reads only the slice's elements),
so a fused computation's inner shapes are never stored. The fusion's own result is.
"""

import re

from zero_jax.comm import hlo


def _program(text: str):
  """(instructions per computation, names of the fused computations) of ``text``."""
  parsed = {name: [i for i in map(hlo.parse_instruction, lines) if i is not None]
            for name, lines in hlo._computations(text).items()}  # pylint: disable=protected-access
  fused = {c for lst in parsed.values() for i in lst if i.op == "fusion" for c in i.called}
  return parsed, fused


def _types(shape_text: str) -> list[str]:
  return re.findall(r"\w+\[[0-9,]*\]", shape_text)


def held_shapes(text: str) -> set[str]:
  """The result types (``bf16[4,1,7]``, layouts dropped) of the instructions outside fused
  computations of ``text`` (``compiled.as_text()``)."""
  parsed, fused = _program(text)
  return {t for name, lst in parsed.items() if name not in fused for i in lst
          for t in _types(i.shape_text)}


def held_converts(text: str, shape: str) -> list[str]:
  """The instructions outside fused computations whose result ``shape`` (``bf16[4,1,7]``) is
  converted whole from a float32 value of the same dimensions: a ``convert`` of one, or a
  fusion that reads one (a buffer of that shape filled a slice at a time, such as a loop's
  stacked gradient, reads none)."""
  parsed, fused = _program(text)
  wide = "f32" + shape[shape.index("["):]
  reads = lambda names: any(j.op == "parameter" and _types(j.shape_text) == [wide]
                            for n in names for j in parsed.get(n, []))
  out = []
  for name, lst in parsed.items():
    if name in fused:
      continue
    types = {i.name: _types(i.shape_text) for i in lst}
    out += [i.line.strip()[:200] for i in lst if _types(i.shape_text) == [shape] and (
        i.op == "convert" and any(types.get(o) == [wide] for o in i.operands)
        or i.op == "fusion" and reads(i.called))]
  return out
