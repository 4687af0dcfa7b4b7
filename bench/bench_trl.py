"""TRL's GRPO step on the same model, task and batch as bench/bench_train.py, for a same-run comparison.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_train.py --nprocs 1 --algos grpo --trl /path/to/trl-venv/bin/python

bench_train.py runs this file with the Python of an environment where TRL is installed (`pip install torch==2.13.0
trl==1.16.0`; TRL pins its own transformers, so it lives in its own venv), right after its own GRPO configuration, at
the same thread count. The settings match train_ppo.py's GRPO: the tiny model warmed up on addition, 64 completions per
step in groups of 4, at most 32 new tokens, temperature 1, lr 2e-4, no KL (beta 0), one optimiser step per generation,
fp32 on CPU. TRL generates with Hugging Face `generate` (no vLLM on CPU). Prints one JSON line: the mean seconds per
step after the first `--skip` steps, measured around each optimiser step by a trainer callback (generation included).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--skip", type=int, default=2)
    args = ap.parse_args()
    import datasets
    import torch
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from data.rewards import exact_match_reward
    from data.tasks import get_task
    from data.tiny import default_model

    path = default_model(os.path.join(REPO, ".cache"), task="addition")
    train = get_task("addition").train.select(range(64 * args.steps))
    ds = datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in train["prompt"]], "answer": train["answer"]})

    def reward(completions, answer, **_):  # conversational completions: a list of one assistant message each
        return exact_match_reward([c[0]["content"] if isinstance(c, list) else c for c in completions], answer)

    times = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.t0)

    cfg = GRPOConfig(output_dir=tempfile.mkdtemp(prefix="bench-trl-"), per_device_train_batch_size=64, num_generations=4,
                     max_completion_length=32, max_steps=args.steps, learning_rate=2e-4, beta=0.0, temperature=1.0,
                     steps_per_generation=1, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, bf16=False,
                     seed=0, dataloader_num_workers=0, lr_scheduler_type="constant")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=ds, processing_class=tok, callbacks=[StepTimer()]).train()
    kept = times[args.skip :]
    print(json.dumps({"trl": trl.__version__, "threads": torch.get_num_threads(), "steps": len(times), "step": sum(kept) / len(kept)}))


if __name__ == "__main__":
    main()
