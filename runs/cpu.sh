#!/usr/bin/env bash
# The main job (`make train`): IcePop PPO with a critic on the embedded tiny model, fixed-width addition,
# 2 CPU processes under torchrun (data parallel 2; NPROC=n for another count). Every Config field is written out
# below, with its default unless the job sets it (--out-dir, --steps); tests/test_layout.py checks that the flags are
# exactly Config's fields. The other presets in runs/ call this script with what differs. Extra arguments are
# appended (they win).
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1   # one thread per process: two processes on two cores, no spin-waiting
PY=${PY:-.venv/bin/python}
NPROC=${NPROC:-2}
exec "$PY" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" train_ppo.py \
  --model "" \
  --tiny dense \
  --task addition \
  --split train \
  --prompt-key prompt \
  --answer-key answer \
  --env "" \
  --max-turns 0 \
  --compact-at 0 \
  --tool-parser hermes \
  --tool-calls-per-turn 4 \
  --tool-timeout 10.0 \
  --reward "" \
  --user-timeout 120.0 \
  --out-dir outputs/cpu \
  --steps 300 \
  --seed 0 \
  --no-deterministic \
  --no-accept-changed-inputs \
  --algo ppo \
  --correction icepop \
  --icepop-low 0.5 \
  --icepop-high 2.0 \
  --kl none \
  --kl-coef 0.01 \
  --gamma 1.0 \
  --lam-policy 0.95 \
  --adaptive-lambda 0.0 \
  --whiten-advantages \
  --vine-k 4 \
  --vine-every 1 \
  --grpo-std \
  --baseline-window 8 \
  --clip-low 0.2 \
  --clip-high 0.28 \
  --dual-clip 0.0 \
  --agg token-mean \
  --rollout-batch 64 \
  --n-samples 0 \
  --ppo-epochs 1 \
  --minibatches 1 \
  --micro-batch 64 \
  --lr 0.0002 \
  --critic-lr 0.0 \
  --critic-updates 2 \
  --critic-pretrain 100 \
  --no-freeze-critic-attention \
  --critic-context policy \
  --critic-init "" \
  --value-clip 0.2 \
  --lora-rank 0 \
  --lora-alpha 16.0 \
  --lora-dropout 0.0 \
  --lora-target all-linear \
  --critic-lora-rank 0 \
  --critic-lora-alpha 16.0 \
  --critic-lora-dropout 0.0 \
  --critic-lora-target all-linear \
  --max-grad-norm 1.0 \
  --max-bad-steps 3 \
  --temperature 1.0 \
  --top-k 0 \
  --top-p 1.0 \
  --max-new-tokens 0 \
  --engine embedded \
  --engine-dtype bf16 \
  --kv-cache-dtype auto \
  --sync-every 1 \
  --moe-flip 0.0 \
  --no-prefix-cache \
  --no-routing-replay \
  --tp 1 \
  --no-fsdp \
  --shared-prefix \
  --train-dtype auto \
  --eval-every 20 \
  --eval-size 500 \
  --eval-task "" \
  --eval-split test \
  --eval-samples 1 \
  --eval-dtype engine \
  --save-every 50 \
  --keep-checkpoints 2 \
  --report-to none \
  --token-records 0 \
  "$@"
