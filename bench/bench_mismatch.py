"""Train-inference mismatch of each rollout precision knob: the embedded engine against the fp32 trainer.

    .venv/bin/python bench/bench_mismatch.py                     # default tiny model, addition, 256 prompts
    .venv/bin/python bench/bench_mismatch.py --task sort --prompts 256 --models .cache/tiny-addition-... other/
    .venv/bin/python bench/bench_mismatch.py --tiny moe --prompts 1024    # the tiny MoE: also router flips
    .venv/bin/python bench/bench_mismatch.py --tiny moe --moe-flip 0.01 0.05 0.2   # + the lab's expert-flip knob

For each model folder and knob (engine dtype + KV-cache dtype) the engine samples one response per prompt
(train prompts of the task, chat formatted, temperature 1 and the <|im_end|> stop, as train_ppo.py samples),
and the HF model in fp32 recomputes the log-probs of the same tokens as train_ppo.py does
(Rollout.to_batch, logprobs.token_logprobs). Per response token, with k = pi_train / pi_infer of the token:

    k3         mean of k - 1 - log k (losses.mismatch_metrics): an estimate of KL(pi_infer || pi_train)
    KL         the exact KL(pi_infer || pi_train) of the full next-token distributions at the same
               positions (the engine's from EmbeddedEngine.logits over prompt + response, no cache)
    out [0.5,2] tokens whose k leaves IcePop's band (what it masks), per mille
    max|log k|
    ESS        the effective sample size of the tokens' k, (sum k)^2 / (n sum k^2) (losses.mismatch_metrics)
    flips      MoE models: router choices (token x layer) whose expert set differs between engine and trainer, and
               tokens with a differing set in any layer, in percent (moe.flip_metrics)

--moe-flip q (MoE models) adds an fp32 engine whose k-th expert is swapped for the (k+1)-th best with probability q
per token and layer (train_ppo.py --moe-flip, a lab knob): a discrete, heavy-tailed mismatch.

The fp32 row is the control (same pipeline, no precision change). One thread; the default run takes
under a minute on 2 shared cores, most of it in the bf16-compute knobs (bf16 matmuls are slow on CPUs
without AVX512-BF16). 256 prompts give about 1,300 addition tokens, so one token is 0.8 per mille: use
--prompts 1024 or more for steadier per-mille figures.
"""

import argparse
import os
import random
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # run from anywhere
import logprobs  # noqa: E402
import losses  # noqa: E402
import moe  # noqa: E402
from data.tasks import encode_prompt, get_task  # noqa: E402
from data.tiny import default_model  # noqa: E402
from embedded_engine import EmbeddedEngine  # noqa: E402
from rollout import Rollout, Sampling  # noqa: E402

KNOBS = [("fp32", "auto"), ("bf16", "auto"), ("fp8", "auto"), ("int4", "auto"), ("bf16", "fp8"), ("int4", "fp8")]
ROWS = 256  # rows per forward pass


def train_logits(model, ro: Rollout, pad_id: int):
    """The trainer's fp32 logits [B, T, V] predicting each response token (train_ppo.py's layout), and for an MoE the
    experts its routers chose at those columns [B, T, layers, k] (None for a dense model)."""
    b = ro.to_batch(pad_id)
    P, T = b.response_start, ro.tokens.size(1)
    logits, routes = [], []
    with torch.no_grad():
        for i in range(0, len(ro.tokens), ROWS):
            rows = slice(i, i + ROWS)
            logits.append(
                model(
                    input_ids=b.input_ids[rows],
                    attention_mask=b.attention_mask[rows],
                    position_ids=b.position_ids[rows],
                ).logits[:, P - 1 : -1]
            )
            if ro.routing is not None:
                routes.append(moe.chosen(model).view(len(logits[-1]), P + T, *ro.routing.shape[2:])[:, P - 1 : -1])
    return torch.cat(logits), torch.cat(routes) if routes else None


def engine_logits(engine: EmbeddedEngine, ro: Rollout) -> torch.Tensor:
    """The engine's logits [B, T, V] predicting each response token, from full unpadded forwards. Rows are
    grouped by prompt length; the padding after a response cannot reach earlier positions (causal)."""
    B, T = ro.tokens.shape
    out = torch.zeros(B, T, engine.vocab_size)
    lengths = torch.tensor([len(p) for p in ro.prompt_ids])
    for L in lengths.unique().tolist():
        rows = (lengths == L).nonzero()[:, 0]
        for chunk in rows.split(ROWS):
            ids = torch.cat([torch.tensor([ro.prompt_ids[r] for r in chunk.tolist()]), ro.tokens[chunk]], dim=1)
            out[chunk] = engine.logits(ids)[:, L - 1 : -1]
    return out


