"""Seconds per training step by phase, tokens/s and peak memory, for PPO+critic and GRPO, 1 and 2 processes.

    .venv/bin/python bench/bench_train.py                         # the tiny model on CPU
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_train.py --nprocs 1 --variant= --variant="--engine-dtype fp32" \
        --trl ../trl-1.16/bin/python --trl-ppo ../trl-1.12/bin/python   # against TRL, same run, same threads
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_train.py --nprocs 1 --variant= --variant=--no-shared-prefix \
        --variant="--train-dtype bf16"                            # what each trainer feature gives, same run, same threads
    OMP_NUM_THREADS=2 .venv/bin/python bench/bench_train.py --nprocs 1 --steps 3 --skip 1 \
        --model .cache/smollm2-135m-instruct --task examples/sums.jsonl --rollout-batch 32 --max-new-tokens 32 \
        --variant="--engine-dtype fp32" --variant="--engine-dtype bf16 --train-dtype bf16" \
        --variant="ppo:--engine-dtype fp32 --critic-updates 1" --trl-bf16 \
        --trl ../trl-1.16/bin/python --trl-ppo ../trl-1.12/bin/python  # a real model against TRL (SmolLM2, CPU)
    .venv/bin/python bench/bench_train.py --steps 8 --nprocs 1 --model /path/to/Qwen3-0.6B --engine sglang \
        --extra "--engine-dtype bf16 --max-new-tokens 512"        # a real model on a GPU machine

Each configuration is a real `train_ppo.py` run (--rollout-batch completions per step, at most --max-new-tokens new
tokens, of --task) in a temp folder, removed afterwards; the figures are read back from its metrics.jsonl and
averaged over the steps after the first `--skip` (warm-up: allocation, first-call overheads). A variant written
"ppo:FLAGS" or "grpo:FLAGS" runs for that algorithm only. Columns: the phases' seconds (time/<phase>); "resp" the
mean response tokens per completion; "k3" the engine/trainer mismatch (mismatch/k3); "train GFLOP" the trainer's
model FLOPs per step (train_flops: recompute, critic, policy, forward and backward); "GFLOP/s" those over the
recompute, critic and policy phases; "% mach" that against the "machine GFLOP/s" line (CPU: F.linear at the model's
layer shapes, one micro-batch's tokens as rows, in the trainer's dtype, at the same threads; GPU: --peak-tflops);
"cpu %" the run's CPU time over its wall time (load included): far below 100 x threads means other work took the
cores. `--trl` / `--trl-ppo` then time TRL's step (bench/bench_trl.py) on the same model, task, prompts, batch, new
tokens and threads, and print ours / TRL's for each of our rows. A script, not a test: it prints figures and asserts
nothing.
"""

import argparse
import json
import math
import os
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHASES = ("rollout", "reward", "recompute", "advantages", "correction", "critic", "policy", "sync")


def threads(nprocs: int) -> str:
    return os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nprocs)))


