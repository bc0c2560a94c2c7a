#!/usr/bin/env bash
# One prepared GPU check (see bench/gpu_check.py). On a lent GPU machine, from the repo root:
#   bench/gpu_check.sh                 # results in $OUT/gpu_results.json (or ./gpu_check_out)
# On a CPU, as the test suite does:
#   bench/gpu_check.sh --smoke --out /tmp/x
# Python packages missing on the GPU machine travel as wheels in .whl/ (bench/gpu_wheels.sh;
# the device call carries it); they are installed into /tmp/site, never over the machine's
# torch. Each part of the check has its own time limit within GPU_CHECK_LIMIT seconds
# (default 470, under 8 min); the whole script is stopped 15 s after that at the latest.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-$PWD/gpu_check_out}"
smoke=()
while [ $# -gt 0 ]; do
  case "$1" in
    --smoke) smoke=(--smoke) ;;
    --out) out="$2"; shift ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done
py=python3; [ -x .venv/bin/python ] && [ ${#smoke[@]} -gt 0 ] && py=.venv/bin/python
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" > /dev/null && [ ${#smoke[@]} -eq 0 ]; then
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
export PYTHONUNBUFFERED=1 EAGLE3X_CACHE="${EAGLE3X_CACHE:-/tmp/eagle3x-cache}"
export GPU_CHECK_LIMIT="${GPU_CHECK_LIMIT:-470}"
exec timeout --signal=TERM --kill-after=10 "$((GPU_CHECK_LIMIT + 5))" \
  $py bench/gpu_check.py --out "$out" "${smoke[@]}"
