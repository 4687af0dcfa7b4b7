"""The GPU check: what the project does on one lent GPU (an H100 or H200 without SGLang, hub or internet), in one run
of about 8 minutes, or every stage with tiny shapes on CPU in about a minute (--dry-run: CI's e2e tier runs it).

    bash bench/gpu_check.sh                                     # on the GPU machine: carried wheels, then this script
    .venv/bin/python bench/gpu_check.py --dry-run --out /tmp/gc  # here, on CPU

Stages, in this order (each one's failure is recorded and the next one runs; none starts after --deadline seconds):
    setup      versions, the GPU, and that every project module imports with what the machine has (plus carried wheels)
    tests      the gpu-marked tests (tests/test_rollout.py: the embedded engine on CUDA in fp32 and bf16 against the
               trainer's recompute, sleep / wake / weight sync)
    main_job   runs/cpu.sh's flags on one process (the tiny default model, 100 steps): evaluation before and after, s/step
    then, for a Qwen3-0.6B-shaped and a Qwen3-1.7B-shaped model (random weights, vocabulary 151,936, built here from a
    config; no hub):
    build:M    the model folder (bf16 weights, the tiny byte-level tokenizer: its ids are a subset of the vocabulary)
    rollout:M  tokens/s of the embedded engine (bf16) against HF generate (bf16), batch 64 and 256, 512 new tokens
               each, no stop; the engine's sleep: bytes released, and wake's seconds
    train:M    bench/bench_train.py: PPO (policy + critic) and GRPO steps by phase in bf16, tokens/s, MFU against the
               card's dense bf16 peak, peak memory by phase
Everything is printed, and written after each stage to OUT/gpu_check.json and OUT/gpu_check.md (a markdown table). The
model folders and run folders go to --work, not to OUT: OUT travels back from the GPU machine and is small. The script
exits 1 if any stage failed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# Qwen3-0.6B and Qwen3-1.7B (their config.json): dense, q/k norm, head_dim 128, tied embeddings.
QWEN3 = dict(
    vocab_size=151_936,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40_960,
    rope_theta=1_000_000.0,
    tie_word_embeddings=True,
)
MODELS = {
    "qwen3-0.6b": dict(QWEN3, hidden_size=1024, intermediate_size=3072),
    "qwen3-1.7b": dict(QWEN3, hidden_size=2048, intermediate_size=6144),
}
# --dry-run: the same vocabulary and layout, tiny width and depth.
DRY = dict(
    QWEN3, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512
)
DRY_MODELS = {"tiny": dict(DRY, hidden_size=64, intermediate_size=128)}
# Micro-batch rows of the trainer per model (the 1.7B's policy and critic with AdamW states fill most of an H100).
MICRO = {"qwen3-0.6b": 16, "qwen3-1.7b": 4}
# Dense bf16 peak TFLOP/s by card name (NVIDIA's datasheets, SXM, without sparsity).
PEAK_BF16 = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


def varied_reward(completions: list[str], **columns) -> list[float]:
    """--reward for the random-weight models: a reward that varies between completions (their characters' sum mod 7),
    so GRPO's groups and PPO's advantages are not all zero and every update really runs."""
    return [(sum(map(ord, c)) % 7) / 6 for c in completions]


# ----------------------------------------------------------------------------- stages


def setup(args) -> dict:
    import torch
    import transformers

    import build  # noqa: F401  (with config, train_ppo and data.*: tyro, datasets, math-verify, peft)
    import data.rewards
    import train_ppo  # noqa: F401

    data.rewards._math_verify()  # --reward math's import, done lazily by the project
    cuda = torch.cuda.is_available()
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "gpu GiB": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if cuda else None,
    }


def tests(args) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-m", "gpu", "tests/test_rollout.py"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    print("\n".join(lines[-30:]))
    if proc.returncode not in (0, 5):  # 5: nothing collected... is a failure too, below
        raise RuntimeError(f"gpu tests failed (exit {proc.returncode}):\n" + "\n".join(lines[-40:]))
    counts = {k: sum(ln.startswith(k.upper()) for ln in lines) for k in ("passed", "failed", "skipped")}
    if not counts["passed"] + counts["skipped"]:
        raise RuntimeError("no gpu test ran:\n" + "\n".join(lines[-20:]))
    return {**counts, "summary": lines[-1]}


def main_job(args) -> dict:
    out = os.path.join(args.work, "main_job")
    steps = 2 if args.dry_run else 100
    flags = ["--steps", str(steps), "--out-dir", out]
    if args.dry_run:
        flags += ["--eval-every", "2", "--eval-size", "32", "--critic-pretrain", "1", "--save-every", "100"]
    env = {**os.environ, "NPROC": "1", "PY": sys.executable}
    start = time.perf_counter()
    # Its own process group: a cut sends it SIGTERM, which torchrun passes on to its worker (in a session of its own),
    # and SIGKILL if it has not ended 30 s later.
    job = subprocess.Popen(
        ["bash", "runs/cpu.sh", *flags],
        cwd=REPO,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        stdout, stderr = job.communicate(timeout=args.job_timeout)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGTERM)
        try:
            job.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)
            job.communicate()
        metrics = os.path.join(out, "metrics.jsonl")
        steps = [json.loads(line).get("step") for line in open(metrics)] if os.path.exists(metrics) else []
        raise RuntimeError(f"runs/cpu.sh did not finish in --job-timeout {args.job_timeout:.0f} s (steps {steps[-1:]})")
    wall = time.perf_counter() - start
    if job.returncode:
        raise RuntimeError(f"runs/cpu.sh failed (exit {job.returncode}):\n{stdout[-2000:]}\n{stderr[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    evals = [r for r in rows if "eval/greedy_acc" in r]
    timed = [r["time/step"] for r in rows if "time/step" in r and r["step"] > 1]
    return {
        "steps": steps,
        "eval steps": [r["step"] for r in evals],
        "greedy acc": [round(r["eval/greedy_acc"], 3) for r in evals],
        "sampled acc": [round(r["eval/sampled_acc"], 3) for r in evals if "eval/sampled_acc" in r],
        "s/step": sum(timed) / len(timed),
        "wall s": wall,
    }


def build_model(name: str, args) -> dict:
    import torch
    import transformers

    from data.tiny import EOS_ID, PAD_ID, build_tokenizer

    path = os.path.join(args.work, name)
    shapes = (DRY_MODELS if args.dry_run else MODELS)[name]
    config = transformers.Qwen3Config(**shapes, bos_token_id=None, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):  # random init on the GPU: seconds, not the minute it takes on CPU
        model = transformers.Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.generation_config = transformers.GenerationConfig(eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return {"path": path, "params M": round(sum(p.numel() for p in model.parameters()) / 1e6, 1), **shapes}


def rollout(name: str, args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from data.tasks import encode_prompt, get_task
    from data.tiny import PAD_ID, build_tokenizer
    from embedded_engine import EmbeddedEngine
    from rollout import Sampling

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    path, tok = os.path.join(args.work, name), build_tokenizer()
    batches, new = ((4, 8), 8) if args.dry_run else ((64, 256), 512)
    train = get_task("addition").train["prompt"]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
    longest = max(len(encode_prompt(tok, p)) for p in train[: max(batches)])
    engine = EmbeddedEngine(path, dtype="bf16", device=device, max_batch_tokens=max(batches) * (longest + new))

    def sync():
        if cuda:
            torch.cuda.synchronize()

    figures = {}
    for B in batches:
        prompts = [encode_prompt(tok, p) for p in train[:B]]
        s = Sampling(max_new_tokens=new, seed=B)  # temperature 1, no top-k / top-p, no stop: every row runs `new`
        engine.generate(prompts, Sampling(max_new_tokens=4, seed=0))  # warm-up
        sync()
        t0 = time.perf_counter()
        n_engine = int(engine.generate(prompts, s).mask.sum())
        sync()
        t_engine = time.perf_counter() - t0
        P = max(map(len, prompts))
        ids = torch.tensor([[PAD_ID] * (P - len(p)) + p for p in prompts], device=device)
        hf = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=PAD_ID, eos_token_id=None)
        with torch.inference_mode():
            model.generate(ids, attention_mask=(ids != PAD_ID).long(), max_new_tokens=4, min_new_tokens=4, **hf)
            sync()
            t0 = time.perf_counter()
            out = model.generate(
                ids, attention_mask=(ids != PAD_ID).long(), max_new_tokens=new, min_new_tokens=new, **hf
            )
            sync()
            t_hf = time.perf_counter() - t0
        n_hf = int(out[:, P:].numel())
        figures[f"batch {B}"] = {
            "engine tok/s": n_engine / t_engine,
            "HF tok/s": n_hf / t_hf,
            "engine / HF": (n_engine / t_engine) / (n_hf / t_hf),
        }
        print(f"  {name} batch {B}: {figures[f'batch {B}']}", flush=True)
    del model
    allocated = torch.cuda.memory_allocated() if cuda else 0
    released = engine.sleep()
    t0 = time.perf_counter()
    engine.wake()
    sync()
    figures["sleep released GiB"] = released / 2**30
    figures["engine GiB before sleep"] = allocated / 2**30
    figures["wake s"] = time.perf_counter() - t0
    engine.shutdown()
    return figures


def train(name: str, args) -> dict:
    import torch

    path = os.path.join(args.work, name)
    result = os.path.join(args.work, f"train-{name}.json")
    peak = next((v for k, v in PEAK_BF16.items() if k in args.device_name), 0.0)
    batch, new, micro, steps = (8, 8, 4, 2) if args.dry_run else (64, 512, MICRO[name], 3)
    extra = f"--engine-dtype bf16 --train-dtype bf16 --micro-batch {micro} --reward bench/gpu_check.py:varied_reward"
    cmd = [sys.executable, "bench/bench_train.py", "--nprocs", "1", "--algos", "ppo", "grpo", "--steps", str(steps)]
    cmd += ["--skip", "1", "--model", path, "--rollout-batch", str(batch), "--max-new-tokens", str(new), "--lr", "1e-6"]
    cmd += ["--extra", extra, "--peak-tflops", str(peak), "--json", result]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2" if args.dry_run else "8")}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    print(proc.stdout[-4000:], flush=True)
    if proc.returncode:
        raise RuntimeError(
            f"bench_train failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        )
    with open(result) as f:
        rows = json.load(f)
    keep = ("step", "rollout", "recompute", "critic", "policy", "sync", "tok/s", "resp", "k3", "peak GiB", "phase GiB")
    figures = {r["algo"]: {k: r[k] for k in keep} | {"GFLOP/s": r["GFLOP/s"], "MFU %": r["% mach"]} for r in rows}
    return {"peak TFLOP/s": peak or None, "cuda": torch.cuda.is_available(), **figures}


# ----------------------------------------------------------------------------- report


def markdown(results: dict) -> str:
    """One table row per stage: its status, seconds and figures (nested figures flattened as key: value)."""

    def flat(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from flat(v, f"{prefix}{k} ")
            else:
                yield f"{prefix}{k}: {format(v, '.4g') if isinstance(v, float) else v}"

    lines = ["| stage | status | s | figures |", "|---|---|---|---|"]
    for stage, r in results["stages"].items():
        figures = "error: " + r["error"].splitlines()[0] if "error" in r else "; ".join(flat(r.get("figures", {})))
        lines.append(f"| {stage} | {r['status']} | {r['seconds']:.0f} | {figures.replace('|', '/')} |")
    return f"GPU check on {results['device']}{' (dry run)' if results['dry_run'] else ''}\n\n" + "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="every stage with tiny shapes (CPU, about a minute)")
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"), help="report folder (default: $OUT)")
    ap.add_argument("--work", default="/tmp/gpu_check", help="model and run folders (GBs on a GPU; not in --out)")
    ap.add_argument("--deadline", type=float, default=480.0, help="seconds after which no new stage starts")
    ap.add_argument("--models", nargs="+", default=None, help="a subset of the models, in order")
    ap.add_argument("--job-timeout", type=float, default=200.0, help="seconds the main job may run before it is cut")
    args = ap.parse_args()
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device here; on CPU run it with --dry-run")
    known = list(DRY_MODELS if args.dry_run else MODELS)
    models = args.models or known
    if set(models) - set(known):
        sys.exit(f"gpu_check: --models {sorted(set(models) - set(known))} unknown here; choose from {known}")
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.work, exist_ok=True)
    args.device_name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    results = {"device": args.device_name, "dry_run": args.dry_run, "stages": {}}
    stages = [("setup", setup), ("tests", tests), ("main_job", main_job)]
    for m in models:
        stages += [(f"build:{m}", lambda a, m=m: build_model(m, a)), (f"rollout:{m}", lambda a, m=m: rollout(m, a))]
        stages += [(f"train:{m}", lambda a, m=m: train(m, a))]
    start = time.perf_counter()
    for stage, fn in stages:
        if time.perf_counter() - start > args.deadline:
            results["stages"][stage] = {"status": "not run (deadline)", "seconds": 0.0}
            continue
        print(f"== {stage}", flush=True)
        t0 = time.perf_counter()
        try:
            r = {"status": "ok", "figures": fn(args)}
        except Exception as e:  # recorded; the next stage still runs
            r = {"status": "failed", "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"}
            print(r["error"], flush=True)
        r["seconds"] = time.perf_counter() - t0
        results["stages"][stage] = r
        print(json.dumps(r.get("figures", {}), default=str)[:2000], flush=True)
        with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)
        with open(os.path.join(args.out, "gpu_check.md"), "w") as f:
            f.write(markdown(results))
    print(markdown(results))
    sys.exit(1 if any(r["status"] == "failed" for r in results["stages"].values()) else 0)


if __name__ == "__main__":
    main()
