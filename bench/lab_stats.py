"""The lab's statistics (bench/lab.py): the 95% t-interval of a mean, the area under a held-out curve, paired-seed
differences between two arms and the verdict on one such difference. Standard library only (scipy is not a dependency).

    from lab_stats import auc, ci95, judge, paired    # from bench/, or with bench/ on sys.path
"""

import math

# two-sided 95% t quantiles t_{0.975, df}, df = 1..30
T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]
NAN = float("nan")
finite = lambda v: isinstance(v, (int, float)) and v == v  # noqa: E731  (not None, not NaN)


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
        raise ValueError(f"AUC of {key} needs evaluations at step 0 and at the last step {last}; "
                         f"this run has them at steps {[s for s, _ in pts]}")
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