def run(algo: str, nprocs: int, variant: str, args) -> dict:
    out = tempfile.mkdtemp(prefix=f"bench-{algo}-{nprocs}-")
    flags = [
        "--algo",
        algo,
        "--steps",
        str(args.steps),
        "--rollout-batch",
        str(args.rollout_batch),
        "--max-new-tokens",
        str(args.max_new_tokens),
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
        *(["--model", args.model] if args.model else []),
        *(["--task", args.task] if args.task else []),
        *(["--lr", args.lr] if args.lr else []),
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
    env = {**os.environ, "OMP_NUM_THREADS": threads(nprocs)}
    start, cpu0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        proc = subprocess.run([*launch, "train_ppo.py", *flags], cwd=REPO, env=env, capture_output=True, text=True)
        wall, cpu1 = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode:
            sys.exit(f"{algo} x{nprocs} {variant} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        with open(os.path.join(out, "metrics.jsonl")) as f:
            rows = [r for r in map(json.loads, f) if r["step"] > args.skip and "time/step" in r]
        with open(os.path.join(out, "config.json")) as f:
            cfg = json.load(f)["config"]
    finally:
        shutil.rmtree(out, ignore_errors=True)  # a real model's final checkpoint is GBs

    def mean(k):
        return sum(r.get(k, 0.0) for r in rows) / len(rows)

    # one micro-batch's tokens: a pass's fed tokens (all ranks) over the ranks and the micro-batches of a rank
    per_rank = cfg["rollout_batch"] / nprocs
    micro_rows = mean("train/tokens_per_pass") / nprocs / max(1, math.ceil(per_rank / cfg["micro_batch"]))
    return {
        "step": mean("time/step"),
        **{p: mean(f"time/{p}") for p in PHASES},
        "tok/s": mean("rollout/tokens_per_s"),
        "resp": mean("rollout/response_len_mean"),
        "k3": mean("mismatch/k3"),
        "cpu %": 100 * (cpu1.ru_utime - cpu0.ru_utime + cpu1.ru_stime - cpu0.ru_stime) / wall,
        "train GFLOP": train_flops(cfg, mean("train/tokens_per_pass"), mean("train/response_tokens")) / 1e9,
        "peak GiB": max(r["mem/peak_gib_max"] for r in rows),  # on CUDA also per phase (runlog.timed):
        "phase GiB": {p: max(r[f"mem/{p}_gib_max"] for r in rows) for p in PHASES if f"mem/{p}_gib_max" in rows[0]},
        "cfg": cfg,
        "micro rows": micro_rows,
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


def machine_gflops(model_path: str, rows: int, dtype: str, seconds: float = 1.0) -> float:
    """GFLOP/s of this CPU at the current torch thread count on one decoder layer's matrix products (F.linear: q, k, v,
    o, gate, up, down at the model's shapes) with `rows` tokens, in fp32 or bf16: the ceiling the trainer's phases
    run against (forward shapes only; a backward's products have the same sizes, transposed)."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoConfig

    mc = AutoConfig.from_pretrained(model_path)
    h, inter = mc.hidden_size, mc.intermediate_size
    kv = mc.num_key_value_heads * (getattr(mc, "head_dim", None) or h // mc.num_attention_heads)
    shapes = [(h, h), (h, kv), (h, kv), (h, h), (h, inter), (h, inter), (inter, h)]  # (in, out)
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    weights = [torch.randn(o, i, dtype=dt) for i, o in shapes]
    inputs = {i: torch.randn(rows, i, dtype=dt) for i in (h, inter)}
    flop = sum(2 * rows * i * o for i, o in shapes)

    def layer():
        for w, (i, _) in zip(weights, shapes):
            F.linear(inputs[i], w)

    layer()  # warm-up: oneDNN's first-call setup
    reps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        layer()
        reps += 1
    return flop * reps / (time.perf_counter() - start) / 1e9


def cpu_line() -> str:
    """The CPU's name and whether it has native bf16 (avx512_bf16, amx_bf16) and AVX-512, from /proc/cpuinfo."""
    import torch

    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return f"cpu: unknown (no /proc/cpuinfo), torch capability {torch.backends.cpu.get_cpu_capability()}"
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "unknown")
    flags = set(next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), []))
    have = ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in ("avx512f", "avx512_bf16", "amx_bf16"))
    return f"cpu: {name} ({os.cpu_count()} logical), {have}; torch capability {torch.backends.cpu.get_cpu_capability()}"


def trl_step(algo: str, python: str, model_path: str, bf16: bool, args) -> dict:
    """TRL's step (bench/bench_trl.py in the venv of `python`) on our run's model folder, task, batch and new tokens."""
    cmd = [python, "bench/bench_trl.py", algo, "--model", model_path, "--task", args.task or "addition"]
    cmd += ["--bf16"] if bf16 else []
    cmd += ["--rollout-batch", str(args.rollout_batch), "--max-new-tokens", str(args.max_new_tokens)]
    cmd += ["--steps", str(args.steps), "--skip", str(args.skip), *(["--lr", args.lr] if args.lr else [])]
    env = {**os.environ, "OMP_NUM_THREADS": threads(1)}
    start, cpu0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    wall, cpu1 = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        sys.exit(f"TRL {algo} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    cpu = 100 * (cpu1.ru_utime - cpu0.ru_utime + cpu1.ru_stime - cpu0.ru_stime) / wall
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "cpu %": cpu}


