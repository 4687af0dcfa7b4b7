#!/usr/bin/env bash
# Multi-turn: IcePop PPO with a critic on `--task guess` (each turn a number, the environment answers < > ?), the
# tiny model warmed up on noisy bisection (built and cached on first use), 2 CPU processes: runs/cpu.sh with what differs.
# The engine runs in fp32 here: on this CPU bf16 generation is 5.5x slower than fp32 (0.93 vs 5.16 CPU s for 32 episodes,
# bench/bench_episodes.py), and this preset is about multi-turn credit, not mismatch.
# --prefix-cache: each turn prefills only its new tokens (2.4x faster episodes, bench/bench_episodes.py).
# Extra arguments are appended (they win): e.g. --algo grpo, --engine-dtype bf16, or --compact-at 100 for compaction.
set -euo pipefail
cd "$(dirname "$0")/.."
exec bash runs/cpu.sh \
  --task guess \
  --max-turns 6 \
  --engine-dtype fp32 \
  --prefix-cache \
  --out-dir outputs/guess \
  --steps 150 \
  --eval-every 25 \
  "$@"
