"""TRL's GRPO (1.16) or PPO (1.12) step on the same model, task, prompts and batch as bench/bench_train.py, for a
same-run comparison.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_train.py --nprocs 1 --trl ../trl-1.16/bin/python \
        --trl-ppo ../trl-1.12/bin/python --model .cache/smollm2-135m-instruct --task examples/sums.jsonl

bench_train.py runs this file with the Python of an environment where TRL is installed, right after its own
configurations, at the same thread count, with its --model, --task, --rollout-batch and --max-new-tokens. TRL pins its
own transformers, so each version lives in its own venv, outside the repo:

    python3 -m venv ../trl-1.16 && ../trl-1.16/bin/pip install torch==2.13.0 trl==1.16.0
    python3 -m venv ../trl-1.12 && ../trl-1.12/bin/pip install torch==2.13.0 trl==1.12.0
    ../trl-1.16/bin/pip install reasoning-gym==0.1.25; ../trl-1.12/bin/pip install reasoning-gym==0.1.25  # rg:<name>

(trl pulls datasets and pyarrow, all that data/tasks.py needs at import; the task's reward runs as ours does, so the
default exact match needs nothing more.) PPO comes from 1.12's `trl.experimental.ppo`: TRL 1.16 has no PPO trainer at
all (neither `trl.PPOTrainer` nor `trl.experimental.ppo`).

The settings match train_ppo.py's defaults: temperature 1, lr 2e-4 (--lr), fp32 on CPU (--bf16: the Trainer's bf16=True,
accelerate's autocast over fp32 weights, as our --train-dtype bf16), Hugging Face `generate` (no vLLM on CPU), at most
--max-new-tokens new tokens stopping at EOS, one optimiser step per batch. The prompts are the ones our run trains on
(data.tasks.prompt_indices at seed 0, steps 1..--steps, in order; TRL's PPO shuffles them within that set).
- grpo: groups of 4 (ours: --n-samples default), no KL (beta 0), the task's own reward function (data.rewards.score,
  as train_ppo.py calls it), no dataset shuffle, so step k has our step k's prompts.
- ppo: TRL's PPO needs a reward *model*: a sequence-classification copy of the model (its score is random, so only
  the step time means anything), a value model of the same size (our critic's size), kl_coef 0 (TRL still runs its
  reference forward), 1 PPO epoch, 1 minibatch: one joint policy + value update per step. Prompts are encoded by
  data.tasks.encode_prompt (the chat template, as ours).
Prints one JSON line: the mean seconds per step after the first `--skip` steps (generation included), from a trainer
callback's timestamps, and (GRPO) the mean completion length TRL logged.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def chat(prompt) -> list[dict]:
    """A prompt as chat messages (data.tasks' form: a user string, or messages whose missing keys a Dataset filled)."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [{k: v for k, v in m.items() if v is not None} for m in prompt]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("algo", choices=["grpo", "ppo"])
    ap.add_argument("--model", default="", help="HF model folder; default: the tiny model warmed up on addition")
    ap.add_argument("--task", default="addition", help="a --task spec of train_ppo.py (data.tasks.get_task)")
    ap.add_argument("--rollout-batch", type=int, default=64, help="completions per step")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--n-samples", type=int, default=4, help="GRPO group size")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--skip", type=int, default=2)
    ap.add_argument("--lr", type=float, default=2e-4, help="learning rate (train_ppo.py's default)")
    ap.add_argument("--bf16", action="store_true", help="TrainingArguments(bf16=True): autocast over fp32 weights")
    args = ap.parse_args()
    import datasets
    import torch
    import trl
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback

    from data.rewards import score
    from data.tasks import encode_prompt, get_task, prompt_indices

    if args.model:
        path = args.model
    else:
        from data.tiny import default_model

        path = default_model(os.path.join(REPO, ".cache"), task="addition")
    task = get_task(args.task)
    per_step = args.rollout_batch // (args.n_samples if args.algo == "grpo" else 1)
    train = task.train.select(prompt_indices(0, len(task.train), 0, per_step * args.steps))
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)

    stamps, lengths = [], []

    class StepTimer(TrainerCallback):  # one timestamp at the start and one after each optimiser step
        def on_train_begin(self, *a, **k):
            stamps.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            stamps.append(time.perf_counter())

        def on_log(self, *a, logs=None, **k):
            if logs and "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"])

    common = dict(
        output_dir=tempfile.mkdtemp(prefix="bench-trl-"),
        per_device_train_batch_size=args.rollout_batch,
        learning_rate=args.lr,
        temperature=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=args.bf16,
        seed=0,
        dataloader_num_workers=0,
        lr_scheduler_type="constant",
    )
    if args.algo == "grpo":
        from trl import GRPOConfig, GRPOTrainer

        columns = [c for c in train.column_names if c != "prompt"]

        def reward(completions, task_prompt, **kw):  # conversational completions: a list of one assistant message each
            texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
            return score(task, texts, {"prompt": task_prompt, **{c: kw[c] for c in columns}}).rewards.tolist()

        reward.__name__ = getattr(task.reward_fn, "__name__", "task_reward")
        ds = datasets.Dataset.from_dict(
            {
                "prompt": [chat(p) for p in train["prompt"]],
                "task_prompt": train["prompt"],
                **{c: train[c] for c in columns},
            }
        )
        cfg = GRPOConfig(
            **common,
            num_generations=args.n_samples,
            max_completion_length=args.max_new_tokens,
            max_steps=args.steps,
            beta=0.0,
            steps_per_generation=1,
            shuffle_dataset=False,
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
            total_episodes=args.rollout_batch * args.steps,
            response_length=args.max_new_tokens,
            stop_token="eos",
            kl_coef=0.0,
            num_ppo_epochs=1,
            num_mini_batches=1,
            local_rollout_forward_batch_size=args.rollout_batch,
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
    long = lengths[args.skip :]
    print(
        json.dumps(
            {
                "algo": args.algo,
                "trl": trl.__version__,
                "threads": torch.get_num_threads(),
                "bf16": args.bf16,
                "steps": len(times),
                "step": sum(kept) / len(kept),
                "resp_tokens": sum(long) / len(long) if long else None,
            }
        )
    )


if __name__ == "__main__":
    main()
