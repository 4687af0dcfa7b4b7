#!/usr/bin/env bash
# IcePop PPO with a critic on a real Hugging Face model (Qwen3 family) with SGLang as the rollout engine,
# colocated on every GPU of one node: NGPU processes, policy and critic tensor-parallel over TP GPUs,
# one SGLang engine per data-parallel replica. Needs the model downloaded to a local folder
# (e.g. `huggingface-cli download Qwen/Qwen3-1.7B --local-dir $MODEL`) and SGLang installed for CUDA
# (`pip install -r requirements.txt "sglang==0.5.23"` in a CUDA environment). Extra arguments are appended.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:?set MODEL to a local Qwen3 / Qwen2.5 model folder}
NGPU=${NGPU:-8}
PY=${PY:-python}
exec "$PY" -m torch.distributed.run --standalone --nproc_per_node "$NGPU" train_ppo.py \
  --model "$MODEL" \
  --task "${TASK:-sort}" \
  --out-dir outputs/gpu_qwen3 \
  --steps 500 \
  --seed 0 \
  --no-deterministic \
  --algo ppo \
  --correction icepop \
  --icepop-low 0.5 \
  --icepop-high 2.0 \
  --tis-cap 2.0 \
  --no-drop-masked-from-denominator \
  --kl none \
  --kl-coef 0.01 \
  --gamma 1.0 \
  --lam-policy 0.95 \
  --lam-critic 1.0 \
  --adaptive-lambda 0.0 \
  --whiten-advantages \
  --grpo-std \
  --clip-low 0.2 \
  --clip-high 0.28 \
  --dual-clip 0.0 \
  --agg token-mean \
  --rollout-batch 512 \
  --n-samples 0 \
  --ppo-epochs 1 \
  --minibatches 4 \
  --micro-batch 8 \
  --lr 1e-6 \
  --critic-lr 5e-6 \
  --critic-updates 2 \
  --critic-pretrain 100 \
  --no-freeze-critic-attention \
  --value-clip 0.2 \
  --value-scale 0.5 \
  --max-grad-norm 1.0 \
  --max-bad-steps 3 \
  --temperature 1.0 \
  --top-k 0 \
  --top-p 1.0 \
  --max-new-tokens 1024 \
  --engine sglang \
  --engine-dtype bf16 \
  --tp 2 \
  --eval-every 25 \
  --eval-size 500 \
  --save-every 50 \
  --keep-checkpoints 2 \
  --no-wandb \
  --no-tensorboard \
  "$@"
