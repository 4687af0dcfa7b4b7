"""`--task rg:<name>`: a reasoning-gym procedural task (https://github.com/open-thought/reasoning-gym, an optional
dependency: `pip install reasoning-gym`; `make venv` installs it for the tests).

    .venv/bin/python train_ppo.py --task rg:basic_arithmetic --model path/to/model    # any of reasoning_gym's datasets

One generator (seed SEED) makes n_train + n_test entries, each from its own seed (SEED + index): the first n_train are
the train rows, the rest the test rows, less any whose question is also a train question, so the sets are disjoint.
The prompt is the entry's question; the reward is the dataset's own score_answer(answer=completion, entry=entry) (a
float in [0, 1]; --reward replaces it). Each row keeps its index ("rg_index") to find its entry, metadata included. The tiny default
models have a 256-token context, which most reasoning-gym questions do not fit: give --model.
"""

from __future__ import annotations

SEED = 0
INSTALL = "pip install reasoning-gym"


def rg_rows(name: str, n_train: int = 10000, n_test: int = 500):
    """(train rows, test rows, score): rows {prompt, answer, rg_index}; score the reward function."""
    try:
        import reasoning_gym
    except ImportError:
        raise ValueError(f"--task rg:{name} needs the reasoning-gym package: {INSTALL}") from None
    names = sorted(reasoning_gym.factory.DATASETS)
    if name not in names:
        raise ValueError(
            f"--task rg:{name}: reasoning-gym has no dataset {name!r} (it has {len(names)}: {', '.join(names[:12])}, ...)"
        )
    ds = reasoning_gym.create_dataset(name, seed=SEED, size=n_train + n_test)  # entry i draws from seed + i
    entries = [ds[i] for i in range(len(ds))]
    seen = {e["question"] for e in entries[:n_train]}
    rows = [{"prompt": e["question"], "answer": str(e["answer"]), "rg_index": i} for i, e in enumerate(entries)]
    test = [r for r in rows[n_train:] if r["prompt"] not in seen]

    def score(completions, *, answer, rg_index, **columns) -> list[float]:
        """reasoning-gym's score_answer of each completion against its entry."""
        return [float(ds.score_answer(answer=c, entry=entries[i])) for c, i in zip(completions, rg_index)]

    score.__name__ = f"reasoning_gym.{name}.score_answer"
    return rows[:n_train], test, score
