"""Seconds per training step by phase, tokens/s and peak memory, for PPO+critic and GRPO, 1 and 2 processes.

    .venv/bin/python bench/bench_train.py                         # the tiny model on CPU
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_train.py --nprocs 1 --variant= --variant="--engine-dtype fp32" \
        --trl /path/to/trl-1.16/bin/python --trl-ppo /path/to/trl-1.12/bin/python   # against TRL, same run, same threads
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_train.py --nprocs 1 --variant= --variant=--no-shared-prefix \
        --variant="--train-dtype bf16"                            # what each trainer feature gives, same run, same threads
    .venv/bin/python bench/bench_train.py --steps 8 --nprocs 1 --model /path/to/Qwen3-0.6B --engine sglang \
        --extra "--engine-dtype bf16 --max-new-tokens 512"        # a real model on a GPU machine

Each configuration is a real `train_ppo.py` run (64 completions per step, at most 32 new tokens by
default) in a temp folder; the figures are read back from its metrics.jsonl and averaged over the
steps after the first `--skip` (warm-up: allocation, first-call overheads). A script, not a test: it
prints figures and asserts nothing.
"""

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHASES = ("rollout", "reward", "recompute", "advantages", "correction", "critic", "policy", "sync")


def run(algo: str, nprocs: int, variant: str, args) -> dict:
    out = tempfile.mkdtemp(prefix=f"bench-{algo}-{nprocs}-")
    flags = [
        "--algo",
        algo,
        "--steps",
        str(args.steps),
        "--rollout-batch",
        "64",
        "--max-new-tokens",
        "32",
        "--critic-pretrain",
        "0",
        "--eval-every",
        str(10**6),
        "--eval-size",
        "1",
        "--save-every",
        str(10**6),
        "--out-dir",
        out,
        *(["--model", args.model] if args.model else []),
        "--engine",
        args.engine,
        *shlex.split(args.extra),
        *shlex.split(variant),
    ]
    launch = (
        [sys.executable]
        if nprocs == 1
        else [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nprocs)]
    )
    env = {
        **os.environ,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nprocs))),
    }
    proc = subprocess.run([*launch, "train_ppo.py", *flags], cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{algo} x{nprocs} {variant} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if r["step"] > args.skip]

    def mean(k):
        return sum(r.get(k, 0.0) for r in rows) / len(rows)

    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)["config"]
    return {
        "step": mean("time/step"),
        **{p: mean(f"time/{p}") for p in PHASES},
        "tok/s": mean("rollout/tokens_per_s"),
        "train TFLOP": train_flops(cfg, mean("train/tokens_per_pass"), mean("train/response_tokens")) / 1e12,
        "peak GiB": max(r["mem/peak_gib_max"] for r in rows),  # on CUDA also per phase (runlog.timed):
        "phase GiB": {p: max(r[f"mem/{p}_gib_max"] for r in rows) for p in PHASES if f"mem/{p}_gib_max" in rows[0]},
    }


def train_flops(cfg: dict, tokens: float, response_tokens: float) -> float:
    """Model FLOPs of one step's trainer passes (recompute, critic, policy; not generation): 2 N per token and forward,
    3x that for forward + backward, N = the backbone's parameters without the embeddings (for an MoE the experts a
    token is routed to only), plus the LM head at the response positions of the policy passes. Attention's score and
    value products (4 x context x width per token and layer) are left out, so MFU reads a little low at long contexts."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    mc = AutoConfig.from_pretrained(cfg["model_path"])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(mc)
    n, experts = 0, getattr(mc, "num_experts", 0)
    for name, p in model.named_parameters():
        if "embed_tokens" in name or "lm_head" in name:
            continue
        n += p.numel() * (mc.num_experts_per_tok / experts if experts and ".experts." in name else 1)
    head = 2 * mc.hidden_size * mc.vocab_size * response_tokens
    policy = (
        1 + 3 * cfg["ppo_epochs"] + (cfg["kl"] != "none")
    )  # recompute (+ reference) forwards, then forward + backward
    critic = 1 + 3 * cfg["critic_updates"] if cfg["algo"] == "ppo" else 0
    return (2 * n * tokens) * (policy + critic) + head * policy


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--skip", type=int, default=2, help="initial steps left out of the averages")
    ap.add_argument("--nprocs", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--algos", nargs="+", default=["ppo", "grpo"])
    ap.add_argument("--model", default="", help="HF model folder; default: the embedded tiny model")
    ap.add_argument("--engine", default="embedded")
    ap.add_argument("--extra", default="", help="more train_ppo.py flags, one string")
    ap.add_argument(
        "--variant",
        action="append",
        help="a flag set (--variant='--train-dtype bf16'; --variant= for the defaults); "
        "repeat it: each config runs every variant in turn (default: the defaults only)",
    )
    ap.add_argument(
        "--trl",
        default="",
        help="Python of a venv with TRL 1.16: after our GRPO configs of 1 process, time TRL's GRPO "
        "step on the same model and batch at the same threads (bench/bench_trl.py)",
    )
    ap.add_argument("--trl-ppo", default="", help="the same for PPO, with a venv of TRL 1.12 (1.16 has no PPO trainer)")
    ap.add_argument(
        "--peak-tflops",
        type=float,
        default=0.0,
        help="the device's peak dense TFLOP/s at the training dtype, for an MFU "
        "column (H100/H200 SXM bf16: 989); 0: TFLOP/s only",
    )
    args = ap.parse_args()
    args.variants = args.variant or [""]
    mfu = f" {'MFU %':>6}" if args.peak_tflops else ""
    print(
        f"{'config':<36} {'s/step':>7} "
        + " ".join(f"{p:>10}" for p in PHASES)
        + f" {'sync %':>7} {'tok/s':>8} {'peak GiB':>8}"
        f" {'train TFLOP/s':>13}{mfu}"
    )
    for algo in args.algos:
        for n in args.nprocs:
            for v in args.variants:
                r = run(algo, n, v, args)
                tflops = r["train TFLOP"] / (r["recompute"] + r["critic"] + r["policy"])  # over the trainer's phases
                print(
                    f"{f'{algo} x{n} {v}'.strip():<36} {r['step']:7.3f} "
                    + " ".join(f"{r[p]:10.3f}" for p in PHASES)
                    + f" {100 * r['sync'] / r['step']:7.2f} {r['tok/s']:8.0f} {r['peak GiB']:8.2f} {tflops:13.4g}"
                    + (f" {100 * tflops / args.peak_tflops:6.2f}" if args.peak_tflops else ""),
                    flush=True,
                )
                if r["phase GiB"]:
                    print(
                        "    peak GiB by phase: " + ", ".join(f"{p} {g:.2f}" for p, g in r["phase GiB"].items()),
                        flush=True,
                    )
            trl = {"grpo": args.trl, "ppo": args.trl_ppo}.get(algo)
            if trl and n == 1:
                env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(os.cpu_count() or 1))}
                proc = subprocess.run(
                    [trl, "bench/bench_trl.py", algo, "--steps", str(args.steps), "--skip", str(args.skip)],
                    cwd=REPO,
                    env=env,
                    capture_output=True,
                    text=True,
                )
                if proc.returncode:
                    sys.exit(f"TRL {algo} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
                t = json.loads(proc.stdout.strip().splitlines()[-1])
                label = f"TRL {t['trl']} {algo} x1 ({t['threads']} thread(s))"
                print(f"{label:<36} {t['step']:7.3f}", flush=True)


if __name__ == "__main__":
    main()