def variants_of(algo: str, variants: list[str]) -> list[str]:
    """The variants that run for `algo`: unprefixed ones, and "algo:FLAGS" ones without their prefix."""
    kept = []
    for v in variants:
        head, sep, rest = v.partition(":")
        if sep and head.strip() in ("ppo", "grpo", "reinforce"):
            if head.strip() == algo:
                kept.append(rest.strip())
        else:
            kept.append(v)
    return kept


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--skip", type=int, default=2, help="initial steps left out of the averages")
    ap.add_argument("--nprocs", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--algos", nargs="+", default=["ppo", "grpo"])
    ap.add_argument("--model", default="", help="HF model folder; default: the embedded tiny model")
    ap.add_argument("--task", default="", help="train_ppo.py's --task (a name, rg:<name>, a file); default: addition")
    ap.add_argument("--rollout-batch", type=int, default=64, help="completions per step")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--lr", default="", help="learning rate, ours and TRL's (default: train_ppo.py's, 2e-4)")
    ap.add_argument("--engine", default="embedded")
    ap.add_argument("--extra", default="", help="more train_ppo.py flags, one string")
    ap.add_argument(
        "--variant",
        action="append",
        help="a flag set (--variant='--train-dtype bf16'; --variant= for the defaults; --variant='ppo:--critic-updates "
        "1' for one algorithm); repeat it: each config runs every variant in turn (default: the defaults only)",
    )
    ap.add_argument(
        "--trl",
        default="",
        help="Python of a venv with TRL 1.16: after our GRPO configs of 1 process, time TRL's GRPO "
        "step on the same model, task and batch at the same threads (bench/bench_trl.py)",
    )
    ap.add_argument("--trl-ppo", default="", help="the same for PPO, with a venv of TRL 1.12 (1.16 has no PPO trainer)")
    ap.add_argument(
        "--trl-bf16", action="store_true", help="time TRL a second time with bf16=True (autocast over fp32 weights)"
    )
    ap.add_argument(
        "--peak-tflops",
        type=float,
        default=0.0,
        help="the device's peak dense TFLOP/s at the training dtype, for the %% mach column (H100/H200 SXM bf16: 989); "
        "0: on CPU measured (machine_gflops), on CUDA left out",
    )
    ap.add_argument("--json", default="", help="also write every row to this file (a list, rewritten after each row)")
    args = ap.parse_args()
    args.variants = args.variant or [""]
    import torch

    cpu = not torch.cuda.is_available()  # the trainer runs on CUDA where there is one
    print(
        f"model {args.model or 'tiny (default)'}, task {args.task or 'addition'}, "
        f"{args.rollout_batch} completions/step, "
        f"<= {args.max_new_tokens} new tokens, OMP_NUM_THREADS={threads(1)} per process, "
        f"mean of steps {args.skip + 1}-{args.steps}"
    )
    if cpu:
        print(cpu_line())
    print(
        f"{'config':<48} {'s/step':>7} "
        + " ".join(f"{p:>10}" for p in PHASES)
        + f" {'sync %':>7} {'tok/s':>8} {'resp':>6} {'k3':>8} {'peak GiB':>8} {'train GFLOP':>11} {'GFLOP/s':>8}"
        f" {'% mach':>6} {'cpu %':>6}",
        flush=True,
    )
    machine = {}  # (rows, dtype) -> GFLOP/s
    records = []

    def record(row: dict) -> None:
        records.append(row)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(records, f, indent=1)

    for algo in args.algos:
        for n in args.nprocs:
            ours = []
            for v in variants_of(algo, args.variants):
                r = run(algo, n, v, args)
                gflops = r["train GFLOP"] / (r["recompute"] + r["critic"] + r["policy"])  # over the trainer's phases
                if cpu:
                    dtype = "bf16" if r["cfg"]["train_dtype"] == "bf16" else "fp32"  # auto: fp32 on CPU
                    rows = max(32, round(r["micro rows"] / 32) * 32)
                    if (rows, dtype) not in machine:
                        torch.set_num_threads(int(threads(n)))
                        machine[rows, dtype] = machine_gflops(r["cfg"]["model_path"], rows, dtype)
                        print(
                            f"    machine GFLOP/s, {dtype}, {rows} rows, {threads(n)} thread(s): "
                            f"{machine[rows, dtype]:.1f}",
                            flush=True,
                        )
                    peak = machine[rows, dtype]
                else:
                    peak = args.peak_tflops * 1e3
                pct = 100 * gflops / peak if peak else None
                mach = f"{pct:6.1f}" if pct is not None else f"{'-':>6}"
                label = f"{algo} x{n} {v}".strip()
                print(
                    f"{label:<48} {r['step']:7.3f} "
                    + " ".join(f"{r[p]:10.3f}" for p in PHASES)
                    + f" {100 * r['sync'] / r['step']:7.2f} {r['tok/s']:8.0f} {r['resp']:6.1f} {r['k3']:8.1e}"
                    f" {r['peak GiB']:8.2f} {r['train GFLOP']:11.1f} {gflops:8.2f} {mach} {r['cpu %']:6.0f}",
                    flush=True,
                )
                if r["phase GiB"]:
                    print(
                        "    peak GiB by phase: " + ", ".join(f"{p} {g:.2f}" for p, g in r["phase GiB"].items()),
                        flush=True,
                    )
                ours.append((label, r))
                figures = {k: x for k, x in r.items() if k != "cfg"}
                record({"config": label, "algo": algo, "nprocs": n, **figures, "GFLOP/s": gflops, "% mach": pct})
            trl = {"grpo": args.trl, "ppo": args.trl_ppo}.get(algo)
            if trl and n == 1 and ours:
                for bf16 in (False, True)[: 1 + args.trl_bf16]:
                    t = trl_step(algo, trl, ours[0][1]["cfg"]["model_path"], bf16, args)
                    label = f"TRL {t['trl']} {algo} x1 {'bf16' if bf16 else 'fp32'} ({t['threads']} thread(s))"
                    resp = f"{t['resp_tokens']:.1f}" if t.get("resp_tokens") is not None else "-"
                    print(f"{label:<48} {t['step']:7.3f}   resp {resp}, cpu % {t['cpu %']:.0f}", flush=True)
                    ratios = {lab: r["step"] / t["step"] for lab, r in ours}
                    record({"config": label, "algo": algo, **t, "ours / TRL": ratios})
                    for lab, ratio in ratios.items():
                        print(f"    ours / TRL: {lab:<48} {ratio:.2f}x", flush=True)


if __name__ == "__main__":
    main()
