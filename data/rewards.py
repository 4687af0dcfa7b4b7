"""Reward functions (`--reward`) and the evaluation metrics over their results (pass@k, maj@k).

One signature for every reward, built-in or yours:

    fn(completions, *, prompts, answer, **columns) -> list[float | None | dict]

`completions` are the decoded responses; `prompts` the prompts as the data holds them (a string, or a list
of chat messages); `answer` the reference answers; every other dataset column arrives by name as a list
aligned with `completions` (the internal `where` column is not passed). One item per completion, in their order, in a
list, a tuple or a 1-D array (numpy, torch) of that length (per_sample; a dict, a set, a string or an iterator is
refused):

    a number   the reward (finite in float32)
    None       no reward for this sample: it is left out of training (docs/algorithms.md, section 3)
    a dict     {"score": number or None, ...}: numeric extra keys are logged as reward/<key>; "pred" (any
               hashable) is the sample's final answer, used for majority voting (maj@k)

`load_reward(spec)` resolves a --reward value: "" or "exact" (the default exact match), "math",
"path/to/file.py:function" or "package.module:function"; `check_reward` checks, before any model loads, that it can
take the columns of the data. `score` runs a task's reward on copies of the completions and columns and checks what
it returns. `call_user` is how user code (a reward, an environment's methods) runs: in a worker thread, with a time
limit (--user-timeout), and a sys.exit inside it is an error, as it is at import (import_target).
"""

import copy
import functools
import importlib
import importlib.util
import inspect
import itertools
import math
import numbers
import os
import queue
import re
import reprlib
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
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
        depth = 0
        i = start + len("\\boxed")
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


def _verify(mv, answer: str, pred: str) -> tuple[bool, bool]:
    """(equal, timed out): mv.verify(mv.parse(answer), mv.parse(pred)) step by step, so that a step past math-verify's
    own 5 s limit is counted instead of silently scoring 0. raise_on_error=True makes a timeout raise math-verify's
    TimeoutException (a BaseException); any other error counts as unequal (a parse as nothing parsed), as math-verify's
    default does, and each (gold, target) pair is compared on its own, as verify does."""
    late = False

    def attempt(f, *args, failed):
        nonlocal late
        try:
            return f(*args, raise_on_error=True)
        except Exception:
            return failed
        except mv.errors.TimeoutException:
            late = True
            return failed

    gold = attempt(mv.parse, f"${answer}$", failed=[])
    target = attempt(mv.parse, f"${pred}$", failed=[])
    return any(attempt(mv.verify, g, t, failed=False) for g, t in itertools.product(gold, target)), late


def math_reward(completions: list[str], *, answer: list[str], **columns) -> list[dict]:
    """1.0 where the completion's final answer (extract_answer) is mathematically equal to the answer column,
    checked by math-verify (1/2 = 0.5 = \\frac{1}{2}, 3 = 3.0), else 0.0; "pred" is the extracted answer string
    (None when there is none), so equal strings vote together in maj@k; "math_timeout" is 1.0 where a parse or
    comparison ran past math-verify's 5 s limit (scored 0), logged as reward/math_timeout (the fraction of samples)."""
    mv = _math_verify()
    out = []
    for c, a in zip(completions, answer, strict=True):
        pred = extract_answer(c)
        ok, late = _verify(mv, a, pred) if pred is not None else (False, False)
        out.append({"score": float(ok), "pred": pred, "math_timeout": float(late)})
    return out


SPEC_FORMS = "'' or 'exact' (exact match), 'math', 'path/to/file.py:function' or 'package.module:function'"
_EXIT_HINT = " (user code must return or raise an Exception: the run stops here)"


def exited(e: BaseException) -> str:
    """What user code did that raised `e`, a BaseException that is not an Exception, as a verb phrase."""
    return f"called sys.exit({e.code!r})" if isinstance(e, SystemExit) else f"raised {e!r}"


