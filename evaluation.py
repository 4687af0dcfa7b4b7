"""Held-out evaluation, and the rollout-then-score pair the training loop shares with it.

metrics, records = evaluate(engine, tok, task, sampling, size=500, samples=1, dp_rank=0, dp=1)
"""

from __future__ import annotations

from dataclasses import asdict

import torch.distributed as dist

from data.rewards import Scores, majority_correct, pass_at_k, reward_columns, score
from data.tasks import encode_prompt
from rollout import Sampling
from runlog import Metrics


def rollouts(engine, tok, rows, s: Sampling, play):
    """s.n samples of each task row: a Rollout, or with a multi-turn task (play) agent.Episodes."""
    if play:
        return play(engine, rows.to_list(), s)
    return engine.generate([encode_prompt(tok, p) for p in rows["prompt"]], s)


def scored(task, tok, rows, n: int, out, play) -> tuple[list, Scores]:
    """(completions, Scores) of rollouts(): per episode its conversation and return, or the decoded responses and the
    task's reward on them."""
    if play:
        return out.messages, Scores.of(out.returns)
    texts = tok.batch_decode([t[m].tolist() for t, m in zip(out.tokens, out.mask)], skip_special_tokens=True)
    return texts, score(task, texts, reward_columns(rows, n))


def evaluate(
    engine, tok, task, sampling: Sampling, *, size: int, samples: int, dp_rank: int, dp: int, play=None
) -> tuple[dict[str, float], list[dict]]:
    """Held-out evaluation on the first `size` test problems (--eval-size), sharded over the engine ranks, summed over
    all ranks. The greedy completion samples with top-k 1; the sampled ones draw row r from sampling.seed + 7 + r.

    eval/greedy_acc and eval/sampled_acc: the mean reward of the greedy (top-1) completion and of the sampled ones
    (= exact-match accuracy for the built-in tasks); a None reward counts as 0. With samples n > 1 (--eval-samples) each
    problem gets n samples: eval/mean@n (= sampled_acc), and for k = 1, 2, 4, ... <= n the unbiased eval/pass@k
    (a sample is correct when its reward is > 0) and, when the reward returns "pred", eval/maj@k (majority_correct).
    A multi-turn task is played by play(engine, rows, sampling) -> agent.Episodes: the reward is the episode's return
    and the completion its conversation (chat messages).
    Returns (metrics, records): one record per completion for the samples file, gathered on rank 0 ([] elsewhere).
    """
    n = samples
    ks = [2**i for i in range(n.bit_length()) if 2**i <= n] if n > 1 else []
    m = Metrics()
    records = []
    m.add_ratio("eval/greedy_acc", 0, 0)  # every rank holds the keys (no problem anywhere: NaN)
    m.add_ratio("eval/sampled_acc", 0, 0)
    if engine is not None:
        size = min(size, len(task.test))
        lo, hi = size * dp_rank // dp, size * (dp_rank + 1) // dp  # contiguous shards: row seeds as in one process
        test = task.test.select(range(lo, hi))
        prompts, answers = test["prompt"], test["answer"]
        greedy = Sampling(**{**asdict(sampling), "top_k": 1, "n": 1})
        sampled = Sampling(**{**asdict(sampling), "n": n, "seed": sampling.seed + 7 + lo * n})  # row r has seed + r
        for kind, s, k in (("greedy", greedy, 1), ("sampled", sampled, n)) if len(test) else ():
            texts, sc = scored(task, tok, test, k, rollouts(engine, tok, test, s, play), play)
            r = sc.rewards * sc.rewarded  # None counts as 0
            m.add_ratio(f"eval/{kind}_acc", r.sum(), len(r))
            # the reward's extra keys first: a key named like ours is overwritten
            records += [
                {
                    **sc.extras[i],
                    "kind": kind,
                    "problem": lo + i // k,
                    "sample": i % k,
                    "prompt": prompts[i // k],
                    "answer": answers[i // k],
                    "completion": t,
                    "reward": sc.rewards[i].item() if sc.rewarded[i] else None,
                }
                for i, t in enumerate(texts)
            ]
            if kind == "sampled" and ks:
                R = r.view(-1, n).tolist()
                preds = [e.get("pred") for e in sc.extras]
                m.add_ratio("eval/has_pred", any("pred" in e for e in sc.extras), 1)
                for kk in ks:
                    passed = sum(pass_at_k(n, sum(x > 0 for x in row), kk) for row in R)
                    m.add_ratio(f"eval/pass@{kk}", passed, len(R))
                    majority = sum(majority_correct(preds[p * n : (p + 1) * n], R[p], kk) for p in range(len(R)))
                    m.add_ratio(f"eval/maj@{kk}", majority, len(R))
    out = m.reduce()
    if ks:
        out[f"eval/mean@{n}"] = out["eval/sampled_acc"]
        if not out.pop("eval/has_pred", 0) > 0:  # maj@k only when the reward returns "pred"
            out = {k: v for k, v in out.items() if not k.startswith("eval/maj@")}
    if dist.is_initialized():
        parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(records, parts, dst=0)
        if parts:
            records = sorted((r for p in parts for r in p), key=lambda r: (r["kind"], r["problem"], r["sample"]))
        else:
            records = []
    return out, records
