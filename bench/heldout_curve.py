"""The held-out curve of one or more run folders: sampled and greedy success at each evaluation, one column per run,
the mean and range over the runs, and the change from the start; optionally a PNG. With --critic, also the critic's
explained variance at each step (critic/explained_variance and critic/ev_pos_*, the mean over the runs; "pre" is the
last critic pretraining step, before step 1).

    .venv/bin/python bench/heldout_curve.py outputs/cpu_smollm2_seed0 outputs/cpu_smollm2_seed1 outputs/cpu_smollm2_seed2 \
        --png docs/smollm2.png

Reads each folder's metrics.jsonl (the rows with eval/ keys). A script, not a test: it prints figures.
"""

import argparse
import json
import math
import os


def rows_with(folder: str, key: str) -> dict[int, dict]:
    """{step: the last metrics row of that step holding `key`} of a run folder."""
    rows = {}
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if key in r:
                rows[r["step"]] = r
    return rows


def print_critic(runs: list[str]) -> None:
    """The critic's EV per step and position bucket, the mean over the runs that log it there (n: how many); step 0
    is the last critic pretraining step ("pre")."""
    tables = [rows_with(run, "critic/explained_variance") for run in runs]
    buckets = sorted(
        {k for t in tables for row in t.values() for k in row if k.startswith("critic/ev_pos_")},
        key=lambda k: int(k.rsplit("_", 1)[1].split("-")[0]),
    )
    keys = ["critic/explained_variance", *buckets]
    print("\ncritic explained variance (mean over runs; n = runs with a finite value)")
    print("| step | all | " + " | ".join(k.rsplit("_", 1)[1] for k in buckets) + " |")
    print("|---|" + "---|" * len(keys))
    for s in sorted({s for t in tables for s in t}):
        cells = []
        for k in keys:
            xs = [t[s][k] for t in tables if s in t and k in t[s] and math.isfinite(t[s][k])]
            cells.append(
                f"{sum(xs) / len(xs):.2f}" + ("" if len(xs) == len(runs) else f" (n={len(xs)})") if xs else "-"
            )
        print(f"| {s or 'pre'} | " + " | ".join(cells) + " |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="run folders (--out-dir)")
    ap.add_argument("--png", default="", help="write the sampled-success curves here")
    ap.add_argument("--critic", action="store_true", help="also the critic's EV per step and position bucket")
    args = ap.parse_args()
    curves = {run: rows_with(run, "eval/sampled_acc") for run in args.runs}
    steps = sorted(set.intersection(*(set(c) for c in curves.values())))
    names = [os.path.basename(os.path.normpath(r)) for r in args.runs]
    for key in ("eval/sampled_acc", "eval/greedy_acc"):
        print(f"\n{key} (%)")
        print("| step | " + " | ".join(names) + " | mean | min-max |")
        print("|---|" + "---|" * (len(names) + 2))
        for s in steps:
            xs = [100 * curves[r][s][key] for r in args.runs]
            cells = " | ".join(f"{x:.1f}" for x in xs)
            print(f"| {s} | {cells} | {sum(xs) / len(xs):.1f} | {min(xs):.1f}-{max(xs):.1f} |")
        gains = [100 * (curves[r][steps[-1]][key] - curves[r][steps[0]][key]) for r in args.runs]
        print(f"change step {steps[0]} -> {steps[-1]}: " + ", ".join(f"{g:+.1f}" for g in gains) + " points")
    if args.critic:
        print_critic(args.runs)
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.2))
        for run, name in zip(args.runs, names):
            ax.plot(steps, [100 * curves[run][s]["eval/sampled_acc"] for s in steps], marker="o", label=name)
        ax.set_xlabel("RL step")
        ax.set_ylabel("held-out sampled success (%)")
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.png, dpi=120)
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
