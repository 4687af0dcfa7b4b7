#!/usr/bin/env bash
# Tool calls: IcePop PPO with a critic on `--task calc` (data/calc.py: a product of two 3-digit numbers, a calculator
# tool in the hermes format, exact match), the tiny model warmed up on demonstrations that call the calculator in 30%
# of episodes (built and cached on first use), 2 CPU processes: runs/cpu.sh with what differs. fp32 engine, as
# runs/cpu_walk.sh; 10 critic-only steps before step 1. Extra arguments are appended (they win).
set -euo pipefail
cd "$(dirname "$0")/.."
exec bash runs/cpu.sh \
  --task calc \
  --engine-dtype fp32 \
  --out-dir outputs/calc \
  --steps 40 \
  --critic-pretrain 10 \
  --eval-every 10 \
  "$@"
