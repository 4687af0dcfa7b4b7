#!/usr/bin/env bash
# Tool calls: IcePop PPO with a critic on `--task calc` (data/calc.py: a product of two 3-digit numbers, which the tiny
# model can get right only by calling the calculator tool and copying its answer), the tiny model warmed up to call it
# in about a quarter of its sampled episodes (built and cached on first use, ~10 minutes), 2 CPU processes: runs/cpu.sh
# with what differs. fp32 engine with the prefix cache, as runs/cpu_guess.sh; 10 critic-only steps before step 1.
# Extra arguments are appended (they win): e.g. --algo grpo --n-samples 8.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=$(OMP_NUM_THREADS=1 "${PY:-.venv/bin/python}" -m data.tiny calc | tail -n 1)
exec bash runs/cpu.sh \
  --task calc \
  --model "$MODEL" \
  --engine-dtype fp32 \
  --prefix-cache \
  --out-dir outputs/calc \
  --steps 40 \
  --lr 1e-4 \
  --critic-pretrain 10 \
  --eval-every 10 \
  --eval-size 400 \
  "$@"
