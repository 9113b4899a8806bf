#!/usr/bin/env bash
# The GPU compile tier: zero_jax's steps compiled for compile-only H100/H200/A100s (tests/gpu).
# No GPU is needed: JAX's CUDA plugin compiles for GPUs without one. Its own venv, .venv-gpu,
# with the plugin pinned to the jax version pip resolves for zero_jax; ZERO_JAX_GPU_TIER=1
# makes a missing plugin an error instead of a skip; the examples extra (tqdm) for the LM
# example's --plan. The tests take about 3 minutes on an idle 2-core machine, up to 20 on a loaded one.
#
# Usage: ci/gpu_tier.sh [install|test]: the venv's dependencies, or zero_jax (editable) and
# the tests; both by default (.ci/run installs in the background while the suite runs).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-all}" != test ]]; then
  python3 -m venv .venv-gpu
  .venv-gpu/bin/pip install -q pytest pytest-xdist chex -r <(python3 ci/requirements.py examples)
  JAX_VERSION="$(.venv-gpu/bin/python -c 'import importlib.metadata as m; print(m.version("jax"))')"
  .venv-gpu/bin/pip install -q "jax-cuda12-plugin==${JAX_VERSION}" "jax-cuda12-pjrt==${JAX_VERSION}"
  # cuDNN (and the cuBLAS it needs), for jax.nn.dot_product_attention(implementation="cudnn"):
  # the fused attention H100 users run, compiled for compile-only GPUs too (about 1.2 GB).
  .venv-gpu/bin/pip install -q "nvidia-cudnn-cu12>=9.8,<10"
fi
if [[ "${1:-all}" != install ]]; then
  .venv-gpu/bin/pip install -q --no-deps -e .
  ZERO_JAX_GPU_TIER=1 .venv-gpu/bin/python -m pytest -q -n 2 -p no:cacheprovider tests/gpu
fi
