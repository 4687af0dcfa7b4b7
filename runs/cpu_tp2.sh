#!/usr/bin/env bash
# IcePop PPO with the policy and the critic tensor-parallel over 2 CPU processes (tp=2, dp=1), tiny model: runs/cpu.sh
# with what differs. Extra arguments are appended (they win).
set -euo pipefail
cd "$(dirname "$0")/.."
exec bash runs/cpu.sh \
  --tp 2 \
  --out-dir outputs/cpu_tp2 \
  --steps 200 \
  "$@"
