"""How much of the return's variance can a critic explain? A Monte Carlo value ceiling for a model and task.

A critic's explained variance (EV = 1 - Var(R - V) / Var(R), over response tokens, as train_ppo.py logs it)
cannot reach 1: the return R of a sampled response is a coin flip even when V is exact. This script
estimates what is achievable for a policy:

    1. sample one response per prompt (the trajectory whose tokens the critic would see);
    2. for every response position t, sample K continuations from the state before token t
       (prompt + response[:t]) and score them: V*(s_t) = their mean reward, the true value up to MC noise;
    3. perfect ceiling     = EV of V*(s_t) against the trajectory's return R;
       prompt-only ceiling = EV of V*(s_0) (each prompt's own success rate) at every position: what a critic
                             that knows the prompt but reads nothing of the response can reach.

Both are printed overall and per response position (losses.position_buckets), the keys a run logs as
critic/explained_variance and critic/ev_pos_*. The MC noise of V* (variance V(1 - V) / K) lowers both
ceilings slightly; raise --k to shrink it.

A third line says how much of that is already readable from the policy's own features, which is where a
critic initialised from the policy starts: linear probe = EV, on the held-out half of the trajectories, of
a ridge regression of R on the policy's last hidden state (what the value head reads) plus a one-hot
position, fitted on the other half. Near 0 means the critic must learn new features (for addition: check
the sum it has written), not just a head.

    .venv/bin/python bench/value_ceiling.py                         # default tiny addition model
    .venv/bin/python bench/value_ceiling.py --task sort --prompts 128
    .venv/bin/python bench/value_ceiling.py --model outputs/cpu/checkpoints/step_000300/policy
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import losses as L  # noqa: E402
from data.rewards import reward_columns, score  # noqa: E402
from data.tasks import encode_prompt, get_task  # noqa: E402
from rollout import EmbeddedEngine, Sampling  # noqa: E402


def ceilings(values: torch.Tensor, prompt_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """EV of V* and of the prompt-only V*(s_0), overall and per position bucket. All [B, T]."""
    out = {"perfect": L.explained_variance(values, returns, mask).item(),
           "prompt_only": L.explained_variance(prompt_values, returns, mask).item()}
    for name, v in (("perfect", values), ("prompt_only", prompt_values)):
        for key, ev in L.explained_variance_by_position(v, returns, mask).items():
            out[f"{name}/{key.removeprefix('critic/ev_pos_')}"] = ev.item()
    return out


@torch.no_grad()
def linear_probe(model_path: str, ro, pad_id: int, returns: torch.Tensor, mask: torch.Tensor, ridge: float = 1.0) -> torch.Tensor:
    """Ridge regression of the return on [last hidden state, one-hot position] of the policy at each state
    (the value head's input), fitted on the first half of the rows; returns its predictions [B, T] for all rows
    (score the second half only)."""
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    b = ro.to_batch(pad_id)
    P = b.response_start
    h = policy.model(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids).last_hidden_state[:, P - 1 : -1]
    B, T = mask.shape
    x = torch.cat([h, torch.eye(T).expand(B, T, T)], -1).double()  # [B, T, hidden + T]
    fit = mask.clone()
    fit[B // 2 :] = False
    xf, yf = x[fit], returns[fit].double()
    w = torch.linalg.solve(xf.T @ xf + ridge * torch.eye(x.size(-1), dtype=torch.double), xf.T @ yf)
    return (x @ w).float()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="", help="HF model folder; empty = the default tiny model of --task")
    ap.add_argument("--task", default="addition", help="addition, sort, or a .jsonl/.parquet file")
    ap.add_argument("--prompts", type=int, default=256, help="train prompts (trajectories)")
    ap.add_argument("--k", type=int, default=32, help="continuations per state")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="", help="also write the figures as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    task = get_task(args.task)
    model = args.model
    if not model:
        from data.tiny import default_model

        model = default_model(os.path.join(REPO, ".cache"), task=args.task if args.task in ("addition", "sort") else "addition")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    engine = EmbeddedEngine(model, dtype="fp32")  # the trainer's own policy: fp32
    start = time.perf_counter()
    rows = task.train.select(range(min(args.prompts, len(task.train))))
    prompts = [encode_prompt(tok, p) for p in rows["prompt"]]
    budget = task.max_new_tokens
    base = Sampling(args.temperature, max_new_tokens=budget, stop_token_ids=(tok.eos_token_id,), seed=args.seed)
    ro = engine.generate(prompts, base)
    mask = ro.mask
    resp = [t[m].tolist() for t, m in zip(ro.tokens, mask)]
    returns = score(task, tok.batch_decode(resp, skip_special_tokens=True), reward_columns(rows)).rewards[:, None].expand_as(mask).float()

    values = torch.zeros(mask.shape)
    for t in range(mask.size(1)):  # all states at position t share a budget, so one generate call each
        live = [i for i, r in enumerate(resp) if len(r) > t]
        s = Sampling(args.temperature, max_new_tokens=budget - t, stop_token_ids=(tok.eos_token_id,), n=args.k,
                     seed=args.seed + 1_000_003 * (t + 1))
        cont = engine.generate([prompts[i] + resp[i][:t] for i in live], s)
        texts = tok.batch_decode([resp[live[j // args.k]][:t] + c[m].tolist() for j, (c, m) in enumerate(zip(cont.tokens, cont.mask))],
                                 skip_special_tokens=True)
        r = score(task, texts, reward_columns(rows.select(live), args.k)).rewards.view(len(live), args.k).mean(-1)
        values[live, t] = r
    prompt_values = values[:, :1].expand_as(values)
    out = ceilings(values, prompt_values, returns, mask)
    probe = linear_probe(model, ro, tok.pad_token_id, returns, mask)
    half = mask.clone()
    half[: len(half) // 2] = False  # the probe is scored on the trajectories it was not fitted on
    out["probe"] = L.explained_variance(probe, returns, half).item()
    out.update({f"probe/{k.removeprefix('critic/ev_pos_')}": v.item() for k, v in L.explained_variance_by_position(probe, returns, half).items()})
    out.update(model=model, task=task.name, prompts=len(prompts), k=args.k, seconds=round(time.perf_counter() - start, 1),
               mean_return=returns[:, 0].mean().item())
    print(f"Monte Carlo value ceiling: {task.name}, {len(prompts)} prompts x {args.k} continuations per state, "
          f"mean return {out['mean_return']:.3f}, {out['seconds']} s\n  model {model}")
    print(f"  {'':12s} {'overall':>8s} " + " ".join(f"{lab:>6s}" for lab, _, _ in L.position_buckets(mask.size(1))))
    for name in ("perfect", "prompt_only", "probe"):
        print(f"  {name:12s} {out[name]:8.3f} " + " ".join(f"{out[f'{name}/{lab}']:6.3f}" for lab, _, _ in L.position_buckets(mask.size(1))))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
