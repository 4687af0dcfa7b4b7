"""The lab's statistics (bench/lab.py): the 95% t-interval of a mean, the area under a held-out curve, paired-seed
differences between two arms and the verdict on one such difference; for collapse grids, Fisher's exact test, the step
of collapse, the survival curve and the step an early warning crossed its threshold. Standard library only (scipy is
not a dependency).

    from lab_stats import auc, ci95, judge, paired    # from bench/, or with bench/ on sys.path
"""

import json
import math
import os

# two-sided 95% t quantiles t_{0.975, df}, df = 1..30
T975 = [
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
]
NAN = float("nan")


def finite(v):
    return isinstance(v, (int, float)) and v == v  # (not None, not NaN)


def ci95(values):
    """(mean, half-width of the 95% t-interval of the mean, n) over the non-NaN values; half-width NaN below 2."""
    v = [x for x in values if finite(x)]
    n = len(v)
    mean = sum(v) / n if n else NAN
    if n < 2:
        return mean, NAN, n
    t = T975[n - 2] if n <= 31 else 1.96 + (1.96**3 + 1.96) / (4 * (n - 1))  # Cornish-Fisher beyond the table
    return mean, t * math.sqrt(sum((x - mean) ** 2 for x in v) / (n - 1) / n), n


def auc(rows, key, last):
    """Area under a held-out curve as the mean success over training, in points: the trapezoid integral of
    100 * row[key] over the evaluation steps (rows carrying key, sorted by step) from step 0 to `last`, divided by
    `last`. Uneven evaluation steps are weighted by the steps they span. A curve that does not start at step 0 or end
    at `last` is an error (the area would cover another interval than every other run's)."""
    pts = sorted((r["step"], r[key]) for r in rows if finite(r.get(key)))
    if not pts or pts[0][0] != 0 or pts[-1][0] != last or last <= 0:
        raise ValueError(
            f"AUC of {key} needs evaluations at step 0 and at the last step {last}; "
            f"this run has them at steps {[s for s, _ in pts]}"
        )
    return 100 * sum((s1 - s0) * (y0 + y1) / 2 for (s0, y0), (s1, y1) in zip(pts, pts[1:])) / last


def paired(a, b):
    """Paired differences a - b on the seeds present (finite) in both. a, b: {seed: value}.
    Returns ({seed: difference}, ci95 triple of the differences)."""
    d = {s: a[s] - b[s] for s in sorted(set(a) & set(b)) if finite(a[s]) and finite(b[s])}
    return d, ci95(list(d.values()))


def judge(c, points=2.0, need=5):
    """Verdict on a paired difference c = (mean, half-width, n): BETTER if mean >= points and the 95% interval
    excludes 0, WORSE if mean <= -points and the interval excludes 0, NULL otherwise, NOT JUDGED below `need` seeds."""
    mean, hw, n = c
    if n < max(need, 2):
        return "NOT JUDGED"
    if mean >= points and mean - hw > 0:
        return "BETTER"
    if mean <= -points and mean + hw < 0:
        return "WORSE"
    return "NULL"


CREDIT = (("vine", "reinforce"), ("ppo", "reinforce"), ("ppo-priv", "ppo"), ("ppo", "grpo-n8"))  # (1) is the oracle