@functools.cache
def import_target(spec: str, flag: str, noun: str, forms: str):
    """(module, where, name) for a plug-in named 'path/to/file.py:name' or 'package.module:name' (--reward, --env).
    A file is executed once per process (cached). A bad form, a missing file or module, one that fails to import,
    raising anything but KeyboardInterrupt (sys.exit included, which would otherwise end the run with its status):
    a ValueError naming the flag and the file."""
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
        except BaseException as e:  # sys.exit at its top level included: it would end the run with its status
            del sys.modules[mod_name]
            if isinstance(e, KeyboardInterrupt):
                raise
            if isinstance(e, Exception):
                raise ValueError(f"{flag} {spec!r}: running {where} raised {e!r}") from e
            raise ValueError(
                f"{flag} {spec!r}: {where} {exited(e)} at import (a file given to {flag} must not exit when "
                "imported: the run stops here)"
            ) from e
        return module, where, name
    try:
        return importlib.import_module(where), where, name
    except KeyboardInterrupt:
        raise
    except Exception as e:
        raise ValueError(
            f"{flag} {spec!r}: cannot import module {where!r} ({e!r}); give a module on the Python path "
            "or a path to a .py file"
        ) from e
    except BaseException as e:
        raise ValueError(
            f"{flag} {spec!r}: module {where!r} {exited(e)} at import (a module given to {flag} must not exit "
            "when imported: the run stops here)"
        ) from e


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
        raise ValueError(
            f"--reward {spec!r}: {where} has no function {name!r} (its callables: {', '.join(found) or 'none'})"
        )
    fn = getattr(module, name)
    if not callable(fn):
        raise ValueError(f"--reward {spec!r}: {where}:{name} is a {type(fn).__name__}, not a function")
    return fn


# ----------------------------------------------------------------------------- running user code

DEFAULT_USER_TIMEOUT = 120.0  # seconds (--user-timeout): far above any sound reward batch or environment step


class UserCodeError(RuntimeError):
    """User code `what` exited (sys.exit, or another BaseException that is not an Exception) or ran past its time limit; `why`
    says which, as a verb phrase ("called sys.exit(0)", "did not return within 2 s (--user-timeout)")."""

    def __init__(self, what: str, why: str):
        super().__init__(f"{what} {why}")
        self.what = what
        self.why = why


class UserTimeout(UserCodeError):
    """User code ran past --user-timeout; its thread is left running (a thread cannot be stopped), and ends with the process."""


class _Worker:
    """One daemon thread that runs user code. The same thread for every call, so what a reward or an environment ties
    to its thread (an sqlite3 connection, a thread-local) keeps working from call to call; a daemon thread, so a hung
    call does not keep the process from exiting (concurrent.futures joins its workers at exit: a hang would hang it)."""

    def __init__(self, depth: int):
        self.pid = os.getpid()
        self.jobs = queue.SimpleQueue()
        t = threading.Thread(target=self._loop, name=f"user-code-{depth}", daemon=True)
        t.user_depth = depth  # user code it runs that calls user code (a tool environment's step calling a tool) nests
        t.start()

    def _loop(self):
        while True:
            fn, args, kw, box, done = self.jobs.get()
            try:
                box.append((True, fn(*args, **kw)))
            except BaseException as e:  # a thread ends silently on SystemExit: it must reach the caller
                box.append((False, e))
            del fn, args, kw  # the call's arguments are not kept alive until the next job
            done.set()


_workers: dict[int, _Worker] = {}  # by depth: the worker that runs user code called from depth-1 user code


def call_user(fn: Callable, *args, timeout: float, what: str, flag: str = "--user-timeout", **kw):
    """fn(*args, **kw), user code named `what` in errors ("reward function my_reward", "environment MyEnv.step"), run
        in the worker thread and waited for at most `timeout` seconds; timeout 0 = no limit, called in this thread (where
        code that sets signals, such as math-verify's own timeouts, works). An Exception fn raises passes through unchanged
        (the caller names the sample or turn); KeyboardInterrupt too. Any other BaseException (SystemExit from sys.exit)
        is a UserCodeError, and a call past the limit a UserTimeout: the run ends with an error, never with exit 0. A call
    from inside user code (a tool environment's step calling a tool) runs in a worker of its own, one level deeper, so
    the inner limit holds within the outer one. flag: the option that sets the limit, named in the timeout's message."""
    if timeout:
        depth = getattr(threading.current_thread(), "user_depth", 0)
        worker = _workers.get(depth)
        if worker is None or worker.pid != os.getpid():  # a forked child has the object but not the thread
            worker = _workers[depth] = _Worker(depth + 1)
        box = []
        done = threading.Event()
        worker.jobs.put((fn, args, kw, box, done))
        if not done.wait(timeout):
            del _workers[depth]  # the thread stays in the hung call; the next call gets a new one
            raise UserTimeout(what, f"did not return within {timeout:g} s ({flag})")
        ok, out = box[0]
    else:
        try:
            ok, out = True, fn(*args, **kw)
        except BaseException as e:
            ok, out = False, e
    if ok:
        return out
    if isinstance(out, (Exception, KeyboardInterrupt)):
        raise out
    raise UserCodeError(what, exited(out) + _EXIT_HINT) from out


