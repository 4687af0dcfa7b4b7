"""Rollout throughput: EmbeddedEngine vs Hugging Face `model.generate`, same model, prompts and sampling.

    .venv/bin/python bench/bench_rollout.py                        # batch 16, 64, 256; fp32; 1 thread
    .venv/bin/python bench/bench_rollout.py --threads 2 --dtype bf16 --top-p 0.95 --stop --n 8

Model: data.tiny.default_model() (the warmed-up tiny addition model, built on first use); prompts:
the addition task's chat-formatted train prompts. Both sides sample (HF do_sample=True) at the same
temperature / top-p. Without --stop every row runs max_new_tokens (the engine gets no stop tokens,
HF gets min_new_tokens = max_new_tokens); with --stop both stop rows at <|im_end|> and only real
tokens are counted. With --n, a batch is batch / n prompts with n samples each (HF:
num_return_sequences). Each figure is the best of --repeats timed runs after one warm-up run; "cpu" is
process time (robust to other jobs on the machine), "wall" is elapsed time.
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root, run from anywhere
from data.tasks import get_task  # noqa: E402
from data.tiny import EOS_ID, PAD_ID, build_tokenizer, default_model  # noqa: E402
from embedded_engine import EmbeddedEngine  # noqa: E402
from rollout import Sampling  # noqa: E402


def best_time(fn, repeats: int) -> tuple[float, float, int]:
    """(best wall seconds, best cpu seconds, generated tokens) over `repeats` runs after one warm-up."""
    fn()
    walls, cpus = [], []
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        n_tokens = fn()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    return min(walls), min(cpus), n_tokens


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[16, 64, 256], help="batch sizes in rows (prompts x n)")
    ap.add_argument("--n", type=int, default=1, help="samples per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0, help="1.0 = off, the usual RL setting")
    ap.add_argument("--stop", action="store_true", help="stop rows at <|im_end|> (both sides)")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp8"], help="engine precision (HF runs fp32)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for both sides (the machine is shared)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    path = default_model(cache_dir=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache"))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = EmbeddedEngine(model, dtype=args.dtype)
    tok = build_tokenizer()
    train = get_task("addition").train
    stop = (EOS_ID,) if args.stop else ()
    print(
        f"model {path}\nthreads {args.threads}, engine {args.dtype}, max_new_tokens {args.max_new_tokens}, "
        f"temperature {args.temperature}, top_p {args.top_p}, n {args.n}, stop at <|im_end|>: {args.stop}"
    )
    print(
        f"{'batch':>6} {'engine tok/s cpu':>17} {'wall':>8} {'HF tok/s cpu':>13} {'wall':>8} {'ratio cpu':>10} {'wall':>6}"
    )
    for B in args.batch:
        texts = [
            tok.apply_chat_template(
                [{"role": "user", "content": train[i % len(train)]["prompt"]}],
                add_generation_prompt=True,
                tokenize=False,
            )
            for i in range(B // args.n)
        ]
        prompts = [tok(t, add_special_tokens=False).input_ids for t in texts]
        sampling = Sampling(
            temperature=args.temperature,
            top_p=args.top_p,
            max_new_tokens=args.max_new_tokens,
            stop_token_ids=stop,
            n=args.n,
        )
        seeds = iter(range(10**6))

        def run_engine() -> int:
            return int(engine.generate(prompts, Sampling(**{**vars(sampling), "seed": next(seeds)})).mask.sum())

        # HF: left-padded batch with an attention mask, the standard batched-generate setup.
        P = max(len(p) for p in prompts)
        ids = torch.tensor([[PAD_ID] * (P - len(p)) + p for p in prompts])
        attn = (ids != PAD_ID).long()
        hf_kwargs = dict(
            do_sample=True,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=0,
            num_return_sequences=args.n,
            max_new_tokens=args.max_new_tokens,
            pad_token_id=PAD_ID,
            eos_token_id=EOS_ID,
        )
        if not args.stop:
            hf_kwargs["min_new_tokens"] = args.max_new_tokens  # no row ends early: same token count as the engine

        @torch.inference_mode()
        def run_hf() -> int:
            out = model.generate(ids, attention_mask=attn, **hf_kwargs)[:, P:]
            # Real tokens: everything up to and including the first <|im_end|> (HF pads after it).
            after_eos = (out == EOS_ID).long().cumsum(-1) - (out == EOS_ID).long()
            return int((after_eos == 0).sum())

        e_wall, e_cpu, e_n = best_time(run_engine, args.repeats)
        h_wall, h_cpu, h_n = best_time(run_hf, args.repeats)
        print(
            f"{B:>6} {e_n / e_cpu:>17.0f} {e_n / e_wall:>8.0f} {h_n / h_cpu:>13.0f} {h_n / h_wall:>8.0f} "
            f"{(e_n / e_cpu) / (h_n / h_cpu):>9.2f}x {(e_n / e_wall) / (h_n / h_wall):>5.2f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
