"""Does the critic learn on the frozen start policy? Critic pretraining with the plateau rule off, per setting.

Runs train_ppo.py's critic pretraining (critic-only steps on rollouts of the start policy, out-of-sample
explained variance per step) for a fixed number of steps, for each critic learning rate x updates per batch,
and prints the mean EV of the first and last 10 steps. Read it against bench/value_ceiling.py's ceilings.

    .venv/bin/python bench/critic_sweep.py                                  # default addition model, 4 settings
    .venv/bin/python bench/critic_sweep.py --task sort --steps 40 --settings 1e-3x2
"""

import argparse
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import train_ppo  # noqa: E402
import value_model  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="addition")
    p.add_argument("--steps", type=int, default=60, help="pretraining steps per setting (the plateau rule is off)")
    p.add_argument(
        "--settings", default="1e-3x2,3e-4x2,3e-4x8,3e-3x2", help="comma-separated <critic lr>x<updates per batch>"
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    value_model.PLATEAU_MIN_GAIN = -float("inf")  # never plateau: every setting runs --steps pretraining steps
    results = []
    for setting in args.settings.split(","):
        lr, updates = setting.split("x")
        with tempfile.TemporaryDirectory() as out:
            cfg = train_ppo.Config(
                task=args.task,
                out_dir=out,
                steps=1,
                seed=args.seed,
                critic_pretrain=args.steps,
                critic_lr=float(lr),
                critic_updates=int(updates),
                eval_size=50,
                eval_every=100,
            )
            hist = train_ppo.main(cfg)
        evs = [r["critic/explained_variance"] for r in hist if "pretrain/step" in r]
        results.append((setting, value_model.finite_mean(evs[:10]), value_model.finite_mean(evs[-10:])))
    print(
        f"\ncritic pretraining on the frozen start policy, task {args.task}, {args.steps} steps of 64 rollouts, plateau rule off"
    )
    print("| critic lr x updates per batch | mean EV, steps 1-10 | mean EV, last 10 steps |\n|---|---|---|")
    for setting, first, last in results:
        print(f"| {setting} | {first:.3f} | {last:.3f} |")
    return results


if __name__ == "__main__":
    main()
