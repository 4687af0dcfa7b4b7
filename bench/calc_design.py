"""Calibration of `--task calc`'s warm-up (data/calc.py): does a tiny model that imitates calculator demonstrations
learn to call the tool and copy correctly? Prints, on 128 (or --rows) held-out rows, the share of sampled episodes
that call the calculator, sampled success, success given a call, and greedy success and call share.

    .venv/bin/python bench/calc_design.py --model .cache/tiny-calc-seed0-<key>           # evaluate a built model
    .venv/bin/python bench/calc_design.py --p-tool 0.5 --steps 600 --every 100           # a warm-up from a random init
    .venv/bin/python bench/calc_design.py --p-tool 0.5 --steps 600 --init addition       # ... from the addition model

    .venv/bin/python bench/calc_design.py --init addition --p-tool 1 --steps 1000 --every 250 --lr 1e-3 --batch 32 --save A
    .venv/bin/python bench/calc_design.py --init A --p-tool 0.3 --steps 200 --every 50 --lr 2e-4 --batch 32   # the default's 2nd phase

A warm-up here is data/tiny.py's sft (lr --lr with 30 warm-up steps, clipping at 1, batch --batch) on 8,000
demonstrations played by the driver (data/tiny.py's calc_pool), --threads torch threads.
"""

import argparse
import os
import sys
import time

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import data.calc as calc  # noqa: E402
from data.tasks import calc_task  # noqa: E402
from data.tiny import build_tiny_model, calc_pool, calc_stats, default_model, sft  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="", help="evaluate this model folder and stop")
    ap.add_argument("--p-tool", type=float, default=calc.P_TOOL)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--init", default="random", help="random, addition (the default addition model) or a model folder")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--save", default="", help="save the fitted model to this folder")
    ap.add_argument("--rows", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = calc_task().train.to_list()
    val = rows[: args.rows]  # data/tiny.py's validation slice: never trained on
    if args.model:
        tok = transformers.AutoTokenizer.from_pretrained(args.model)
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
        print(calc_stats(model, tok, val))
        return
    if args.init == "addition":
        path = default_model(task="addition")
    elif args.init == "random":
        path = build_tiny_model(f"/tmp/calc_design_{os.getpid()}", seed=0)
    else:
        path = args.init
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    t0 = time.time()
    pool = calc_pool(tok, rows[256 : 256 + 8000], args.p_tool)

    def report(step, loss):
        return print(
            f"step {step}: loss {loss:.3f} {calc_stats(model, tok, val)} ({time.time() - t0:.0f} s)", flush=True
        )

    sft(model, tok, pool, args.steps, args.lr, args.batch, every=args.every, report=report)
    if args.save:
        model.save_pretrained(args.save)
        tok.save_pretrained(args.save)


if __name__ == "__main__":
    main()
