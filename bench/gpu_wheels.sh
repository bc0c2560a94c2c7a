#!/usr/bin/env bash
# Prepare .whl/ with the Python packages eagle3x needs that the lent GPU image lacks
# (it has torch, lightning, transformers, safetensors, tokenizers, matplotlib, rich, tqdm,
# filelock; not Hydra). Pure-Python wheels, a few hundred KB. vLLM is not carried: its
# wheel and the torch it pins are far over the 64 MiB a device call may carry, so the GPU
# check measures engine=vllm only where the image has vLLM and records why not otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl \
  hydra-core==1.3.2 omegaconf==2.3.0
python3 -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3  # sdist only on PyPI
ls -la .whl
