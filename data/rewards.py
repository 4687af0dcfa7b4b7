"""Reward functions (`--reward`) and the evaluation metrics over their results (pass@k, maj@k).

One signature for every reward, built-in or yours:

    fn(completions, *, prompts, answer, **columns) -> list[float | None | dict]

`completions` are the decoded responses; `prompts` the prompts as the data holds them (a string, or a list
of chat messages); `answer` the reference answers; every other dataset column arrives by name as a list
aligned with `completions` (the internal `where` column is not passed). One item per completion:

    a number   the reward (finite in float32)
    None       no reward for this sample: it is left out of training (docs/algorithms.md, section 3)
    a dict     {"score": number or None, ...}: numeric extra keys are logged as reward/<key>; "pred" (any
               hashable) is the sample's final answer, used for majority voting (maj@k)

`load_reward(spec)` resolves a --reward value: "" or "exact" (the default exact match), "math",
"path/to/file.py:function" or "package.module:function". `score` runs a task's reward on completions and checks
what it returns.
"""

import functools
import importlib
import importlib.util
import math
import numbers
import os
import re
import sys
from collections import Counter
from typing import Callable, Hashable, NamedTuple

import torch


def exact_match_reward(completions: list[str], answers: list[str]) -> list[float]:
    """1.0 where the completion, stripped of surrounding whitespace, equals the answer, else 0.0."""
    if len(completions) != len(answers):
        raise ValueError(f"exact_match_reward: {len(completions)} completions but {len(answers)} answers")
    return [float(c.strip() == a.strip()) for c, a in zip(completions, answers)]


def exact(completions: list[str], *, answer: list[str], **columns) -> list[float]:
    """The default reward: exact match of the stripped completion against the answer column."""
    return exact_match_reward(completions, answer)


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def extract_answer(text: str) -> str | None:
    """The final answer of a completion: the content of its last \\boxed{...} (braces matched), else its last
    number (commas between digit groups removed), else None."""
    start = text.rfind("\\boxed{")
    if start >= 0:
        depth, i = 0, start + len("\\boxed")
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[i + 1 : j].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


@functools.cache
def _math_verify():
    try:
        import math_verify
    except ImportError:
        raise ImportError("--reward math needs the math-verify package: pip install 'math-verify==0.9.0'") from None
    math_verify.parse("$1$", parsing_timeout=None)  # first call builds the LaTeX parser (seconds): not under a timeout
    return math_verify


def math_reward(completions: list[str], *, answer: list[str], **columns) -> list[dict]:
    """1.0 where the completion's final answer (extract_answer) is mathematically equal to the answer column,
    checked by math-verify (1/2 = 0.5 = \\frac{1}{2}, 3 = 3.0), else 0.0; "pred" is the extracted answer string
    (None when there is none), so equal strings vote together in maj@k."""
    mv = _math_verify()
    out = []
    for c, a in zip(completions, answer, strict=True):
        pred = extract_answer(c)
        ok = pred is not None and mv.verify(mv.parse(f"${a}$"), mv.parse(f"${pred}$"))
        out.append({"score": float(ok), "pred": pred})
    return out


SPEC_FORMS = "'' or 'exact' (exact match), 'math', 'path/to/file.py:function' or 'package.module:function'"


