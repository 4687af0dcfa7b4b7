"""Peak memory of one policy step (forward, loss over the response tokens, backward) against prompt and response length,
with the trainer's response-only log-probs (forward.response_logprobs: the LM head on the response columns only, a
chunk at a time, checkpointed) and with the plain path it replaced (the model's logits at every position, then sliced).

    .venv/bin/python bench/bench_memory.py                      # vocabulary 151,936 (Qwen's), hidden 128, 2 layers, 1 row
    .venv/bin/python bench/bench_memory.py --prompts 256 4096 --responses 32 --rows 2

The model is built from a synthetic Qwen3 config (random weights: memory does not depend on them). Each measurement runs
in a fresh process: on CUDA it reports torch.cuda.max_memory_allocated during the step, on CPU the rise of the process's
peak resident set (ru_maxrss) over what it held before the step, so the model itself is not counted; and the step's
wall time (one step: a first call, so a rough figure).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def one(path: str, P: int, T: int, rows: int, vocab: int) -> tuple[float, float]:
    """(GiB of the step's peak above the memory held before it, seconds of the step)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    import logprobs
    from rollout import TrainBatch
    from forward import Forward, response_logprobs

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    mc = Qwen3Config(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=P + T,
        tie_word_embeddings=True,
    )
    model = Qwen3ForCausalLM(mc).to(device)
    ids = torch.randint(0, vocab, (rows, P + T), device=device)
    b = TrainBatch(
        ids,
        torch.ones_like(ids),
        torch.arange(P + T, device=device).expand(rows, -1),
        P,
        torch.arange(P - 1, P + T - 1, device=device),
    )
    tokens, all_rows = ids[:, P:], torch.arange(rows)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    if path == "full-logits":
        logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids).logits[
            :, P - 1 : -1
        ]
        logp = logprobs.token_logprobs(logits, tokens)
    else:
        logp = response_logprobs(model, b, all_rows, tokens, Forward())[0]
    (-logp.mean()).backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - before) / 2**30, time.perf_counter() - t0
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before) / 2**30, time.perf_counter() - t0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--prompts", type=int, nargs="+", default=[256, 1024, 4096], help="prompt lengths (response length 32)"
    )
    p.add_argument(
        "--responses", type=int, nargs="+", default=[32, 256, 1024], help="response lengths (prompt length 256)"
    )
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument(
        "--one", nargs=3, metavar=("PATH", "P", "T"), help=argparse.SUPPRESS
    )  # a child process: one measurement
    args = p.parse_args()
    if args.one:
        print(json.dumps(one(args.one[0], int(args.one[1]), int(args.one[2]), args.rows, args.vocab)))
        return
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    print(
        f"peak GiB of one policy step above the resident model; vocabulary {args.vocab}, {args.rows} row(s), "
        f"{'cuda' if torch.cuda.is_available() else 'cpu (ru_maxrss)'}"
    )
    print(
        f"{'prompt':>7} {'response':>8} {'full logits GiB':>16} {'response-only GiB':>18} {'full logits s':>14} {'response-only s':>16}"
    )
    for P, T in [(P, 32) for P in args.prompts] + [
        (256, T) for T in args.responses if T != 32 or 256 not in args.prompts
    ]:
        gib = []
        for path in ("full-logits", "response-only"):
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--one",
                    path,
                    str(P),
                    str(T),
                    "--rows",
                    str(args.rows),
                    "--vocab",
                    str(args.vocab),
                ],
                capture_output=True,
                text=True,
                env=env,
            )
            gib.append(
                json.loads(out.stdout.strip().splitlines()[-1])
                if out.returncode == 0
                else (f"failed ({out.returncode})",) * 2
            )

        def cell(x, spec):
            return format(x, spec) if isinstance(x, float) else x

        print(
            f"{P:>7} {T:>8} {cell(gib[0][0], '.3f'):>16} {cell(gib[1][0], '.3f'):>18} {cell(gib[0][1], '.2f'):>14} {cell(gib[1][1], '.2f'):>16}",
            flush=True,
        )


if __name__ == "__main__":
    main()
