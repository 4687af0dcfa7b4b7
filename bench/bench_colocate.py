"""Rollout tokens/s of the SGLang engine alone, and colocated with the trainer as train_ppo.py runs it: policy and
critic in fp32 with their AdamW states resident on the same device, the engine given SGLANG_GPU_MEM_FRACTION of it and
put through one sleep / wake / weight-sync cycle first. The same prompts and sampling for both.

    python bench/bench_colocate.py --model /path/to/Qwen3-0.6B              # one GPU, SGLang (CUDA build) installed
    .venv-sglang/bin/python bench/bench_colocate.py --prompts 16 --n 2      # SGLang's CPU mode, the tiny model: a smoke run

Each measurement runs in its own process (an SGLang engine per process), after one warm-up call. On CPU the fraction
reserves nothing and sleep frees nothing, so only a GPU shows what colocation costs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one(mode: str, args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from data.tasks import encode_prompt, get_task
    from data.tiny import default_model
    from build import SGLANG_GPU_MEM_FRACTION
    from rollout import Sampling, push_weights
    from sglang_engine import SGLangEngine
    from value_model import build_critic

    path = args.model or default_model(os.path.join(REPO, ".cache"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [encode_prompt(tok, p) for p in get_task("addition").train["prompt"][: args.prompts]]
    s = Sampling(
        temperature=1.0, max_new_tokens=args.max_new_tokens, n=args.n, stop_token_ids=(tok.eos_token_id,), seed=0
    )
    resident = 0
    if mode == "colocated":
        models = [
            AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device),
            build_critic(path, dtype=torch.float32).to(device),
        ]
        for m in models:  # one AdamW step each, so the optimiser states exist as in training
            opt = torch.optim.AdamW(m.parameters(), lr=1e-12)
            ids = torch.tensor([prompts[0]], device=device)
            m(input_ids=ids).logits.float().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        resident = torch.cuda.memory_allocated(device) / 2**30 if cuda else float("nan")
    gpu = (
        {
            "base_gpu_id": 0,
            "mem_fraction_static": SGLANG_GPU_MEM_FRACTION if mode == "colocated" else args.alone_fraction,
        }
        if cuda
        else {}
    )
    engine = SGLangEngine(path, dtype=args.dtype, **gpu)
    if mode == "colocated":  # the loop's cycle: sleep for training, wake, weights pushed from the trainer
        engine.sleep()
        engine.wake()
        push_weights(models[0], engine)
    engine.generate(prompts[:4], s)  # warm-up
    t0 = time.perf_counter()
    ro = engine.generate(prompts, s)
    dt = time.perf_counter() - t0
    engine.shutdown()
    return {
        "mode": mode,
        "tokens": int(ro.mask.sum()),
        "s": dt,
        "tok/s": float(ro.mask.sum()) / dt,
        "trainer GiB": resident,
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="HF model folder (default: the tiny model)")
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--alone-fraction", type=float, default=0.85, help="SGLang's share of the GPU when alone")
    p.add_argument("--one", help=argparse.SUPPRESS)  # a child process: one measurement
    args = p.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args)))
        return
    rows = []
    for mode in ("alone", "colocated"):
        cmd = [sys.executable, __file__, "--one", mode, *sys.argv[1:]]
        out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if out.returncode:
            sys.exit(f"{mode} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        r = rows[-1]
        print(
            f"{mode:<10} {r['tokens']:>7} tokens in {r['s']:.2f} s = {r['tok/s']:,.0f} tok/s (trainer resident: {r['trainer GiB']:.2f} GiB)",
            flush=True,
        )
    print(f"colocated / alone: {rows[1]['tok/s'] / rows[0]['tok/s']:.2f}x")


if __name__ == "__main__":
    main()
