"""A progress bar over the bytes a long read or write moves (tqdm, on process 0).

`export_safetensors` and `load_safetensors` move a model's bytes one block at a time;
for a model of many GiB that takes minutes, so they show how far they are. The bar
counts this process's bytes and is drawn by process 0 only (every process moves about
as many). ``progress=None`` draws it from `SHOW_FROM_BYTES` on, when ``tqdm`` is
installed (``pip install tqdm``; ``tqdm.auto`` also draws in notebooks).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import jax

SHOW_FROM_BYTES = 1 << 30  # progress=None: a bar from 1 GiB on


def check(progress, name: str) -> None:
  """``progress=`` must be True, False or None."""
  if progress is not None and not isinstance(progress, bool):
    raise TypeError(f"{name}(progress=) must be True (a bar), False (none) or None (a bar "
                    f"from {SHOW_FROM_BYTES >> 30} GiB on, when tqdm is installed); got "
                    f"{progress!r}.")


@contextlib.contextmanager
def bytes_bar(total: int, desc: str, progress: bool | None) -> Iterator[Callable[[int], None]]:
  """Yields ``update(n)``: ``n`` more bytes done, drawn on a bar of ``total`` bytes.

  Args:
    total: the bytes this process will move.
    desc: the bar's label.
    progress: True: a bar (``tqdm`` must be installed); False: none; None: a bar when
      ``total`` is at least `SHOW_FROM_BYTES` and ``tqdm`` is installed.
  """
  show = total >= SHOW_FROM_BYTES if progress is None else progress
  tqdm = _tqdm(required=progress is True) if show and jax.process_index() == 0 else None
  if tqdm is None or total <= 0:
    yield lambda n: None
    return
  with tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024) as bar:
    yield bar.update


def _tqdm(required: bool):
  try:
    from tqdm.auto import tqdm  # pylint: disable=import-outside-toplevel
  except ImportError:
    if required:
      raise ImportError("progress=True draws its bar with tqdm, which is not installed: "
                        "pip install tqdm, or pass progress=False.") from None
    return None
  return tqdm