def measure(
    model, dtype: str, kv: str, prompts: list[list[int]], sampling: Sampling, pad_id: int, flip: float = 0.0
) -> dict:
    engine = EmbeddedEngine(model, dtype=dtype, kv_cache_dtype=kv, moe_flip=flip)
    ro = engine.generate(prompts, sampling)
    train, own = train_logits(model, ro, pad_id)
    train_logp = logprobs.token_logprobs(train, ro.tokens)
    m = losses.mismatch_metrics(train_logp, ro.infer_logp, ro.mask)
    if own is not None:  # MoE: the engine's experts at the same columns, over the sampled tokens
        P = ro.routing.size(1) - ro.tokens.size(1)
        engine_routes = ro.routing[:, P - 1 : -1]
        valid = ro.mask & (engine_routes >= 0).all(-1).all(-1)
        m |= moe.flip_metrics(engine_routes[valid], own[valid])
    p, q = engine_logits(engine, ro).log_softmax(-1), train.log_softmax(-1)
    kl = (p.exp() * (p - q)).sum(-1)[ro.mask]
    return {
        "k3": m["mismatch/k3"].item(),
        "kl": kl.mean().item(),
        "out": 1000 * m["mismatch/masked_frac"].item(),
        "max": m["mismatch/abs_diff_max"].item(),
        "ess": m["mismatch/ess"].item(),
        "tokens": int(ro.mask.sum()),
        "flips": 100 * float(m.get("moe/flip_frac", float("nan"))),
        "any": 100 * float(m.get("moe/flip_any_layer_frac", float("nan"))),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", help="HF model folders (default: the embedded default tiny model)")
    ap.add_argument("--task", default="addition", choices=["addition", "sort"])
    ap.add_argument("--prompts", type=int, default=256, help="train prompts sampled per knob (one response each)")
    ap.add_argument("--seed", type=int, default=0, help="picks the prompts and seeds the sampling")
    ap.add_argument(
        "--tiny", default="dense", choices=["dense", "moe"], help="the default model's architecture (without --models)"
    )
    ap.add_argument(
        "--moe-flip", type=float, nargs="*", default=[], help="MoE models: also these expert-flip rates (fp32 engine)"
    )
    args = ap.parse_args()
    torch.set_num_threads(1)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    task = get_task(args.task)
    idx = random.Random(args.seed).sample(range(len(task.train)), args.prompts)
    texts = task.train.select(idx)["prompt"]
    for path in args.models or [default_model(os.path.join(REPO, ".cache"), task=args.task, arch=args.tiny)]:
        tok = AutoTokenizer.from_pretrained(path)
        model = moe.install(
            AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        )  # MoE: routers record
        prompts = [encode_prompt(tok, t) for t in texts]
        sampling = Sampling(
            temperature=1.0, max_new_tokens=task.max_new_tokens, stop_token_ids=(tok.eos_token_id,), seed=args.seed
        )
        print(f"model {path}\ntask {args.task}, {args.prompts} prompts, seed {args.seed}; per response token:")
        print(
            f"{'engine':<15} {'kv cache':<9} {'k3':>9} {'exact KL':>9} {'out [0.5,2]':>12} {'max|log k|':>11} {'ESS':>7} "
            f"{'tokens':>7} {'s':>5} {'flips %':>8} {'any layer %':>12}"
        )
        flips = [("fp32", "auto", q) for q in args.moe_flip] if moe.is_moe(model.config) else []
        for dtype, kv, q in [(d, k, 0.0) for d, k in KNOBS] + flips:
            t0 = time.perf_counter()
            r = measure(model, dtype, kv, prompts, sampling, tok.pad_token_id, q)
            print(
                f"{dtype + (f' flip {q:g}' if q else ''):<15} {kv:<9} {r['k3']:>9.2e} {r['kl']:>9.2e} {r['out']:>10.2f}\u2030 {r['max']:>11.3f} "
                f"{r['ess']:>7.4f} {r['tokens']:>7} {time.perf_counter() - t0:>5.1f} {r['flips']:>8.2f} {r['any']:>12.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
