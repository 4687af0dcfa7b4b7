#!/usr/bin/env bash
# A few minutes on one GPU machine with SGLang (CUDA build) installed: the SGLang tier on CUDA (generate,
# log-prob contract, weight sync, sleep/wake with the memory really released), the CUDA-marked tests of
# the embedded engine, then the training-step and memory benchmarks. Prints everything; asserts in pytest.
#   bash bench/gpu_check.sh [MODEL]       # MODEL: optional local HF folder (Qwen3 family) for the benchmark
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
"$PY" -c "import torch, sglang; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'sglang', sglang.__version__)"
"$PY" -m pytest -q -s tests/test_sglang.py tests/test_rollout.py -k "sglang or cuda or CUDA" 2>&1 | tail -40
# Step time by phase, peak memory and MFU (989 TFLOP/s: H100/H200 SXM dense bf16): fp32 against bf16 training (the
# CUDA default), GRPO with and without shared prefixes. (--fsdp needs 2 data-parallel ranks: on a machine of one GPU
# it is not measured; with more, add --nprocs 2 --variant=--fsdp.)
"$PY" bench/bench_train.py --steps 6 --nprocs 1 --algos ppo grpo --engine sglang --extra "--engine-dtype bf16" --peak-tflops 989 \
  --variant="--train-dtype fp32" --variant= --variant=--no-shared-prefix ${1:+--model "$1"}
# Peak memory of a policy step against prompt and response length (vocabulary 151,936): all-position vs response-only logits.
"$PY" bench/bench_memory.py --rows 4 --responses 1024 4096
# Rollout tokens/s of the SGLang engine alone and colocated with the trainer's policy, critic and AdamW states.
"$PY" bench/bench_colocate.py ${1:+--model "$1"}
