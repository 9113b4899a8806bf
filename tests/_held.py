"""The values a compiled program holds in memory, read from its optimized HLO text.

Those are the results of instructions outside fused computations: inside a fusion XLA computes
each element where it is used (a convert followed by a slice reads only the slice's elements),
so a fused computation's inner shapes are never stored. The fusion's own result is.
"""

import re

from zero_jax.comm import hlo


def held_shapes(text: str) -> set[str]:
  """The result types (``bf16[4,1,7]``, layouts dropped) of the instructions outside fused
  computations of ``text`` (``compiled.as_text()``)."""
  comps = hlo._computations(text)  # pylint: disable=protected-access
  parsed = {name: [i for i in map(hlo.parse_instruction, lines) if i is not None]
            for name, lines in comps.items()}
  fused = {c for ins in (i for lst in parsed.values() for i in lst) if ins.op == "fusion"
           for c in ins.called}
  return {t for name, lst in parsed.items() if name not in fused for i in lst
          for t in re.findall(r"\w+\[[0-9,]*\]", i.shape_text)}
