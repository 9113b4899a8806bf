"""Writes one named section of BENCHMARKS.md, leaving the other sections alone."""

from __future__ import annotations

import pathlib
import platform

import jax

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "BENCHMARKS.md"


def machine() -> str:
  """One line naming where the figures were measured."""
  dev = jax.devices()[0]
  return (f"{dev.platform} ({getattr(dev, 'device_kind', '?')}), {jax.device_count()} devices, "
          f"host {platform.machine()} with {__import__('os').cpu_count()} cores, jax {jax.__version__}")


def write_section(name: str, markdown: str) -> None:
  """Replaces (or appends) the section between ``<!-- name -->`` markers."""
  begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
  text = BENCHMARKS.read_text() if BENCHMARKS.exists() else "# Benchmarks\n"
  block = f"{begin}\n{markdown.rstrip()}\n{end}"
  if begin in text and end in text:
    head, rest = text.split(begin, 1)
    text = head + block + rest.split(end, 1)[1]
  else:
    text = text.rstrip() + "\n\n" + block + "\n"
  BENCHMARKS.write_text(text)


def publish(name: str, markdown: str, *, write: bool) -> None:
  """Prints a benchmark's section, and writes it into BENCHMARKS.md when ``write``."""
  print(markdown)
  if write:
    write_section(name, markdown)
