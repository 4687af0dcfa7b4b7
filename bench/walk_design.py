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
    """(next distance, probability) of action a (1 step, 2 jump) from distance d; home (0) is absorbing."""
    if d == 0:
        return [(0, 1.0)]
    after = abs(d - a)
    return [(after, 1.0 - slip)] + ([(d, slip)] if slip else [])


WALL = 9  # the walker is never more than 9 to go (one digit): a gust stops at the wall


def gusts(d: int, g: int) -> list[tuple[int, float]]:
    """(distance, probability) after the gust: pushed back 0..g uniformly, up to the wall; home is absorbing."""
    if d == 0:
        return [(0, 1.0)]
    out: dict[int, float] = {}
    for x in range(g + 1):
        out[min(WALL, d + x)] = out.get(min(WALL, d + x), 0.0) + 1.0 / (g + 1)
    return list(out.items())


def policy(design: Design, d: int) -> dict[int, float]:
    """The idealised warm policy's action probabilities at distance d."""
    p = design.p_jump if d >= 2 else design.p_jump1
    return {1: 1.0 - p, 2: p}


def rows(design: Design) -> list[tuple[int, int, int]]:
    """The rows (d0, K, G), equally likely."""
    return list(itertools.product(design.d0, design.turns, design.gust))


@lru_cache(maxsize=None)
def solve(design: Design, G: int, optimal: bool = False):
    """V(d, k, gusted) and Q(d, k, gusted, a) for wind G: success probability with k turns left, of the warm policy (or
    the best)."""

    @lru_cache(maxsize=None)
    def Q(d: int, k: int, gusted: bool, a: int) -> float:
        out = 0.0
        for d1, p in moves(d, a, design.slip):
            for d2, q in (gusts(d1, G) if not gusted else [(d1, 1.0)]):
                out += p * q * V(d2, k - 1, True)
        return out

    @lru_cache(maxsize=None)
    def V(d: int, k: int, gusted: bool) -> float:
        if k == 0:
            return float(d == 0)
        if optimal:
            return max(Q(d, k, gusted, a) for a in (1, 2))
        return sum(p * Q(d, k, gusted, a) for a, p in policy(design, d).items())

    return V, Q


def evaluate(design: Design) -> dict:
    """Warm and optimal success, per-position ratio_t, headroom and the pooled EV ceilings (module docstring)."""
    rs = rows(design)
    K = max(design.turns)
    # per position t: sum over rows of E[v(1 - v)] and the number of rows alive (all rows with K_row turns)
    res = [0.0] * (2 * K)
    alive = [0] * (2 * K)
    base = 0.0
    succ = succ_opt = 0.0
    base_at = [0.0] * (2 * K)  # the prompt-only residual of the rows alive at t
    for d0, k0, G in rs:
        V, Q = solve(design, G)
        v0 = V(d0, k0, False)
        succ += v0 / len(rs)
        succ_opt += solve(design, G, optimal=True)[0](d0, k0, False) / len(rs)
        base += v0 * (1 - v0)
        dist = {(d0, False): 1.0}  # state distribution before turn j
        for j in range(k0):
            k = k0 - j
            for (d, g), p in dist.items():
                v = V(d, k, g)
                res[2 * j] += p * v * (1 - v)
                for a, pa in policy(design, d).items():
                    q = Q(d, k, g, a)
                    res[2 * j + 1] += p * pa * q * (1 - q)
            for t in (2 * j, 2 * j + 1):
                alive[t] += 1
                base_at[t] += v0 * (1 - v0)
            new: dict = {}
            for (d, g), p in dist.items():
                for a, pa in policy(design, d).items():
                    for d1, q in moves(d, a, design.slip):
                        for d2, r in (gusts(d1, G) if not g else [(d1, 1.0)]):
                            new[(d2, True)] = new.get((d2, True), 0.0) + p * pa * q * r
            dist = new
    ratio = [res[t] / base_at[t] for t in range(2 * K)]
    # Var(R) over all model tokens (a row of K turns counts 2K times), as a critic's EV is measured
    w = [2 * k for _, k, _ in rs]
    m = sum(wi * solve(design, G)[0](d, k, False) for wi, (d, k, G) in zip(w, rs)) / sum(w)
    n_tok = sum(alive)
    ev_perfect = 1 - sum(res) / n_tok / (m * (1 - m))
    ev_prompt = 1 - sum(base_at) / n_tok / (m * (1 - m))
    return {"design": design, "success": succ, "optimal": succ_opt, "ratio": ratio, "headroom": 1 / (sum(ratio) / len(ratio)),
            "ev_perfect": ev_perfect, "ev_prompt": ev_prompt, "alive": alive}


def search() -> list[dict]:
    out = []
    for d0, turns, gust, slip, pj in itertools.product(
            [(2, 3), (2, 3, 4), (2, 3, 4, 5), (3, 4, 5)], [(4, 5), (4, 5, 6), (5, 6)],
            [(6,), (9,), (12,), tuple(range(6, 13)), tuple(range(4, 13)), tuple(range(8, 13))], [0.0, 0.05],
            [0.1, 0.2, 0.3]):
        out.append(evaluate(Design(d0, turns, gust, slip, pj)))
    return out


def span(xs: tuple[int, ...]) -> str:
    return f"{xs[0]}-{xs[-1]}" if len(xs) > 1 and xs == tuple(range(xs[0], xs[-1] + 1)) else ",".join(map(str, xs))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--top", type=int, default=15, help="designs to print (warm success in [0.2, 0.4], by headroom)")
    args = ap.parse_args(argv)
    chosen = Design()  # data/walk.py's rules and its demonstrations' policy
    print(f"chosen design {chosen}")
    for name, d in (("warm (the demonstrations)", chosen), ("greedy warm (no jumps)", Design(p_jump=0.0, p_jump1=0.0)),
                    ("jumpier warm", Design(p_jump=0.3, p_jump1=0.15))):
        r = evaluate(d)
        print(f"  {name}: success {r['success']:.3f}, optimal {r['optimal']:.3f}, headroom {r['headroom']:.2f}, "
              f"EV* {r['ev_perfect']:.3f}, EV prompt-only {r['ev_prompt']:.3f}")
        print("    ratio_t by position (action, <|im_end|> of each turn): " + " ".join(f"{x:.2f}" for x in r["ratio"]))
    print(f"\nsearch: designs with warm success in [0.2, 0.4], by headroom (top {args.top})")
    found = [r for r in search() if 0.2 <= r["success"] <= 0.4]
    found.sort(key=lambda r: -r["headroom"])
    print(f"{'d0':>12s} {'K':>9s} {'G':>7s} {'slip':>4s} {'pj':>4s} {'warm':>5s} {'opt':>5s} {'head':>5s} {'EV*':>5s} {'EVp':>5s}")
    for r in found[: args.top]:
        d = r["design"]
        print(f"{span(d.d0):>12s} {span(d.turns):>9s} {span(d.gust):>7s} {d.slip:4.2f} {d.p_jump:4.2f} {r['success']:5.3f} "
              f"{r['optimal']:5.3f} {r['headroom']:5.2f} {r['ev_perfect']:5.3f} {r['ev_prompt']:5.3f}")


if __name__ == "__main__":
    main()
