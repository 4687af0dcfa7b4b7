"""`--task rg:<name>[:<option>=<value>,...]`: a reasoning-gym procedural task (https://github.com/open-thought/reasoning-gym,
an optional dependency: `pip install reasoning-gym`; `make venv` installs it for the tests).

    .venv/bin/python train_ppo.py --task rg:basic_arithmetic --model path/to/model    # any of reasoning_gym's datasets
    .venv/bin/python train_ppo.py --task rg:chain_sum:min_terms=2,max_terms=2,max_digits=2 --model path/to/model
    .venv/bin/python train_ppo.py --task "rg:gcd:max_value=50,suffix=Answer with the number only." --model ...

The options after the second colon are fields of the dataset's config class (reasoning_gym.factory.DATASETS[name][1],
e.g. ChainSumConfig), comma-separated: a value is read as the field's default is typed (int, float, true/false for a
bool, a string; a tuple or list field takes items separated by "|", e.g. operators=+|-), or, where the default is None,
as an int, float, true/false or else a string. An unknown option, a value of the wrong type or one the config's own
validate() refuses is a ValueError naming --task and the option, before any model loads; seed and size are this
module's (SEED, n_train + n_test). One option is ours: suffix=<text> ends every prompt with " <text>" (no commas
in it), e.g. "Answer with the number only." for a small model that otherwise explains itself past any short
--max-new-tokens; train and test rows get the same suffix. And train=<N> makes N train entries instead of 10,000,
so a config with few distinct questions still leaves held-out ones (chain_sum of two one-digit terms: train=100).

One generator (seed SEED) makes n_train + n_test entries, each from its own seed (SEED + index): the first n_train are
the train rows, the rest the test rows, less any whose question is also a train question or an earlier test question,
so the sets are disjoint and each held-out question counts once. A
small config (chain_sum with one-digit terms has 200 questions) leaves no test row: that is a ValueError too.
The prompt is the entry's question; the reward is the dataset's own score_answer(answer=completion, entry=entry) (a
float in [0, 1]: most datasets give 1 to the exact answer and len(answer) / len(completion) to a completion that
contains it; --reward replaces it). Each row keeps its index ("rg_index") to find its entry, metadata included. The
tiny default models have a 256-token context, which most reasoning-gym questions do not fit: give --model.
"""

from __future__ import annotations

import dataclasses

SEED = 0
INSTALL = "pip install reasoning-gym"
OURS = ("seed", "size")  # config fields this module sets
SUFFIX = "suffix"
TRAIN = "train"


def parse_options(spec: str, text: str) -> dict[str, str]:
    """{option: raw value} of the comma-separated option=value list `text` (of --task `spec`)."""
    options = {}
    for item in text.split(","):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ValueError(
                f"--task {spec}: {item!r} is not option=value (options are comma-separated, no commas inside)"
            )
        if key in options:
            raise ValueError(f"--task {spec}: option {key!r} is given twice")
        options[key] = value.strip()
    return options


def guess_value(text: str):
    """An int, a float, a bool (true / false) or else the string itself."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def typed_value(spec: str, key: str, text: str, default):
    """`text` read as the config field `key`, whose default is `default`, is typed."""
    if isinstance(default, (tuple, list)):
        return type(default)(guess_value(t) for t in text.split("|"))
    if default is None or default is dataclasses.MISSING:
        return guess_value(text)
    value = guess_value(text)
    kind = type(default)
    if kind is float and type(value) is int:
        value = float(value)
    if kind is str or not isinstance(default, (bool, int, float)):  # a string, an enum, a date: the config checks it
        return text
    if type(value) is not kind:
        want = "true or false" if kind is bool else f"an {kind.__name__}" if kind is int else f"a {kind.__name__}"
        raise ValueError(f"--task {spec}: option {key}={text!r} is not {want} (its default is {default!r})")
    return value


def dataset_config(spec: str, name: str, options: dict[str, str]):
    """The dataset's config object with `options` (raw strings) applied and validated."""
    import reasoning_gym

    config_cls = reasoning_gym.factory.DATASETS[name][1]
    fields = {f.name: f for f in dataclasses.fields(config_cls) if f.name not in OURS}
    kwargs = {}
    for key, text in options.items():
        if key in OURS:
            raise ValueError(
                f"--task {spec}: option {key!r} is set by data/rg.py (SEED, n_train + n_test), not by --task"
            )
        if key not in fields:
            raise ValueError(
                f"--task {spec}: {config_cls.__name__} has no option {key!r} (it has {', '.join(fields)}; and {SUFFIX}, "
                f"{TRAIN})"
            )
        f = fields[key]
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        kwargs[key] = typed_value(spec, key, text, default)
    try:
        config = config_cls(**kwargs)
        if hasattr(config, "validate"):
            config.validate()
    except (AssertionError, ValueError, TypeError) as e:
        raise ValueError(f"--task {spec}: {config_cls.__name__} refuses {kwargs}: {e or type(e).__name__}") from None
    return config


def rg_rows(name: str, n_train: int = 10000, n_test: int = 500):
    """(train rows, test rows, score) of `name` (the --task value after "rg:", options included): rows {prompt,
    answer, rg_index}; score the reward function."""
    spec = f"rg:{name}"
    try:
        import reasoning_gym
    except ImportError:
        raise ValueError(f"--task {spec} needs the reasoning-gym package: {INSTALL}") from None
    name, _, text = name.partition(":")
    names = sorted(reasoning_gym.factory.DATASETS)
    if name not in names:
        raise ValueError(
            f"--task {spec}: reasoning-gym has no dataset {name!r} (it has {len(names)}: {', '.join(names[:12])}, ...)"
        )
    options = parse_options(spec, text) if text else {}
    suffix = options.pop(SUFFIX, "")
    if TRAIN in options:
        n_train = options.pop(TRAIN)
        if not n_train.isdigit() or int(n_train) < 1:
            raise ValueError(f"--task {spec}: {TRAIN}={n_train!r} must be a whole number of train rows >= 1")
        n_train = int(n_train)
    config = dataset_config(spec, name, options)
    config.seed, config.size = SEED, n_train + n_test  # entry i draws from seed + i
    ds = reasoning_gym.factory.DATASETS[name][0](config=config)
    entries = [ds[i] for i in range(len(ds))]
    seen = {e["question"] for e in entries[:n_train]}
    rows = [
        {
            "prompt": f"{e['question'].rstrip()} {suffix}" if suffix else e["question"],
            "answer": str(e["answer"]),
            "rg_index": i,
        }
        for i, e in enumerate(entries)
    ]
    test = []
    for r, e in zip(rows[n_train:], entries[n_train:]):  # each held-out question once, none a train question
        if e["question"] not in seen:
            seen.add(e["question"])
            test.append(r)
    if not test:
        raise ValueError(
            f"--task {spec}: every one of the {n_test} test questions is also a train question (the config has "
            f"too few distinct questions for disjoint sets): widen its ranges, or give fewer train rows ({TRAIN}=N)"
        )

    def score(completions, *, answer, rg_index, **columns) -> list[float]:
        """reasoning-gym's score_answer of each completion against its entry."""
        return [float(ds.score_answer(answer=c, entry=entries[i])) for c, i in zip(completions, rg_index)]

    score.__name__ = f"reasoning_gym.{name}.score_answer"
    return rows[:n_train], test, score
