#!/usr/bin/env bash
# The GPU check on a lent GPU machine (no SGLang, no hub, no internet; docs/engines.md): install the carried wheels
# (.gpu-carry/wheels, from bench/gpu_carry.py) into a folder of their own, copy the carried tiny default model into
# .cache, then run bench/gpu_check.py (arguments passed on; its report goes to $OUT). On CPU, --dry-run runs the same
# stages with tiny shapes.
#   bash bench/gpu_check.sh                  # on the GPU machine, carry=[".gpu-carry"]
#   bash bench/gpu_check.sh --dry-run        # anywhere (PY=.venv/bin/python here)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
CARRY=${GPU_CARRY:-.gpu-carry}
SITE=${GPU_CHECK_SITE:-/tmp/gpu_check_site}
if compgen -G "$CARRY/wheels/*.whl" >/dev/null; then
  # --no-deps --no-index: exactly the carried wheels, nothing fetched; first on PYTHONPATH, so they win.
  "$PY" -m pip install -q --no-deps --no-index --target "$SITE" "$CARRY"/wheels/*.whl
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
if [ -d "$CARRY/cache" ]; then
  mkdir -p .cache
  cp -rn "$CARRY/cache/." .cache/
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv
exec "$PY" bench/gpu_check.py "$@"