def failure(what: str, e: BaseException, where: str) -> str:
    """The error message for user code `what` that failed with `e` on `where` (a sample, an episode's turn)."""
    if isinstance(e, UserCodeError):  # e.what: the innermost call, e.g. the tool a tool environment's step called
        return f"{e.what} {e.why} on {where}"
    hint = ""
    if "main thread" in str(e):  # math-verify's timeouts (signal.alarm) inside a user reward, for one
        hint = (
            " (user code runs in a worker thread under --user-timeout, where signals cannot be set: turn off the "
            "library's own timeout, e.g. math-verify's parsing_timeout=None and timeout_seconds=None, since "
            "--user-timeout bounds the call, or pass --user-timeout 0 to run it in the main thread with no limit)"
        )
    return f"{what} raised on {where}: {e!r}{hint}"


def check_reward(fn: Callable, columns: list[str]) -> None:
    """Refuse, before any model loads, a reward function that cannot be called as `score` calls it on data with these
    columns: fn(completions, prompts=, answer=, every other column by name). A ValueError naming --reward, the
    function and what it cannot take."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return
    names = ["prompts", "answer", *(c for c in columns if c not in ("prompt", "answer", "where"))]
    try:
        sig.bind([], **dict.fromkeys(names))
        return
    except TypeError as e:
        error = str(e)
    ps = sig.parameters
    var_kw = any(p.kind is p.VAR_KEYWORD for p in ps.values())

    def takes(n):
        return n in ps and ps[n].kind in (ps[n].POSITIONAL_OR_KEYWORD, ps[n].KEYWORD_ONLY)

    no = [n for n in names if not takes(n)]  # columns it has no parameter for
    # parameters after the completions that no column fills
    need = [
        n
        for n, p in list(ps.items())[1:]
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and n not in names
    ]
    if not ps or next(iter(ps.values())).kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.VAR_KEYWORD):
        error = "it takes no positional argument (the completions)"
    elif not var_kw and no:
        error = f"it has no parameter {no[0]!r} and no **kwargs"
    elif need:
        error = f"it needs {need[0]!r}, which is no column of the data"
    name = getattr(fn, "__qualname__", repr(fn))
    raise ValueError(
        f"--reward: the reward function {name} cannot take what score passes it, {name}(completions, "
        f"{', '.join(n + '=' for n in names)}): {error}. Give it these parameters or **columns (docs/byo.md)"
    )


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


def per_sample(rewards, n: int, what: str) -> list:
    """The n per-sample results of a reward's return value `rewards`, in the order of the completions: a list, a tuple
    (any Sequence but str and bytes) or a 1-D array (numpy, torch) of length n. Anything else is a RuntimeError
    naming `what`, the type and a short repr: a Mapping would be read as its keys, a set in hash order, a string as
    its characters, an iterator's items computed here, outside --user-timeout; a wrong length matches no sample."""
    kind = type(rewards).__name__
    array = hasattr(rewards, "ndim") and hasattr(rewards, "tolist")  # numpy, torch: tolist gives Python numbers
    if array:
        shape = tuple(rewards.shape)
        ok = shape == (n,)
        kind += f" of shape {shape}"
    else:
        ok = isinstance(rewards, Sequence) and not isinstance(rewards, (str, bytes, bytearray, memoryview))
        ok = ok and len(rewards) == n
        if hasattr(rewards, "__len__"):
            kind += f" of length {len(rewards)}"
    if ok:
        return rewards.tolist() if array else list(rewards)
    why = ""
    if isinstance(rewards, Mapping):
        why = " (a mapping: it would be read as its keys)"
    elif isinstance(rewards, (set, frozenset)):
        why = " (a set: it has no order)"
    elif isinstance(rewards, (str, bytes, bytearray)):
        why = " (a string: it would be read as its characters)"
    elif isinstance(rewards, Iterator):
        why = " (an iterator: its items would be computed outside --user-timeout)"
    shown = " ".join(reprlib.repr(rewards).split())  # on one line: a 2-D array's repr has several
    raise RuntimeError(
        f"{what} returned {kind} for {n} completions{why}: {shown}; it must return a list (or a tuple, a 1-D numpy "
        "array or torch tensor) of one float, None or dict per completion, in their order"
    )


