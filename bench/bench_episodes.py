"""Multi-turn rollout speed: agent.run_episodes with the embedded engine, by task and engine dtype, without and with
the prefix cache (EmbeddedEngine prefix_cache: a turn prefills only its new tokens), in the same run.

    .venv/bin/python bench/bench_episodes.py                       # guess, calc, calc-caller: 32 episodes, fp32, 1 thread

Models: the tiny default models of `--task guess` and `--task calc` (data.tiny.default_model, built on first use), and
for calc-caller (--task calc's tool environment) the tiny addition model fitted to call the calculator in most episodes
(data.tiny.tool_caller, fitted in a temporary folder; the calc model calls it in about a quarter of sampled episodes); rows: the first --episodes train rows; the task's turns and new tokens per turn (guess: 6 turns of 8 tokens; calc:
its tool environment, 3 turns of 96), temperature 1. One generate call per turn over the live episodes. Each figure is
the best of --repeats timed runs after one warm-up; "cpu" is process time (robust to other jobs), "wall" elapsed time;
"prefilled" the prompt tokens the engine ran through its prefill (EmbeddedEngine.prefill_tokens) per run.
"""

import argparse
import os
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # repo root, run from anywhere
import agent  # noqa: E402
import tools  # noqa: E402
from data.guess import GuessEnv, MAX_TURNS  # noqa: E402
from data.tasks import calc_task, guess_task  # noqa: E402
from data.tiny import build_tokenizer, default_model, tool_caller  # noqa: E402
from embedded_engine import EmbeddedEngine  # noqa: E402
from rollout import Sampling  # noqa: E402


def workload(name: str, tok):
    """(env class, task, max turns, new tokens per turn, stop ids) of a task."""
    if name == "guess":
        return GuessEnv, guess_task(), MAX_TURNS, 8, (tok.eos_token_id,)
    task = calc_task()
    env = tools.tool_env(task.env, max_turns=task.max_turns, task=task)
    return env, task, task.max_turns, task.max_new_tokens, tools.stop_ids(tok, env)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--task", nargs="+", default=["guess", "calc", "calc-caller"], choices=["guess", "calc", "calc-caller"]
    )
    ap.add_argument("--episodes", type=int, default=32)
    ap.add_argument("--dtype", nargs="+", default=["fp32"], choices=["fp32", "bf16", "fp8", "int4"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok = build_tokenizer()
    print(f"threads {args.threads}, {args.episodes} episodes per run, best of {args.repeats}")
    print(
        f"{'task':>11} {'dtype':>6} {'prefix cache':>12} {'s cpu':>7} {'s wall':>7} {'turns':>6} {'prefilled':>10} "
        f"{'model tok/s cpu':>16} {'speed-up':>9}"
    )
    cache = os.path.join(REPO, ".cache")
    for name in args.task:
        path = (
            tool_caller(default_model(cache), tempfile.mkdtemp())
            if name == "calc-caller"
            else default_model(cache, task=name)
        )
        env, task, turns, new, stop = workload(name, tok)
        rows = task.train.to_list()[: args.episodes]
        for dtype in args.dtype:
            base = None
            for cached in (False, True):
                engine = EmbeddedEngine(path, dtype=dtype, prefix_cache=cached)
                runs = []
                for seed in range(args.repeats + 1):
                    before = engine.prefill_tokens
                    w, c = time.perf_counter(), time.process_time()
                    ep = agent.run_episodes(
                        engine,
                        tok,
                        env,
                        rows,
                        Sampling(max_new_tokens=new, seed=seed, stop_token_ids=stop),
                        max_turns=turns,
                        context_len=256,
                    )
                    runs.append((time.process_time() - c, time.perf_counter() - w, ep, engine.prefill_tokens - before))
                cpu, wall, ep, prefilled = min(runs[1:], key=lambda r: r[0])
                base = base or cpu
                print(
                    f"{name:>11} {dtype:>6} {'on' if cached else 'off':>12} {cpu:>7.2f} {wall:>7.2f} {sum(ep.turns):>6} "
                    f"{prefilled:>10,} {int(ep.rollout.mask.sum()) / cpu:>16.0f} {base / cpu:>8.2f}x",
                    flush=True,
                )


if __name__ == "__main__":
    main()