def load_ceiling(path):
    """bench/value_ceiling.py's --out JSON, or {} where there is none."""
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def verdict_credit(stats, points=2.0, need=5, ceilings=None, root="", pairs=CREDIT, uninformative=None):
    """The credit grid's comparisons, per task: paired seed differences (lab_stats.paired) of the AUC of held-out
    sampled success (primary) and of final sampled success (secondary), judged by lab_stats.judge; the oracle pair
    first. Beside each arm: its EV over the last 20% of steps (critic's, or vine's Monte Carlo values') against the
    task's perfect-critic ceiling (ceilings: {task: path of bench/value_ceiling.py's --out JSON, under root}), GRPO's
    identical-reward groups and vine's extra tokens. stats: {task: {arm: bench/lab.py's arm_stats(runs)}}, the ci95
    triples of run_stats' keys and "seeds": {seed: run_stats(run)}. pairs: the comparisons in order, the oracle's
    first (default: the credit grid's, CREDIT). uninformative: {comparison number: why}, reported and never decisive."""

    def fmt(x, spec):
        return "-" if not finite(x) else format(x, spec)

    lines, decided, judged = [], [], set()
    for task, arms in stats.items():

        def seeds(a, key):
            return {s: p[key] for s, p in arms.get(a, {}).get("seeds", {}).items()}

        ceiling = load_ceiling(os.path.join(root, (ceilings or {})[task])) if task in (ceilings or {}) else {}
        lines += [
            f"### {task}",
            "",
            "| arm | seeds | AUC sampled | AUC greedy | final sampled | EV last 20% (/ ceiling) | identical-reward groups "
            "| vine extra tokens |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for a, c in arms.items():
            ev = c["vine_ev_last" if finite(c["vine_ev_last"][0]) else "critic_ev_last"][0]
            ev = fmt(ev, ".2f") + (
                f" / {ceiling['perfect']:.2f}" if ceiling and finite(ev) else ""
            )  # against the ceiling
            lines.append(
                f"| {a} | {len(c['seeds'])} | {fmt(c['auc_sampled'][0], '.1f')} | {fmt(c['auc_greedy'][0], '.1f')} "
                f"| {fmt(c['final_sampled'][0], '.1f')} | {ev} | {fmt(c['identical'][0], '.1%')} | {fmt(c['vine_extra'][0], '.2f')} |"
            )
        lines += [
            "",
            "Perfect-critic ceiling of the start policy (bench/value_ceiling.py's Monte Carlo estimate, or bench/walk_design.py's "
            "exact one for walk): "
            + (
                f"{ceiling['perfect']:.2f}; prompt-only {ceiling['prompt_only']:.2f} (`{ceilings[task]}`)."
                if ceiling
                else "not measured."
            ),
            "",
        ]
        oracle = None
        judged |= {
            judge(paired(seeds(a, "auc_sampled"), seeds(b, "auc_sampled"))[1], points, need) != "NOT JUDGED"
            for a, b in pairs
        }
        for i, (a, b) in enumerate(pairs, 1):
            for key, kind in (
                ("auc_sampled", "AUC of held-out sampled success"),
                ("final_sampled", "final sampled success (secondary)"),
            ):
                _, c = paired(seeds(a, key), seeds(b, key))
                v = judge(c, points, need)
                oracle = v if i == 1 and key == "auc_sampled" else oracle
                why = (uninformative or {}).get(i) or (
                    None if i == 1 or oracle == "BETTER" else "the oracle is not BETTER"
                )
                informative = why is None
                if key == "auc_sampled" and informative and v in ("BETTER", "WORSE"):
                    decided.append(f"{task}: {a} {v} than {b}")
                diff = (
                    f"paired difference {fmt(c[0], '+.1f')} ± {fmt(c[1], '.1f')} points over {c[2]} seeds"
                    if c[2]
                    else "no seeds finished in both arms"
                )
                lines.append(
                    f"- ({i}) {a} vs {b}, {kind}: **{v}** ({diff})" + ("" if informative else f", uninformative: {why}")
                )
            if i == 1 and oracle == "NOT JUDGED":
                lines.append(
                    f"- **{task}: the oracle is not judged yet** (under {need} paired seeds): comparisons 2-{len(pairs)} on "
                    "it are uninformative until it is (printed below for the record)."
                )
            elif i == 1 and oracle != "BETTER":
                lines.append(
                    f"- **{task} cannot show a credit effect**: {pairs[0][0]} (the oracle) is not BETTER than "
                    f"{pairs[0][1]} ({oracle}); comparisons 2-{len(pairs)} on it are uninformative (printed below for the "
                    "record)."
                )
        lines.append("")
    if decided:
        return lines + [f"Decisive comparisons (primary endpoint, informative tasks): {'; '.join(decided)}."]
    return lines + (
        ["**Null result**: no informative comparison on the primary endpoint is BETTER or WORSE."]
        if True in judged
        else [f"**Not judged**: no comparison has {need} paired seeds yet."]
    )


def fisher_exact(a: int, b: int, c: int, d: int) -> float:
    """Two-sided p-value of Fisher's exact test on the 2x2 table [[a, b], [c, d]] (rows: two arms; columns: collapsed,
    not): the probability, under the hypergeometric law with the table's margins, of every table at most as likely as
    this one (R's fisher.test and scipy's convention, with a relative tolerance of 1e-7 on ties)."""
    n, row, col = a + b + c + d, a + b, a + c

    def p(x):
        return math.comb(col, x) * math.comb(n - col, row - x) / math.comb(n, row)  # P(top-left cell = x)

    here = p(a)
    return min(1.0, sum(q for x in range(max(0, row + col - n), min(row, col) + 1) if (q := p(x)) <= here * (1 + 1e-7)))


def collapse_step(rows, key, margin, nonfinite_step=None):
    """The first evaluation step (after step 0) at which rows' key (an accuracy in [0, 1]) is at least `margin` below
    its step-0 value, or the step of a non-finite stop, whichever comes first; None if neither happened."""
    ev = sorted((r["step"], r[key]) for r in rows if finite(r.get(key)))
    if not ev or ev[0][0] != 0:
        raise ValueError(f"collapse_step needs an evaluation of {key} at step 0; got steps {[s for s, _ in ev]}")
    hits = [s for s, v in ev[1:] if v <= ev[0][1] - margin] + ([nonfinite_step] if nonfinite_step is not None else [])
    return min(hits) if hits else None


def survival(steps_of_collapse, grid):
    """The share of runs not collapsed by each step of grid: steps_of_collapse holds one collapse step (or None) per run."""
    n = len(steps_of_collapse)
    return [sum(s is None or s > g for s in steps_of_collapse) / n if n else NAN for g in grid]


def first_crossing(rows, key, threshold, below=True, start=1):
    """The first step >= start whose rows' key is below (or above, below=False) threshold, None if never: when an early
    warning (seq ESS falling, max |log k| rising) moved, to set beside the collapse step."""
    for r in sorted((r for r in rows if r["step"] >= start and finite(r.get(key))), key=lambda r: r["step"]):
        if (r[key] < threshold) if below else (r[key] > threshold):
            return r["step"]
    return None