@functools.cache
def import_target(spec: str, flag: str, noun: str, forms: str):
    """(module, where, name) for a plug-in named 'path/to/file.py:name' or 'package.module:name' (--reward, --env).
    A file is executed once per process (cached). A bad form, a missing file or module, one that fails to import:
    a ValueError naming the flag."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise ValueError(f"{flag} {spec!r} is not {noun}: give {forms}")
    if where.endswith(".py") or os.sep in where:
        if not os.path.isfile(where):
            raise ValueError(f"{flag} {spec!r}: no such file {where!r}")
        mod_name = "plugin_" + re.sub(r"\W", "_", os.path.abspath(where))
        mspec = importlib.util.spec_from_file_location(mod_name, where)
        module = importlib.util.module_from_spec(mspec)
        sys.modules[mod_name] = module  # so dataclasses and pickling inside the file work
        try:
            mspec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[mod_name]
            raise ValueError(f"{flag} {spec!r}: running {where} raised {e!r}") from e
        return module, where, name
    try:
        return importlib.import_module(where), where, name
    except Exception as e:
        raise ValueError(f"{flag} {spec!r}: cannot import module {where!r} ({e!r}); give a module on the Python path "
                         "or a path to a .py file") from e


def load_reward(spec: str) -> Callable:
    """The reward function a --reward value names (see the module docstring). Every problem, a bad form, a
    missing file or module, one that fails to import, a missing or non-callable function, is a ValueError
    naming --reward and what was wrong. Cached, so a file is executed once per process."""
    if spec in ("", "exact"):
        return exact
    if spec == "math":
        try:
            _math_verify()
        except ImportError as e:
            raise ValueError(str(e)) from None
        return math_reward
    module, where, name = import_target(spec, "--reward", "a reward", SPEC_FORMS)
    if not hasattr(module, name):
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise ValueError(f"--reward {spec!r}: {where} has no function {name!r} (its callables: {', '.join(found) or 'none'})")
    fn = getattr(module, name)
    if not callable(fn):
        raise ValueError(f"--reward {spec!r}: {where}:{name} is a {type(fn).__name__}, not a function")
    return fn


# ----------------------------------------------------------------------------- scoring completions


class Scores(NamedTuple):
    rewards: torch.Tensor
    """[N] float32; 0 where there is no reward."""
    rewarded: torch.Tensor
    """[N] bool: False where the reward function returned None (or a dict whose score is None)."""
    extras: list[dict]
    """Per sample, the keys of a returned dict other than "score" ({} for a plain number or None)."""

    @classmethod
    def of(cls, rewards: torch.Tensor) -> "Scores":
        """Every sample rewarded, no extra keys."""
        return cls(rewards.float(), torch.ones(len(rewards), dtype=torch.bool), [{} for _ in range(len(rewards))])


def reward_columns(ds, n: int = 1) -> dict[str, list]:
    """The columns of `ds` (a datasets.Dataset) a reward receives (all but `where`), each row repeated n times (n samples
    per prompt)."""
    return {k: [v for v in ds[k] for _ in range(n)] for k in ds.column_names if k != "where"}


def score(task, completions: list[str], columns: dict[str, list]) -> Scores:
    """Run the task's reward function (task: a data.tasks.Task) on completions and the dataset columns aligned with them ("prompt" and
    "answer" among them; reward_columns): fn(completions, prompts=, answer=, **other columns). Refuses anything
    but one finite number, None or dict with "score" per completion, naming the function and the sample."""
    fn = getattr(task.reward_fn, "__name__", repr(task.reward_fn))
    args = lambda rows: {"prompts": [columns["prompt"][i] for i in rows], "answer": [columns["answer"][i] for i in rows],  # noqa: E731
                         **{k: [v[i] for i in rows] for k, v in columns.items() if k not in ("prompt", "answer")}}
    for k, v in columns.items():
        if len(v) != len(completions):
            raise ValueError(f"score: column {k!r} has {len(v)} values for {len(completions)} completions")
    try:
        rewards = task.reward_fn(completions, **args(range(len(completions))))
    except Exception as e:
        for i, c in enumerate(completions):  # find the sample that breaks it
            try:
                task.reward_fn([c], **args([i]))
            except Exception:
                raise RuntimeError(f"reward function {fn} raised on sample {i} (completion {c!r}, answer "
                                   f"{columns['answer'][i]!r}): {e!r}") from e
        raise RuntimeError(f"reward function {fn} raised on the batch: {e!r}") from e
    n = len(rewards) if hasattr(rewards, "__len__") else None
    if n != len(completions):
        raise RuntimeError(f"reward function {fn} returned {type(rewards).__name__} of length {n} for {len(completions)} "
                           "completions; it must return one float, None or dict per completion")
    f32_max = torch.finfo(torch.float32).max
    values, extras = [], []
    for i, r in enumerate(rewards):
        extra = {}
        if isinstance(r, dict):
            if "score" not in r:
                raise RuntimeError(f"reward function {fn} returned a dict without 'score' for sample {i} (completion "
                                   f"{completions[i]!r}; keys {sorted(r)}); a dict needs 'score' (a number, or None)")
            extra = {k: v for k, v in r.items() if k != "score"}
            if "pred" in extra and not isinstance(extra["pred"], Hashable):
                raise RuntimeError(f"reward function {fn} returned an unhashable 'pred' {extra['pred']!r} for sample {i}; "
                                   "'pred' is voted on (maj@k): use a string, number or tuple")
            r = r["score"]
        extras.append(extra)
        if r is None:
            values.append(None)
            continue
        # numpy scalars are Real too; an int is finite however large (math.isfinite would overflow on it)
        if not isinstance(r, numbers.Real) or not (isinstance(r, numbers.Integral) or math.isfinite(r)):
            raise RuntimeError(f"reward function {fn} returned {r!r} for sample {i} (completion {completions[i]!r}); "
                               "rewards must be finite numbers (or None: no reward)")
        if abs(r) > f32_max:
            raise RuntimeError(f"reward function {fn} returned {r!r} for sample {i} (completion {completions[i]!r}), "
                               f"which is inf in float32 (|r| > {f32_max:.6g}); rewards must be finite in float32")
        values.append(float(r))
    rewarded = torch.tensor([v is not None for v in values], dtype=torch.bool)
    return Scores(torch.tensor([0.0 if v is None else v for v in values]), rewarded, extras)


# ----------------------------------------------------------------------------- evaluation metrics


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021): 1 - C(n-c, k) / C(n, k),
    computed as 1 - prod_{i=n-c+1}^{n} (1 - k / i), which never forms the (huge) binomials."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def majority_correct(preds: list[Hashable | None], rewards: list[float], k: int) -> bool:
    """maj@k of one problem: the most frequent pred among the first k samples (a None pred does not vote; ties go
    to the pred seen first) is correct when the first of those samples with that pred has reward > 0. No vote at
    all is incorrect."""
    votes = Counter(p for p in preds[:k] if p is not None)
    if not votes:
        return False
    top = max(votes.values())
    first = next(i for i, p in enumerate(preds[:k]) if p is not None and votes[p] == top)  # first occurrence wins ties
    return rewards[first] > 0
