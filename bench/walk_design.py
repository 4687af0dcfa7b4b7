"""Design search for `--task walk` (data/walk.py): exact values of an idealised warm policy, and the headroom bound.

A candidate design is a walk home on a line: the row gives the start distance d0 and the turn budget K; each turn the
walker steps ("1": one step) or jumps ("2": two steps; from 1 to go it lands 1 past home, still 1 to go); after turn
1 a gust pushes it back g steps, g uniform in [0, G] (random, mid-episode, unpredictable from the prompt); a step or
a jump slips (does not move) with probability `slip`. Home is absorbing; the reward is 1 if the walker is home after
turn K, else 0. The idealised warm policy jumps with probability p_jump from 2 or more to go and p_jump1 from 1 to go.

Everything is exact (dynamic programming over the (distance, turns left) states, forward state distributions):

    positions      model-token columns: each turn is 2 model tokens (the action, <|im_end|>); the critic's value at
                   the action is V(s) (read before it), at <|im_end|> Q(s, a); every episode lasts K turns, so every
                   row is alive at every position
    ratio_t        E[(R - V*_t)^2] / E[(R - V_prompt)^2] = E[V*_t (1 - V*_t)] / E[V_0 (1 - V_0)] over the rows,
                   V_0 = the prompt's success rate (a perfect prompt-only critic; with every row alive at every
                   position this is also the per-position prompt-only critic)
    headroom       1 / mean_t ratio_t: (1 - EV*_t) / (1 - EV_prompt,t) = ratio_t, so the issue's bound
                   mean_t (1 - EV*_t) / (1 - EV_prompt,t) <= 1/3 reads headroom >= 3
    EV*            the perfect critic's explained variance pooled over positions, 1 - mean_t E[V*_t(1 - V*_t)] / Var(R)
    optimal        the success of the best policy (DP with a max over the actions)

    .venv/bin/python bench/walk_design.py            # the search table and the chosen design's per-position figures

No torch, no model: a pure-Python model of the task, to choose its parameters before building it.
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True)
class Design:
    d0: tuple[int, ...] = (2, 3, 4, 5)
    """start distances of the rows"""
    turns: tuple[int, ...] = (4, 5, 6)
    """turn budgets K of the rows"""
    gust: tuple[int, ...] = tuple(range(6, 13))
    """wind strengths G of the rows: the gust after turn 1 pushes the walker back g ~ uniform{0..G} steps (not from
    home), up to the wall at WALL"""
    slip: float = 0.0
    """probability that a step or a jump does not move the walker"""
    p_jump: float = 0.15
    """warm policy: probability of a jump from 2 or more to go"""
    p_jump1: float = 0.05
    """warm policy: probability of a (wasted) jump from 1 to go"""


def moves(d: int, a: int, slip: float) -> list[tuple[int, float]]:
    """(next distance, probability) of action a (1 step, 2 jump, 0 any other text: stand still) from distance d; home
    (0) is absorbing."""
    if d == 0 or a == 0:
        return [(d, 1.0)]
    return [(abs(d - a), 1.0 - slip)] + ([(d, slip)] if slip else [])


WALL = 9  # the walker is never more than 9 to go (one digit): a gust stops at the wall
TURN_WIDTH = 37  # response columns per turn: the move, <|im_end|>, and a 15-character observation's 35 tokens


def gusts(d: int, g: int) -> list[tuple[int, float]]:
    """(distance, probability) after the gust: pushed back 0..g uniformly, up to the wall; home is absorbing."""
    if d == 0:
        return [(0, 1.0)]
    out: dict[int, float] = {}
    for x in range(g + 1):
        out[min(WALL, d + x)] = out.get(min(WALL, d + x), 0.0) + 1.0 / (g + 1)
    return list(out.items())


Table = dict  # (d, k, gusted) -> {action: probability}: a policy measured on a model (fit_policy)


def policy(design: Design, d: int, k: int, gusted: bool, table: Table | None = None) -> dict[int, float]:
    """The warm policy's action probabilities at distance d with k turns left: the table's where it has the state,
    else the idealised ones."""
    if table is not None and (d, k, gusted) in table:
        return table[(d, k, gusted)]
    p = design.p_jump if d >= 2 else design.p_jump1
    return {1: 1.0 - p, 2: p}


def rows(design: Design) -> list[tuple[int, int, int]]:
    """The rows (d0, K, G), equally likely."""
    return list(itertools.product(design.d0, design.turns, design.gust))


def solve(design: Design, G: int, optimal: bool = False, table: Table | None = None):
    """V(d, k, gusted) and Q(d, k, gusted, a) for wind G: success probability with k turns left, of the warm policy (or
    the best)."""
    key = None if table is None else tuple(sorted((s, tuple(sorted(p.items()))) for s, p in table.items()))
    return _solve(design, G, optimal, key)


@lru_cache(maxsize=None)
def _solve(design: Design, G: int, optimal: bool, key):
    table = None if key is None else {s: dict(p) for s, p in key}

    @lru_cache(maxsize=None)
    def Q(d: int, k: int, gusted: bool, a: int) -> float:
        out = 0.0
        for d1, p in moves(d, a, design.slip):
            for d2, q in gusts(d1, G) if not gusted else [(d1, 1.0)]:
                out += p * q * V(d2, k - 1, True)
        return out

    @lru_cache(maxsize=None)
    def V(d: int, k: int, gusted: bool) -> float:
        if k == 0:
            return float(d == 0)
        if optimal:
            return max(Q(d, k, gusted, a) for a in (1, 2))
        return sum(p * Q(d, k, gusted, a) for a, p in policy(design, d, k, gusted, table).items())

    return V, Q


def evaluate(
    design: Design, table: Table | None = None, turn_width: int = TURN_WIDTH, configs: list | None = None
) -> dict:
    """Warm (or a measured policy's) and optimal success, per-position ratio_t, headroom, the pooled EV ceilings and
    the per-bucket ones (keys as bench/value_ceiling.py writes them: "perfect/<bucket>", "prompt_only/<bucket>", with
    turn j's two model tokens at response columns turn_width * j and + 1). configs: the rows (d0, K, G), equally
    likely (default: all of the design's)."""
    rs = configs or rows(design)
    T = 2 * max(design.turns)
    res, base, alive, wins = [0.0] * T, [0.0] * T, [0] * T, [0.0] * T  # per model-token position, summed over rows
    succ = succ_opt = 0.0
    for d0, k0, G in rs:
        V, Q = solve(design, G, table=table)
        v0 = V(d0, k0, False)
        succ += v0 / len(rs)
        succ_opt += solve(design, G, optimal=True)[0](d0, k0, False) / len(rs)
        dist = {(d0, False): 1.0}  # state distribution before turn j
        for j in range(k0):
            k, new = k0 - j, {}
            for (d, g), p in dist.items():
                v = V(d, k, g)
                res[2 * j] += p * v * (1 - v)
                for a, pa in policy(design, d, k, g, table).items():
                    q = Q(d, k, g, a)
                    res[2 * j + 1] += p * pa * q * (1 - q)
                    for d1, q1 in moves(d, a, design.slip):
                        for d2, q2 in gusts(d1, G) if not g else [(d1, 1.0)]:
                            new[(d2, True)] = new.get((d2, True), 0.0) + p * pa * q1 * q2
            for t in (2 * j, 2 * j + 1):
                alive[t] += 1
                base[t] += v0 * (1 - v0)
                wins[t] += v0
            dist = new
    ratio = [res[t] / base[t] for t in range(T)]  # over the rows alive at t

    def ev(ts) -> dict[str, float]:
        n = sum(alive[t] for t in ts)
        m = sum(wins[t] for t in ts) / n
        return {
            "perfect": 1 - sum(res[t] for t in ts) / n / (m * (1 - m)),
            "prompt_only": 1 - sum(base[t] for t in ts) / n / (m * (1 - m)),
        }

    out = {"design": design, "success": succ, "optimal": succ_opt, "ratio": ratio, "headroom": 1 / (sum(ratio) / T)}
    pooled = ev(range(T))
    out.update(ev_perfect=pooled["perfect"], ev_prompt=pooled["prompt_only"])
    col = [turn_width * (t // 2) + t % 2 for t in range(T)]
    out["buckets"] = {}
    for label, lo, hi in position_buckets(col[-1] + 1):
        ts = [t for t in range(T) if lo <= col[t] < hi]
        if ts:
            out["buckets"][label] = ev(ts)
    return out


def position_buckets(T: int) -> list[tuple[str, int, int]]:
    """losses.position_buckets (copied: this script imports no torch)."""
    out, lo = [], 0
    while lo < T:
        hi = lo + 1 if lo < 4 else 2 * lo
        out.append((str(lo) if hi == lo + 1 else f"{lo}-{hi - 1}", lo, min(hi, T)))
        lo = hi
    return out


def search() -> list[dict]:
    out = []
    for d0, turns, gust, slip, pj in itertools.product(
        [(2, 3), (2, 3, 4), (2, 3, 4, 5), (3, 4, 5)],
        [(4, 5), (4, 5, 6), (5, 6)],
        [(6,), (9,), (12,), tuple(range(6, 13)), tuple(range(4, 13)), tuple(range(8, 13))],
        [0.0, 0.05],
        [0.1, 0.2, 0.3],
    ):
        out.append(evaluate(Design(d0, turns, gust, slip, pj)))
    return out


def measure(model: str, n: int, seed: int) -> dict:
    """The real model's figures: held-out success (test rows: sampled at temperature 1, and greedy), its measured
    policy (fit_policy, on n train episodes) and that policy's exact figures (evaluate on the train configurations)."""
    import torch  # noqa: F401  (only this mode needs torch and the model)

    import agent
    from data.tasks import get_task
    from embedded_engine import EmbeddedEngine
    from rollout import Sampling
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    task = get_task("walk")
    engine = EmbeddedEngine(model, dtype="fp32")
    out = {"model": model}
    for kind, extra in (("sampled", {}), ("greedy", {"top_k": 1})):
        s = Sampling(1.0, max_new_tokens=task.max_new_tokens, stop_token_ids=(tok.eos_token_id,), seed=seed, **extra)
        ep = agent.run_episodes(
            engine, tok, task.env, task.test.to_list()[:n], s, max_turns=task.max_turns, context_len=256
        )
        out[f"held_out_{kind}"] = float((ep.returns > 0).float().mean())
    s = Sampling(1.0, max_new_tokens=task.max_new_tokens, stop_token_ids=(tok.eos_token_id,), seed=seed + 1)
    train = task.train.to_list()[:n]
    ep = agent.run_episodes(engine, tok, task.env, train, s, max_turns=task.max_turns, context_len=256)
    table, visits = fit_policy(model, tok, ep)
    out["train_sampled"] = float((ep.returns > 0).float().mean())
    configs = sorted({parse_row(r["prompt"]) for r in train})
    out["measured_policy"] = evaluate(Design(), table, configs=configs)
    out["policy"] = {
        f"{d} to go, {k} left{'' if g else ' (before the gust)'}": {"visits": visits[(d, k, g)], **p}
        for (d, k, g), p in sorted(table.items())
    }
    return out


def parse_row(prompt: str) -> tuple[int, int, int]:
    """(d0, K, G) of a row's prompt."""
    from data.walk import parse_prompt

    G, d0, K = parse_prompt(prompt)
    return d0, K, G


def fit_policy(model: str, tok, ep) -> tuple[Table, dict]:
    """The model's mean action probabilities per state (d, k, gusted), read off its next-token distribution at the
    first token of every turn of the episodes `ep` (agent.Episodes): "1" a step, "2" a jump, anything else (0) stand
    still. The state is the turn's user message ("d to go, k left"; the prompt's is before the gust)."""
    import re

    import torch
    from transformers import AutoModelForCausalLM

    policy_model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ro = ep.rollout
    b = ro.to_batch(tok.pad_token_id)
    P = b.response_start
    one, two = (tok(c, add_special_tokens=False).input_ids[0] for c in "12")
    sums: dict = {}
    visits: dict = {}
    with torch.no_grad():
        for lo in range(0, len(ro.mask), 64):
            sl = slice(lo, lo + 64)
            logits = policy_model(
                input_ids=b.input_ids[sl], attention_mask=b.attention_mask[sl], position_ids=b.position_ids[sl]
            ).logits[:, P - 1 : -1]
            probs = logits.float().softmax(-1)
            for i, row in enumerate(range(lo, min(lo + 64, len(ro.mask)))):
                m = ro.mask[row].tolist()
                starts = [t for t in range(len(m)) if m[t] and (t == 0 or not m[t - 1])]
                users = [x["content"] for x in ep.messages[ep.episode[row]] if x["role"] == "user"]
                for j, t in enumerate(starts):
                    d, k = map(int, re.search(r"(\d) to go, (\d) left", users[j]).groups())
                    state = (d, k, j > 0)
                    p1, p2 = probs[i, t, one].item(), probs[i, t, two].item()
                    acc = sums.setdefault(state, [0.0, 0.0, 0.0])
                    acc[0], acc[1], acc[2] = acc[0] + p1, acc[1] + p2, acc[2] + (1 - p1 - p2)
                    visits[state] = visits.get(state, 0) + 1
    return {s: {1: a[0] / visits[s], 2: a[1] / visits[s], 0: a[2] / visits[s]} for s, a in sums.items()}, visits


def ceiling_json(r: dict) -> dict:
    """evaluate()'s figures under the keys of bench/value_ceiling.py's --out, for bench/value_fit.py --ceiling."""
    out = {"perfect": r["ev_perfect"], "prompt_only": r["ev_prompt"], "headroom": round(r["headroom"], 3)}
    for label, e in r["buckets"].items():
        out.update({f"perfect/{label}": e["perfect"], f"prompt_only/{label}": e["prompt_only"]})
    return out


def span(xs: tuple[int, ...]) -> str:
    return f"{xs[0]}-{xs[-1]}" if len(xs) > 1 and xs == tuple(range(xs[0], xs[-1] + 1)) else ",".join(map(str, xs))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--top", type=int, default=15, help="designs to print (warm success in [0.2, 0.4], by headroom)")
    ap.add_argument(
        "--model",
        default="",
        help="also measure this model folder (e.g. the default walk model): held-out "
        "success, its per-state policy and that policy's exact headroom and EV ceilings",
    )
    ap.add_argument("--episodes", type=int, default=1000, help="--model: episodes per measurement")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--out", default="", help="--model: write the measured policy's ceilings here (value_ceiling's keys)"
    )
    args = ap.parse_args(argv)
    if args.model:
        import json
        import os
        import sys

        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        m = measure(args.model, args.episodes, args.seed)
        r = m["measured_policy"]
        print(
            f"model {args.model}\n  held-out success: sampled {m['held_out_sampled']:.3f}, greedy {m['held_out_greedy']:.3f}; "
            f"train sampled {m['train_sampled']:.3f}"
        )
        print(
            f"  its measured policy (per state, exact DP on the train configurations): success {r['success']:.3f}, "
            f"optimal {r['optimal']:.3f}, headroom {r['headroom']:.2f}, EV* {r['ev_perfect']:.3f}, EV prompt-only "
            f"{r['ev_prompt']:.3f}"
        )
        print("    ratio_t: " + " ".join(f"{x:.2f}" for x in r["ratio"]))
        print(
            "    by bucket (perfect / prompt-only): "
            + ", ".join(f"{b} {e['perfect']:.3f}/{e['prompt_only']:.3f}" for b, e in r["buckets"].items())
        )
        for state, p in m["policy"].items():
            if p["visits"] >= 20:
                print(f"    {state:32s} visits {p['visits']:5d}  step {p[1]:.3f} jump {p[2]:.3f} other {p[0]:.3f}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(
                    {
                        **ceiling_json(r),
                        "model": args.model,
                        "held_out_sampled": m["held_out_sampled"],
                        "held_out_greedy": m["held_out_greedy"],
                        "policy": m["policy"],
                    },
                    f,
                    indent=1,
                )
        return
    chosen = Design()  # data/walk.py's rules and its demonstrations' policy
    print(f"chosen design {chosen}")
    for name, d in (
        ("warm (the demonstrations)", chosen),
        ("greedy warm (no jumps)", Design(p_jump=0.0, p_jump1=0.0)),
        ("jumpier warm", Design(p_jump=0.3, p_jump1=0.15)),
    ):
        r = evaluate(d)
        print(
            f"  {name}: success {r['success']:.3f}, optimal {r['optimal']:.3f}, headroom {r['headroom']:.2f}, "
            f"EV* {r['ev_perfect']:.3f}, EV prompt-only {r['ev_prompt']:.3f}"
        )
        print("    ratio_t by position (action, <|im_end|> of each turn): " + " ".join(f"{x:.2f}" for x in r["ratio"]))
    print(f"\nsearch: designs with warm success in [0.2, 0.4], by headroom (top {args.top})")
    found = [r for r in search() if 0.2 <= r["success"] <= 0.4]
    found.sort(key=lambda r: -r["headroom"])
    print(
        f"{'d0':>12s} {'K':>9s} {'G':>7s} {'slip':>4s} {'pj':>4s} {'warm':>5s} {'opt':>5s} {'head':>5s} {'EV*':>5s} {'EVp':>5s}"
    )
    for r in found[: args.top]:
        d = r["design"]
        print(
            f"{span(d.d0):>12s} {span(d.turns):>9s} {span(d.gust):>7s} {d.slip:4.2f} {d.p_jump:4.2f} {r['success']:5.3f} "
            f"{r['optimal']:5.3f} {r['headroom']:5.2f} {r['ev_perfect']:5.3f} {r['ev_prompt']:5.3f}"
        )


if __name__ == "__main__":
    main()
