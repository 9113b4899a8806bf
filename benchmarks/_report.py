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


# How a predicted step time is labelled: the compiled schedule walked, against published
# measurements (BENCHMARKS.md "calibration": predicted/measured 1.23 against MaxText's Llama 2 7B
# on 8 H100s, 1.81-2.09 against torchtitan's Llama 3.1 8B).
PREDICTED = ("PREDICTED by walking the compiled program's schedule (`zero_jax.gpu.timeline`, "
             "what `zj.plan` ranks by: matmuls at the card's measured efficiency, memory-bound "
             "kernels at HBM bandwidth, one stream of kernels waiting at each collective's "
             "done, concurrent collectives sharing the link, matmuls alone hiding "
             "communication, compute under a collective slowed for NCCL's SMs), not measured; "
             "at least 1.2x optimistic: predicted/measured 1.23 to 2.09 in the \"calibration\" "
             "section")


def attention_words(implementation: str, why: str) -> str:
  """The attention a benchmark's programs call, in words: cuDNN's fused kernel, or the
  written-out fallback labelled with the reason cuDNN did not compile."""
  if implementation == "cudnn":
    return ("cuDNN's fused flash attention (`jax.nn.dot_product_attention(..., "
            "implementation=\"cudnn\")`, what H100 users run)")
  return (f"**written out, not cuDNN's fused kernel** ({why}; install the nvidia-cudnn-cu12 "
          f"wheel beside JAX's CUDA plugin for the attention H100 users run)")
