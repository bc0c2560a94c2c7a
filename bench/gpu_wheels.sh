#!/usr/bin/env bash
# Prepare .whl/ with the Python packages the GPU check needs that the lent GPU image lacks
# (it has torch, lightning, transformers, safetensors, tokenizers, matplotlib, rich, tqdm,
# filelock; Python 3.12):
#   eagle3x: hydra-core, omegaconf, antlr4 runtime (pure Python);
#   the peer, speculators 0.9 and what its model imports: hs-connectors, pydantic,
#   pydantic-core (a cp312 manylinux wheel), annotated-types, typing-inspection.
# speculators' module-level `openai` / `datasets` imports are answered by placeholders
# (bench/peer_stubs), not carried. vLLM is not carried: its wheel and the torch it pins are
# far over the 64 MiB a device call may carry, so the check records why it is missing.
# The device call carries .whl/ (run it with carry: [".whl"]); gpu_check.sh installs the
# wheels into /tmp/site there, never over the machine's torch.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
dl() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 --platform any -d .whl "$@"
}
dl hydra-core==1.3.2 omegaconf==2.3.0
dl speculators==0.9.0 hs-connectors==0.9.0 pydantic==2.14.4 pydantic-core==2.50.5 \
   annotated-types==0.8.0 typing-inspection==0.4.5
python3 -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3  # sdist only on PyPI
ls -la .whl
du -sh .whl
