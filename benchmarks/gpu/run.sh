#!/usr/bin/env bash
# The GPU check in one call on a lent GPU machine (docs/accelerators.md, "Measured on a lent GPU"):
#
#   bash benchmarks/gpu/run.sh [OUTDIR] [check.py options]
#
# Installs the wheels `make gpu-wheels` put in .whl/ (what the machine's image lacks), then runs
# benchmarks/gpu/check.py, which prints the versions first and writes OUTDIR/gpu_check.json
# (OUTDIR: $OUT, else benchmarks/results) and gpu_check.log beside it. Each part of the check has
# its own time limit inside 9 minutes. PYTHON picks the interpreter (default python3, the image's).
set -u
cd "$(dirname "$0")/../.."
OUTDIR="${1:-${OUT:-benchmarks/results}}"
shift $(($# > 0 ? 1 : 0))
PYTHON="${PYTHON:-python3}"

if compgen -G ".whl/*.whl" > /dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
# The GPU is the default device; the CPU beside it is where the FLOP counts trace.
export JAX_PLATFORMS="${JAX_PLATFORMS:-cuda,cpu}"

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
exec "$PYTHON" benchmarks/gpu/check.py --out "$OUTDIR" "$@"
