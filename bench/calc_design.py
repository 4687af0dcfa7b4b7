"""Calibration of `--task calc`'s warm-up (data/calc.py): does a tiny model that imitates calculator demonstrations
learn to call the tool and copy correctly? Prints, on 128 (or --rows) held-out rows, the share of sampled episodes
that call the calculator, sampled success, success given a call, and greedy success and call share.

    .venv/bin/python bench/calc_design.py --model .cache/tiny-calc-seed0-<key>           # evaluate a built model
    .venv/bin/python bench/calc_design.py --p-tool 0.5 --steps 600 --every 100           # a warm-up from a random init
    .venv/bin/python bench/calc_design.py --p-tool 0.5 --steps 600 --init addition       # ... from the addition model

A warm-up here is data/tiny.py's (the same SFT batch, lr 3e-3 with 30 warm-up steps, clipping at 1, batch 64) on
8,000 demonstrations played by the driver, 2 torch threads.
"""

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F
import transformers

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import agent  # noqa: E402
import data.calc as calc  # noqa: E402
import tools  # noqa: E402
from data.tasks import calc_task  # noqa: E402
from data.tiny import GRAD_CLIP, LR_WARMUP_STEPS, _sft_batch, build_tiny_model, default_model, demo_engine, demo_pool  # noqa: E402
from rollout import EmbeddedEngine, Sampling  # noqa: E402


def evaluate(model, tok, env, rows) -> dict:
    engine = EmbeddedEngine(model, dtype="fp32")
    stops = tools.stop_ids(tok, env)
    out = {}
    for kind, s in (("sampled", Sampling(max_new_tokens=96, seed=3, stop_token_ids=stops)),
                    ("greedy", Sampling(top_k=1, max_new_tokens=96, stop_token_ids=stops))):
        ep = agent.run_episodes(engine, tok, env, rows, s, max_turns=calc.MAX_TURNS, context_len=256)
        used = [i for i, st in enumerate(ep.tool_stats) if st["calls"]]
        out.update({f"{kind}_calls": len(used) / len(rows), f"{kind}_success": ep.returns.mean().item(),
                    f"{kind}_success_given_call": sum(ep.returns[i].item() for i in used) / max(1, len(used))})
    return {k: round(v, 3) for k, v in out.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="", help="evaluate this model folder and stop")
    ap.add_argument("--p-tool", type=float, default=calc.P_TOOL)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--init", choices=["random", "addition"], default="random")
    ap.add_argument("--rows", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(2)
    task = calc_task()
    env = tools.tool_env(task.env, max_turns=task.max_turns, task=task)
    rows = task.train.to_list()
    val = rows[: args.rows]  # data/tiny.py's validation slice: never trained on
    if args.model:
        tok = transformers.AutoTokenizer.from_pretrained(args.model)
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
        print(evaluate(model, tok, env, val))
        return
    path = default_model(task="addition") if args.init == "addition" else build_tiny_model(f"/tmp/calc_design_{os.getpid()}", seed=0)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    t0 = time.time()
    move = lambda text, rng: calc.demo_move(text, rng, p_tool=args.p_tool)  # noqa: E731
    ep = agent.run_episodes(demo_engine(tok, move=move), tok, env, rows[256 : 256 + 8000], Sampling(max_new_tokens=96, seed=0),
                            max_turns=calc.MAX_TURNS, context_len=256)
    pool = demo_pool(ep.rollout)
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / LR_WARMUP_STEPS))
    order = torch.empty(0, dtype=torch.long)
    model.train()
    for step in range(1, args.steps + 1):
        if len(order) < 64:
            order = torch.randperm(len(pool), generator=gen)
        batch, order = order[:64], order[64:]
        ids, trained = _sft_batch(tok, [pool[i] for i in batch])
        loss = F.cross_entropy(model(input_ids=ids).logits[:, :-1][trained], ids[:, 1:][trained])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        opt.step()
        sched.step()
        if step % args.every == 0 or step == args.steps:
            model.eval()
            print(f"step {step}: loss {loss.item():.3f} {evaluate(model, tok, env, val)} ({time.time() - t0:.0f} s)", flush=True)
            model.train()


if __name__ == "__main__":
    main()