def score(task, completions: list[str], columns: dict[str, list]) -> Scores:
    """Run the task's reward function (task: a data.tasks.Task) on copies of the completions and of the dataset columns
    aligned with them ("prompt" and "answer" among them; reward_columns): fn(completions, prompts=, answer=, **other
    columns), so a reward that edits them changes neither training nor the samples file. One call over the batch,
    with task.user_timeout (call_user; the built-in rewards run in this thread: they cannot hang). When the call
    raises, the samples are tried one by one to name the first that fails alone, within what is left of the same
    time limit; a call past the limit is not retried, so a reward that hangs stops the run after one --user-timeout.
    Refuses anything but a sequence (per_sample) of one finite number, None or dict with "score" per completion,
    naming the function and the sample."""
    fn = getattr(task.reward_fn, "__name__", repr(task.reward_fn))
    what = f"reward function {fn}"
    for k, v in columns.items():
        if len(v) != len(completions):
            raise ValueError(f"score: column {k!r} has {len(v)} values for {len(completions)} completions")
    limit = 0 if task.reward_fn in (exact, math_reward) else task.user_timeout
    deadline = time.monotonic() + (limit or math.inf)  # one budget for the batch and the probe that follows it

    def call(rows, timeout):
        kw = copy.deepcopy(
            {
                "prompts": [columns["prompt"][i] for i in rows],
                "answer": [columns["answer"][i] for i in rows],
                **{k: [v[i] for i in rows] for k, v in columns.items() if k not in ("prompt", "answer")},
            }
        )
        return call_user(task.reward_fn, [completions[i] for i in rows], **kw, timeout=timeout, what=what)

    try:
        rewards = call(range(len(completions)), limit)
    except UserTimeout as e:  # the budget is spent: a probe would wait as long again, and the run stops anyway
        raise RuntimeError(
            failure(what, e, f"a batch of {len(completions)} samples")
            + f" (a batch's reward calls get {limit:g} s in all: raise --user-timeout, or 0 for no limit)"
        ) from e
    except Exception as e:
        in_batch = failure(what, e, f"a batch of {len(completions)} samples")
        for i, c in enumerate(completions):  # find the sample that breaks it
            sample = f"sample {i} (completion {c!r}, answer {columns['answer'][i]!r})"
            ran_out = f"when the batch's {limit:g} s (--user-timeout) ran out" + (
                " (the samples before it passed alone)" if i else ""
            )
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"{in_batch}; alone, {sample} had not started {ran_out}") from e
            try:
                call([i], left if limit else 0)
            except UserTimeout as e1:
                raise RuntimeError(f"{in_batch}; alone, {sample} was still running {ran_out}") from e1
            except Exception as e1:
                raise RuntimeError(failure(what, e1, sample)) from e1
        raise RuntimeError(
            failure(what, e, "the batch") + f" (each of its {len(completions)} samples alone passed)"
        ) from e
    rewards = per_sample(rewards, len(completions), what)
    f32_max = torch.finfo(torch.float32).max
    values, extras = [], []
    for i, r in enumerate(rewards):
        extra = {}
        if isinstance(r, dict):
            if "score" not in r:
                raise RuntimeError(
                    f"reward function {fn} returned a dict without 'score' for sample {i} (completion "
                    f"{completions[i]!r}; keys {sorted(r)}); a dict needs 'score' (a number, or None)"
                )
            extra = {k: v for k, v in r.items() if k != "score"}
            if "pred" in extra and not isinstance(extra["pred"], Hashable):
                raise RuntimeError(
                    f"reward function {fn} returned an unhashable 'pred' {extra['pred']!r} for sample {i}; "
                    "'pred' is voted on (maj@k): use a string, number or tuple"
                )
            r = r["score"]
        extras.append(extra)
        if r is None:
            values.append(None)
            continue
        # numpy scalars are Real too; an int is finite however large (math.isfinite would overflow on it)
        if not isinstance(r, numbers.Real) or not (isinstance(r, numbers.Integral) or math.isfinite(r)):
            raise RuntimeError(
                f"reward function {fn} returned {r!r} for sample {i} (completion {completions[i]!r}); "
                "rewards must be finite numbers (or None: no reward)"
            )
        if abs(r) > f32_max:
            raise RuntimeError(
                f"reward function {fn} returned {r!r} for sample {i} (completion {completions[i]!r}), "
                f"which is inf in float32 (|r| > {f32_max:.6g}); rewards must be finite in float32"
            )
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
