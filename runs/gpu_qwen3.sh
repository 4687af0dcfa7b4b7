#!/usr/bin/env bash
# IcePop PPO with a critic on a real Hugging Face model (Qwen3 family) with SGLang as the rollout engine,
# colocated on every GPU of one node: NGPU processes, policy and critic tensor-parallel over TP GPUs,
# one SGLang engine per data-parallel replica. Needs the model downloaded to a local folder
# (e.g. `huggingface-cli download Qwen/Qwen3-1.7B --local-dir $MODEL`) and SGLang installed for CUDA
# (`pip install -r requirements.txt "sglang==0.5.23"` in a CUDA environment). runs/cpu.sh with what differs (its
# OMP_NUM_THREADS=1 is torchrun's own default for several processes); extra arguments are appended (they win).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:?set MODEL to a local Qwen3 / Qwen2.5 model folder}
export PY=${PY:-python} NPROC=${NGPU:-8}
exec bash runs/cpu.sh \
  --model "$MODEL" \
  --task "${TASK:-sort}" \
  --out-dir outputs/gpu_qwen3 \
  --steps 500 \
  --rollout-batch 512 \
  --minibatches 4 \
  --micro-batch 8 \
  --lr 1e-6 \
  --critic-lr 5e-6 \
  --max-new-tokens 1024 \
  --engine sglang \
  --tp 2 \
  --eval-every 25 \
  "$@"
