#!/usr/bin/env bash
# Multi-turn with a mid-episode gust: IcePop PPO with a critic on `--task walk` (data/walk.py: each turn "1" a step or
# "2" a jump home, a gust after turn 1; the observation says "d to go, k left"), the tiny model warmed up on a walker
# that jumps 15% of the time (built and cached on first use), 2 CPU processes: runs/cpu.sh with what differs.
# The walk model is passed as --model: the trainer's default model is the addition one for a task it does not know.
# fp32 engine, as runs/cpu_guess.sh; 10 critic-only steps before step 1 (100 took ~18 min on a busy 2-core machine).
# Extra arguments are appended (they win): e.g. --algo grpo --n-samples 8.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=$(OMP_NUM_THREADS=1 "${PY:-.venv/bin/python}" -m data.tiny walk | tail -n 1)
exec bash runs/cpu.sh \
  --task walk \
  --model "$MODEL" \
  --engine-dtype fp32 \
  --out-dir outputs/walk \
  --steps 60 \
  --critic-pretrain 10 \
  --eval-every 10 \
  "$@"
