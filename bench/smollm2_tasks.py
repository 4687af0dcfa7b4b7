"""Which task suits RL on SmolLM2-135M-Instruct: the held-out success of a model folder on candidate tasks, before
any training, with the project's own evaluation path (data.tasks.get_task, the chat template, the EmbeddedEngine,
the task's reward or --reward's; the greedy and sampled seeds of evaluation.evaluate).

    OMP_NUM_THREADS=1 .venv/bin/python bench/smollm2_tasks.py --model .cache/smollm2-135m-instruct \
        --rows 64 --samples 2 --temperature 1.0 --max-new-tokens 32 \
        rg:leg_counting:min_animals=1,max_animals=2 rg:gcd:max_value=20

One line per candidate spec (a --task value): the temperature, max new tokens, the success of the sampled
completions (the share with reward 1, with its 95% Wilson interval; rows x samples completions, counted as
independent, which samples of one row are not quite), the mean reward (eval/sampled_acc, partial credit included),
the greedy success, the share of sampled responses cut at max new tokens, their mean length in tokens, the
held-out rows the task has, and the seconds of the line (the first line of a spec includes building the task and
the greedy pass). A script: it prints figures and asserts nothing.
"""

import argparse
import math
import os
import sys
import time
from dataclasses import asdict

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from data.rewards import load_reward  # noqa: E402
from data.tasks import get_task  # noqa: E402
from embedded_engine import EmbeddedEngine  # noqa: E402
from evaluation import rollouts, scored  # noqa: E402
from rollout import Sampling  # noqa: E402
from tools import stop_ids  # noqa: E402

Z95 = 1.959964


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of k successes in n trials."""
    if n == 0:
        return float("nan"), float("nan")
    p = k / n
    mid = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return mid - half, mid + half


def run(engine, tok, task, test, s: Sampling) -> dict:
    """The completions of s on the rows `test` of `task`: success counts, mean reward, truncation, mean length."""
    roll = rollouts(engine, tok, test, s, None)
    texts, sc = scored(task, tok, test, s.n, roll, None)
    r = (sc.rewards * sc.rewarded).tolist()
    return {
        "exact": sum(x == 1 for x in r),
        "n": len(r),
        "mean": sum(r) / len(r),
        "truncated": sum(f == "length" for f in roll.finish_reasons) / len(r),
        "length": roll.mask.sum(1).float().mean().item(),
        "texts": texts,
    }


def measure(engine, tok, spec: str, args) -> list[dict]:
    """The greedy completion (top-k 1, once) and the sampled ones at each of args.temperature on the first args.rows
    held-out rows of `spec`, with evaluation.evaluate's seeds."""
    start = time.perf_counter()
    task = get_task(spec, reward_fn=load_reward(args.reward) if args.reward else None)
    test = task.test.select(range(min(args.rows, len(task.test))))
    base = Sampling(1.0, 1, 1.0, args.max_new_tokens, stop_ids(tok), 1, args.seed)
    greedy = run(engine, tok, task, test, base)
    out = []
    for t in args.temperature:
        s = Sampling(**{**asdict(base), "temperature": t, "top_k": 0, "n": args.samples, "seed": args.seed + 7})
        r = run(engine, tok, task, test, s)
        out.append({**r, "temperature": t, "greedy": greedy, "test_rows": len(task.test)})
        out[-1]["seconds"] = time.perf_counter() - start
        start = time.perf_counter()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("specs", nargs="+", help="--task values, e.g. rg:chain_sum:min_terms=2,max_terms=2")
    ap.add_argument("--model", default=os.path.join(REPO, ".cache", "smollm2-135m-instruct"))
    ap.add_argument("--rows", type=int, default=64, help="held-out rows (the first of the test set)")
    ap.add_argument("--samples", type=int, default=2, help="sampled completions per row")
    ap.add_argument("--temperature", type=float, nargs="+", default=[1.0])
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--reward", default="", help="a --reward value (e.g. math) instead of the task's own reward")
    ap.add_argument("--seed", type=int, default=0, help="--seed of the run whose evaluation this mirrors")
    ap.add_argument("--show", type=int, default=0, help="print this many sampled completions per candidate")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(args.model)
    engine = EmbeddedEngine(args.model, dtype="fp32")
    print(
        f"{args.model}, {args.rows} held-out rows x {args.samples} samples, reward {args.reward or 'of the task'}, "
        f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}, torch threads {torch.get_num_threads()}"
    )
    print(
        f"{'spec':<60} {'temp':>4} {'new':>3} {'success [95% CI]':>20} {'mean r':>6} {'greedy':>6} "
        f"{'trunc':>5} {'len':>5} {'test':>4} {'s':>5}"
    )
    for spec in args.specs:
        for r in measure(engine, tok, spec, args):
            g = r["greedy"]
            lo, hi = wilson(r["exact"], r["n"])
            print(
                f"{spec:<60} {r['temperature']:4.2f} {args.max_new_tokens:3d} {r['exact'] / r['n']:6.3f} "
                f"[{lo:.3f}, {hi:.3f}] {r['mean']:6.3f} {g['exact'] / g['n']:6.3f} {r['truncated']:5.2f} "
                f"{r['length']:5.1f} {r['test_rows']:4d} {r['seconds']:5.0f}",
                flush=True,
            )
            for text in r["texts"][: args.show]:
                print(f"    {text!r}")


if __name__ == "__main__":
    main()
