"""TRL's GRPO (1.16) or PPO (1.12) step on the same model, task and batch as bench/bench_train.py, for a same-run comparison.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_train.py --nprocs 1 --trl /path/to/trl-1.16-venv/bin/python \
        --trl-ppo /path/to/trl-1.12-venv/bin/python

bench_train.py runs this file with the Python of an environment where TRL is installed (`pip install torch==2.13.0
trl==1.16.0`, or trl==1.12.0 for PPO, which TRL 1.16 no longer has; TRL pins its own transformers, so each lives in its
own venv), right after its own configuration, at the same thread count. The settings match train_ppo.py's: the tiny
model warmed up on addition, 64 completions per step, at most 32 new tokens (stopping at EOS), temperature 1, lr 2e-4,
fp32 on CPU, Hugging Face `generate` (no vLLM on CPU), one optimiser step per batch.
- grpo: groups of 4, no KL (beta 0), exact-match reward function.
- ppo: TRL's PPO needs a reward *model*: a sequence-classification copy of the tiny model (its score is random, so only
  the step time means anything), a value model of the same size (our critic's size), kl_coef 0 (TRL still runs its
  reference forward), 1 PPO epoch, 1 minibatch. Ours runs 2 critic updates per step (its default), TRL one value update.
Prints one JSON line: the mean seconds per step after the first `--skip` steps (generation included), from a trainer
callback's timestamps.
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
    ap.add_argument("algo", choices=["grpo", "ppo"])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--skip", type=int, default=2)
    args = ap.parse_args()
    import datasets
    import torch
    import trl
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback

    from data.rewards import exact_match_reward
    from data.tasks import encode_prompt, get_task
    from data.tiny import default_model

    path = default_model(os.path.join(REPO, ".cache"), task="addition")
    train = get_task("addition").train.select(range(64 * args.steps))
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)

    def reward(completions, answer, **_):  # conversational completions: a list of one assistant message each
        return exact_match_reward([c[0]["content"] if isinstance(c, list) else c for c in completions], answer)

    stamps = []

    class StepTimer(TrainerCallback):  # one timestamp at the start and one after each optimiser step
        def on_train_begin(self, *a, **k):
            stamps.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            stamps.append(time.perf_counter())

    common = dict(
        output_dir=tempfile.mkdtemp(prefix="bench-trl-"),
        per_device_train_batch_size=64,
        learning_rate=2e-4,
        temperature=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        seed=0,
        dataloader_num_workers=0,
        lr_scheduler_type="constant",
    )
    if args.algo == "grpo":
        from trl import GRPOConfig, GRPOTrainer

        ds = datasets.Dataset.from_dict(
            {"prompt": [[{"role": "user", "content": p}] for p in train["prompt"]], "answer": train["answer"]}
        )
        cfg = GRPOConfig(
            **common,
            num_generations=4,
            max_completion_length=32,
            max_steps=args.steps,
            beta=0.0,
            steps_per_generation=1,
        )
        trainer = GRPOTrainer(
            model=model, reward_funcs=reward, args=cfg, train_dataset=ds, processing_class=tok, callbacks=[StepTimer()]
        )
    else:
        from trl.experimental.ppo import PPOConfig, PPOTrainer

        tok.padding_side = "left"
        ds = datasets.Dataset.from_dict({"input_ids": [encode_prompt(tok, p) for p in train["prompt"]]})
        cfg = PPOConfig(
            **common,
            total_episodes=64 * args.steps,
            response_length=32,
            stop_token="eos",
            kl_coef=0.0,
            num_ppo_epochs=1,
            num_mini_batches=1,
            local_rollout_forward_batch_size=64,
            num_sample_generations=0,
            missing_eos_penalty=None,
        )

        def scalar():
            return AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=torch.float32)

        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        trainer = PPOTrainer(
            args=cfg,
            processing_class=tok,
            model=model,
            ref_model=ref,
            reward_model=scalar(),
            train_dataset=ds,
            value_model=scalar(),
            callbacks=[StepTimer()],
        )
    trainer.train()
    times = [b - a for a, b in zip(stamps, stamps[1:])]
    kept = times[args.skip :]
    print(
        json.dumps(
            {
                "algo": args.algo,
                "trl": trl.__version__,
                "threads": torch.get_num_threads(),
                "steps": len(times),
                "step": sum(kept) / len(kept),
            }
        )
    )


if __name__ == "__main__":
    main()
