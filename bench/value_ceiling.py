"""How much of the return's variance can a critic explain? A Monte Carlo value ceiling for a model and task.

A critic's explained variance (EV = 1 - Var(R - V) / Var(R), over response tokens, as train_ppo.py logs it)
cannot reach 1: the return R of a sampled response is a coin flip even when V is exact. This script
estimates what is achievable for a policy, with the Monte Carlo values of --algo vine (vine.mc_values):

    1. sample one response (episode) per prompt (the trajectory whose tokens the critic would see);
    2. from the states of each trajectory sample K continuations: V*(s) = the mean return of those that pass through
       s, the true value up to MC noise. States: single-turn, every response position (the state before token t,
       prompt + response[:t]); multi-turn (--task guess, --env), the start of each model turn, each continuation
       playing the rest of the episode on a reseeded copy of the environment; a token inside a turn gets its turn's
       start value. Values and returns are whole-episode returns (the rewards before the state included), what
       bench/value_fit.py regresses;
    3. perfect ceiling     = EV of V*(s_t) against the trajectory's return R;
       prompt-only ceiling = EV of V*(s_0) (each prompt's own success rate) at every position: what a critic
                             that knows the prompt but reads nothing of the response can reach.

Both are printed overall and per response position (losses.position_buckets), the keys a run logs as
critic/explained_variance and critic/ev_pos_*. The MC noise of V* (variance V(1 - V) / K) lowers both
ceilings slightly; raise --k to shrink it.

The headroom bound: how much a perfect critic could cut the policy gradient's variance against a per-prompt baseline,

    ratio_t  = Var_t(R - V*) / Var_t(R - V_prompt) = (1 - EV*_t) / (1 - EV_prompt,t),   headroom = 1 / mean_t ratio_t,

with both variances (EVs) over the rows alive at response position t, and the mean over the positions where
Var_t(R - V_prompt) > 0. Per position, not pooled: a pooled EV_prompt over all tokens over-weights long
episodes and can go negative. Printed as "headroom 1/x" (e.g. 1/3.2: a perfect critic leaves 31% of the
variance); returned as headroom = x and headroom_ratio = the mean ratio.

A last line says how much of that is already readable from the policy's own features, which is where a
critic initialised from the policy starts: linear probe = EV, on the held-out half of the trajectories, of
a ridge regression of R on the policy's last hidden state (what the value head reads) plus a one-hot
position, fitted on the other half. Near 0 means the critic must learn new features (for addition: check
the sum it has written), not just a head.

    .venv/bin/python bench/value_ceiling.py                         # default tiny addition model
    .venv/bin/python bench/value_ceiling.py --task sort --prompts 128
    .venv/bin/python bench/value_ceiling.py --task guess --k 8      # multi-turn: states at the turn starts
    .venv/bin/python bench/value_ceiling.py --model outputs/cpu/checkpoints/step_000300/policy
    .venv/bin/python bench/value_ceiling.py --model .cache/smollm2-135m-instruct --reward math --temperature 0.5 \
        --max-new-tokens 24 --task "rg:chain_sum:min_terms=2,max_terms=2,max_digits=1,train=100,suffix=Answer with \
the number only." --prompts 64 --k 8 --every 2                             # SmolLM2's preset task (runs/cpu_smollm2.sh)

    from value_ceiling import measure                              # bench/ on sys.path
    out = measure(task="addition", prompts=64, k=8)                 # the figures as a dict (the --out JSON)
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
from agent import DEFAULT_MAX_TURNS  # noqa: E402
from data.rewards import load_reward, reward_columns, score  # noqa: E402
from data.tasks import encode_prompt, get_task  # noqa: E402
from embedded_engine import EmbeddedEngine  # noqa: E402
from rollout import Sampling  # noqa: E402


def ceilings(
    values: torch.Tensor, prompt_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """EV of V* and of the prompt-only V*(s_0), overall and per position bucket. All [B, T]."""
    out = {
        "perfect": L.explained_variance(values, returns, mask).item(),
        "prompt_only": L.explained_variance(prompt_values, returns, mask).item(),
    }
    for name, v in (("perfect", values), ("prompt_only", prompt_values)):
        for key, ev in L.explained_variance_by_position(v, returns, mask).items():
            out[f"{name}/{key.removeprefix('critic/ev_pos_')}"] = ev.item()
    return out


@torch.no_grad()
def linear_probe(
    model_path: str, ro, pad_id: int, returns: torch.Tensor, mask: torch.Tensor, ridge: float = 1.0
) -> torch.Tensor:
    """Ridge regression of the return on [last hidden state, one-hot position] of the policy at each state
    (the value head's input), fitted on the first half of the rows; returns its predictions [B, T] for all rows
    (score the second half only)."""
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    b = ro.to_batch(pad_id)
    P = b.response_start
    h = policy.model(
        input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids
    ).last_hidden_state[:, P - 1 : -1]
    B, T = mask.shape
    x = torch.cat([h, torch.eye(T).expand(B, T, T)], -1).double()  # [B, T, hidden + T]
    fit = mask.clone()
    fit[B // 2 :] = False
    xf, yf = x[fit], returns[fit].double()
    w = torch.linalg.solve(xf.T @ xf + ridge * torch.eye(x.size(-1), dtype=torch.double), xf.T @ yf)
    return (x @ w).float()


def headroom(
    values: torch.Tensor, prompt_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Per response position t, Var_t(R - V*) / Var_t(R - V_prompt) over the rows alive at t (mask[:, t]); NaN where
    the denominator is 0 or fewer than 2 rows are alive. All [B, T]; returns [T]."""
    out = torch.full((mask.size(1),), float("nan"))
    for t in range(mask.size(1)):
        alive = mask[:, t]
        if alive.sum() >= 2:
            num, den = ((returns - values)[alive, t]).var(), ((returns - prompt_values)[alive, t]).var()
            out[t] = num / den if den > 0 else float("nan")
    return out


def measure(
    model: str = "",
    task: str = "addition",
    prompts: int = 256,
    k: int = 32,
    temperature: float = 1.0,
    seed: int = 0,
    env: str = "",
    max_turns: int = 0,
    reward: str = "",
    max_new_tokens: int = 0,
    every: int = 1,
) -> dict:
    """The ceilings, the headroom bound and the probe of `model` (empty: the task's default tiny model) on the first
    `prompts` train rows of `task` (or of an --env played on them), as a flat dict: perfect, prompt_only, probe and
    their "<name>/<bucket>" figures, headroom, headroom_ratio, headroom_ratio/<bucket>, states, and the run's sizes.
    reward: as train_ppo.py's --reward ('' = the task's own); max_new_tokens: the response budget (0 = the task's);
    every: single-turn states every `every` response tokens, the tokens between taking the last state's value (a
    stale V*, so every > 1 gives lower bounds of the perfect ceiling and of the headroom, at 1/every of the cost)."""
    from agent import load_env, run_episodes
    from vine import mc_values, token_values

    t_ = get_task(task, reward_fn=load_reward(reward) if reward else None)
    if env:
        t_.env, t_.max_turns = load_env(env), DEFAULT_MAX_TURNS
    if not model:
        from data.tiny import default_model

        model = default_model(
            os.path.join(REPO, ".cache"), task=task if task in ("addition", "sort", "guess", "walk") else "addition"
        )
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    tok.pad_token = tok.pad_token or tok.eos_token
    engine = EmbeddedEngine(model, dtype="fp32")  # the trainer's own policy: fp32
    start = time.perf_counter()
    rows = t_.train.select(range(min(prompts, len(t_.train))))
    s = Sampling(
        temperature, max_new_tokens=max_new_tokens or t_.max_new_tokens, stop_token_ids=(tok.eos_token_id,), seed=seed
    )
    play = None
    if t_.env is not None:

        def play(eng, r, s_, **kw):
            return run_episodes(
                eng,
                tok,
                t_.env,
                r,
                s_,
                max_turns=max_turns or t_.max_turns,
                context_len=engine.max_positions,
                timeout=t_.user_timeout,
                **kw,
            )

        out = play(engine, rows.to_list(), s, snapshots=True)
        ro, ok = out.rollout, torch.ones(len(out.rollout.mask), dtype=torch.bool)
        R, rewards = out.returns[out.episode].float(), out.rewards
    else:
        out = ro = engine.generate([encode_prompt(tok, p) for p in rows["prompt"]], s)
        texts = tok.batch_decode([t[m].tolist() for t, m in zip(ro.tokens, ro.mask)], skip_special_tokens=True)
        sc = score(t_, texts, reward_columns(rows))
        R, ok = sc.rewards.float(), sc.rewarded
        rewards = L.last_token_rewards(R, ro.mask)
    v = mc_values(engine, tok, t_, rows, out, s, k=k, every=every, play=play)
    values, has = token_values(v, ro.mask)
    mask = has & ok[:, None]  # a row without a reward (or a token before its first valued state) is out
    returns = R[:, None].expand_as(mask).clone()
    # Whole-episode values: the value to go plus the rewards before the token (0 for a single-turn task).
    values = values + (rewards * ro.mask).cumsum(-1) - rewards * ro.mask
    prompt_values = values[:, :1].expand_as(values)
    out_ = ceilings(values, prompt_values, returns, mask)
    ratio = headroom(values, prompt_values, returns, mask)
    mean_ratio = ratio.nanmean().item()
    out_.update(headroom=1 / mean_ratio, headroom_ratio=mean_ratio)
    out_.update(
        {f"headroom_ratio/{lab}": ratio[lo:hi].nanmean().item() for lab, lo, hi in L.position_buckets(mask.size(1))}
    )
    probe = linear_probe(model, ro, tok.pad_token_id, returns, mask)
    half = mask.clone()
    half[: len(half) // 2] = False  # the probe is scored on the trajectories it was not fitted on
    out_["probe"] = L.explained_variance(probe, returns, half).item()
    out_.update(
        {
            f"probe/{q.removeprefix('critic/ev_pos_')}": x.item()
            for q, x in L.explained_variance_by_position(probe, returns, half).items()
        }
    )
    out_.update(
        model=model,
        task=t_.name,
        prompts=len(rows),
        k=k,
        seconds=round(time.perf_counter() - start, 1),
        mean_return=R[ok].mean().item(),
        states="turn starts" if play else "every response token" if every == 1 else f"every {every} response tokens",
        extra_tokens=v.extra_tokens,
    )
    return out_


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="", help="HF model folder; empty = the default tiny model of --task")
    ap.add_argument("--task", default="addition", help="addition, sort, guess, or a .jsonl/.parquet file")
    ap.add_argument(
        "--env", default="", help="a multi-turn environment played on --task's rows (as train_ppo.py's --env)"
    )
    ap.add_argument("--max-turns", type=int, default=0, help="multi-turn: turns per episode; 0 = the task's")
    ap.add_argument("--prompts", type=int, default=256, help="train prompts (trajectories)")
    ap.add_argument("--k", type=int, default=32, help="continuations per state")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--reward", default="", help="as train_ppo.py's --reward: '' (the task's), 'math', 'file.py:fn'")
    ap.add_argument("--max-new-tokens", type=int, default=0, help="response budget; 0 = the task's")
    ap.add_argument(
        "--every", type=int, default=1, help="single-turn: a state every N tokens (N > 1: lower bounds, 1/N the cost)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="", help="also write the figures as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.max_new_tokens < 0 or args.every < 1:
        ap.error("--max-new-tokens must be >= 0 and --every >= 1")
    out = measure(
        args.model,
        args.task,
        args.prompts,
        args.k,
        args.temperature,
        args.seed,
        args.env,
        args.max_turns,
        args.reward,
        args.max_new_tokens,
        args.every,
    )
    print(
        f"Monte Carlo value ceiling: {out['task']}, {out['prompts']} prompts x {out['k']} continuations per state "
        f"({out['states']}), mean return {out['mean_return']:.3f}, {out['seconds']} s\n  model {out['model']}"
    )
    buckets = [key.removeprefix("perfect/") for key in out if key.startswith("perfect/")]
    print(f"  {'':12s} {'overall':>8s} " + " ".join(f"{lab:>6s}" for lab in buckets))
    for name in ("perfect", "prompt_only", "probe"):
        print(f"  {name:12s} {out[name]:8.3f} " + " ".join(f"{out[f'{name}/{lab}']:6.3f}" for lab in buckets))
    print(
        f"  headroom 1/{out['headroom']:.1f} (mean over positions of Var(R - V*) / Var(R - V_prompt) = {out['headroom_ratio']:.3f})"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
