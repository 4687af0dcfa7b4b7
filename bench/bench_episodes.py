"""Multi-turn rollout speed: agent.run_episodes on `--task guess` with the embedded engine, by engine dtype.

    .venv/bin/python bench/bench_episodes.py                       # 32 episodes, fp32 and bf16, 1 thread

Model: the tiny guess model (data.tiny.default_model(task="guess"), built on first use); rows: the first --episodes
train rows; 6 turns at most, 8 new tokens per turn, temperature 1. One generate call per turn over the live episodes
(each turn prefills its whole context: the embedded engine keeps no KV cache across turns). Each figure is the best of
--repeats timed runs after one warm-up; "cpu" is process time (robust to other jobs), "wall" elapsed time.
"""

import argparse
import os
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # repo root, run from anywhere
import agent  # noqa: E402
from data.guess import GuessEnv, MAX_TURNS  # noqa: E402
from data.tasks import guess_task  # noqa: E402
from data.tiny import build_tokenizer, default_model  # noqa: E402
from rollout import EmbeddedEngine, Sampling  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=32)
    ap.add_argument("--dtype", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16", "fp8", "int4"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = default_model(os.path.join(REPO, ".cache"), task="guess")
    tok, rows = build_tokenizer(), guess_task().train.to_list()[: args.episodes]
    print(f"model {path}\nthreads {args.threads}, {args.episodes} episodes, at most {MAX_TURNS} turns of 8 tokens")
    print(f"{'dtype':>6} {'s cpu':>7} {'s wall':>7} {'turns':>6} {'model tok/s cpu':>16} {'context tok/s cpu':>18}")
    for dtype in args.dtype:
        engine = EmbeddedEngine(path, dtype=dtype)
        runs = []
        for seed in range(args.repeats + 1):
            w, c = time.perf_counter(), time.process_time()
            ep = agent.run_episodes(engine, tok, GuessEnv, rows, Sampling(max_new_tokens=8, seed=seed, stop_token_ids=(tok.eos_token_id,)),
                                    max_turns=MAX_TURNS, context_len=256)
            runs.append((time.process_time() - c, time.perf_counter() - w, ep))
        cpu, wall, ep = min(runs[1:], key=lambda r: r[0])
        ro = ep.rollout
        print(f"{dtype:>6} {cpu:>7.2f} {wall:>7.2f} {sum(ep.turns):>6} {int(ro.mask.sum()) / cpu:>16.0f} "
              f"{(sum(map(len, ro.prompt_ids)) + int(ro.attend.sum())) / cpu:>18.0f}", flush=True)


if __name__ == "__main__":
    main()
