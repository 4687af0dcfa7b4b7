"""Tasks: a train/test split of prompts with reference answers, plus the reward function.

A prompt is the user message (the chat template is applied by the rollout engine); an answer is
the exact string the completion must equal. All rewards here are single terminal rewards.

    addition  "042+315" -> "0357"                          (5 response tokens with <|im_end|>)
    sort      "sort: 3 7 1 9 4 2 8 5" -> "1 2 3 4 5 7 8 9"  (16 response tokens: a longer horizon)
    a file    your own {"prompt", "answer"} rows, JSONL or parquet, exact-match reward

`get_task(name)` picks one by name or path.
"""

import json
import math
import numbers
import os
import random
from dataclasses import dataclass
from typing import Callable

import datasets
import pyarrow.parquet
import torch


@dataclass
class Task:
    name: str
    train: datasets.Dataset
    """Columns `prompt` (str, the user message) and `answer` (str)."""
    test: datasets.Dataset
    """Same columns as `train`, prompts disjoint from it. File tasks (load_task) have a third column in both,
    `where` (str): the row's origin for error messages, e.g. "data.jsonl: row 17 (line 18)"."""
    reward_fn: Callable[[list[str], list[str]], list[float]]
    """(completions, answers) -> one float per completion."""
    max_new_tokens: int
    """Generation budget: the longest answer plus slack for <|im_end|> and near misses."""


def exact_match_reward(completions: list[str], answers: list[str]) -> list[float]:
    """1.0 where the completion, stripped of surrounding whitespace, equals the answer, else 0.0."""
    if len(completions) != len(answers):
        raise ValueError(f"exact_match_reward: {len(completions)} completions but {len(answers)} answers")
    return [float(c.strip() == a.strip()) for c, a in zip(completions, answers)]


def _dataset(rows: list[tuple[str, ...]], columns: tuple[str, ...] = ("prompt", "answer")) -> datasets.Dataset:
    return datasets.Dataset.from_dict({c: [row[i] for row in rows] for i, c in enumerate(columns)})


def _split_unique(make_example: Callable[[random.Random], tuple[str, str]], n_train: int, n_test: int,
                  seed: int) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Draw n_train + n_test examples with distinct prompts, so the test prompts never occur in train."""
    rng = random.Random(seed)
    examples: dict[str, str] = {}
    while len(examples) < n_train + n_test:
        prompt, answer = make_example(rng)
        examples.setdefault(prompt, answer)
    pairs = list(examples.items())  # dicts keep insertion order, so this is deterministic for a seed
    return _dataset(pairs[n_test:]), _dataset(pairs[:n_test])


def addition_task(seed: int = 0, n_train: int = 20000, n_test: int = 3000) -> Task:
    """Fixed-width 3-digit addition: prompt "042+315", answer "0357" (always 4 digits, zero padded).

    The fixed width makes every answer 4 digit tokens + <|im_end|> with the byte-level tokenizer.
    """
    if n_train + n_test > 10**6:
        raise ValueError(f"addition_task: only 10^6 distinct problems exist, asked for {n_train + n_test}")

    def make_example(rng: random.Random) -> tuple[str, str]:
        a, b = rng.randrange(1000), rng.randrange(1000)
        return f"{a:03d}+{b:03d}", f"{a + b:04d}"

    train, test = _split_unique(make_example, n_train, n_test, seed)
    return Task("addition", train, test, exact_match_reward, max_new_tokens=8)


def sort_task(seed: int = 0, n_train: int = 20000, n_test: int = 3000, n_numbers: int = 8, digits: int = 1) -> Task:
    """Sort numbers: prompt "sort: 3 7 1 9 4 2 8 5", answer "1 2 3 4 5 7 8 9" (ascending, space separated,
    zero-padded to `digits`).

    The default (8 one-digit numbers) answers in 15 tokens + <|im_end|>, rewarded only as a whole at the end:
    three times addition's horizon, where per-token credit assignment (the critic) matters. The tiny model's
    warm-up learns it in a few CPU-minutes; 5 two-digit numbers stayed near 1% after 800 warm-up steps.
    """
    if n_numbers < 2 or digits < 1:
        raise ValueError(f"sort_task: need n_numbers >= 2 and digits >= 1, got {n_numbers}, {digits}")

    def make_example(rng: random.Random) -> tuple[str, str]:
        numbers = [rng.randrange(10**digits) for _ in range(n_numbers)]
        fmt = lambda xs: " ".join(f"{x:0{digits}d}" for x in xs)  # noqa: E731
        return "sort: " + fmt(numbers), fmt(sorted(numbers))

    train, test = _split_unique(make_example, n_train, n_test, seed)
    answer_tokens = (digits + 1) * n_numbers - 1
    return Task("sort", train, test, exact_match_reward, max_new_tokens=answer_tokens + 8)


def _read_rows(path: str) -> list[tuple[str, dict]]:
    """(where, row) for each row of a .jsonl (one JSON object per line) or .parquet file, in file order.
    `where` names the row for error messages: "row 2 (line 3)" for JSONL, "row 2" for parquet."""
    ext = os.path.splitext(path)[1].lower()
    if ext == ".jsonl":
        rows = []
        with open(path, "rb") as f:  # bytes, so that a decoding error can name its line
            for line_no, raw in enumerate(f, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ValueError(f"{path}: line {line_no} is not valid UTF-8 ({e.reason} at byte {e.start} of the "
                                     "line); the file must be UTF-8 encoded") from None
                if not line.strip():
                    continue
                where = f"row {len(rows)} (line {line_no})"
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}: {where} is not valid JSON: {e}") from None
                if not isinstance(row, dict):
                    raise ValueError(f"{path}: {where} is a {type(row).__name__}, "
                                     "expected a JSON object like {\"prompt\": ..., \"answer\": ...}")
                rows.append((where, row))
        return rows
    if ext == ".parquet":
        # pyarrow directly: Dataset.from_parquet would also write a copy into the HF datasets cache.
        return [(f"row {i}", row) for i, row in enumerate(pyarrow.parquet.read_table(path).to_pylist())]
    raise ValueError(f"{path}: unknown file type {ext!r}; use .jsonl (one JSON object per line) or .parquet")


def load_task(path: str, *, prompt_field: str = "prompt", answer_field: str = "answer",
              test_fraction: float = 0.1, seed: int = 0, max_new_tokens: int | None = None) -> Task:
    """Your own prompts from a JSONL or parquet file, scored by exact match against `answer_field`.

    Every row needs a non-empty string prompt and a string answer; the first row that does not
    have them raises a ValueError naming the file, the row index (0-based; and the line for JSONL)
    and the field.
    A prompt that occurs again is dropped after its first row, so no test prompt is in train: a repeat with
    the same answer is dropped with a printed note, one with a different answer raises a ValueError naming
    both rows.
    The split is a seeded shuffle; `test_fraction` of the distinct prompts (at least one) become the test set.
    `max_new_tokens` defaults to the longest answer in UTF-8 bytes + 8, an upper bound on its token
    count for byte-level BPE tokenizers (every token covers at least one byte).
    """
    if os.path.isdir(path):
        raise IsADirectoryError(f"load_task: {path} is a directory, not a data file; give a .jsonl or .parquet file")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"load_task: no such file: {path}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"load_task: test_fraction must be in (0, 1), got {test_fraction}")
    rows = _read_rows(path)
    if len(rows) < 2:
        raise ValueError(f"{path}: need at least 2 rows (one train, one test), found {len(rows)}")
    first: dict[str, tuple[str, str]] = {}  # prompt -> (where, answer) of its first row
    examples, n_repeats = [], 0
    for where, row in rows:
        for field in (prompt_field, answer_field):
            if field not in row:
                raise ValueError(f"{path}: {where} has no field {field!r} (it has {sorted(row)})")
            if row[field] is None:
                raise ValueError(f"{path}: {where} field {field!r} is null, expected a string")
            if not isinstance(row[field], str):
                raise ValueError(f"{path}: {where} field {field!r} has type {type(row[field]).__name__}, expected a string")
        if not row[prompt_field].strip():
            raise ValueError(f"{path}: {where} field {prompt_field!r} is empty")
        prompt, answer = row[prompt_field], row[answer_field]
        if prompt in first:
            first_where, first_answer = first[prompt]
            if answer != first_answer:
                raise ValueError(f"{path}: {where} repeats the prompt of {first_where} ({prompt!r}) with a different "
                                 f"answer ({answer!r}, not {first_answer!r}); keep one answer per prompt")
            n_repeats += 1
            continue
        first[prompt] = (where, answer)
        examples.append((prompt, answer, f"{path}: {where}"))
    if n_repeats:
        print(f"load_task: {path}: dropped {n_repeats} duplicate rows (same prompt and answer as an earlier row)")
    if len(examples) < 2:
        raise ValueError(f"{path}: need at least 2 distinct prompts (one train, one test), found {len(examples)}")

    random.Random(seed).shuffle(examples)
    n_test = min(len(examples) - 1, max(1, round(test_fraction * len(examples))))
    if max_new_tokens is None:
        max_new_tokens = max(len(a.encode("utf-8")) for _, a, _ in examples) + 8
    name = os.path.splitext(os.path.basename(path))[0]
    columns = ("prompt", "answer", "where")
    return Task(name, _dataset(examples[n_test:], columns), _dataset(examples[:n_test], columns), exact_match_reward,
                max_new_tokens)


def _chat_text(tok, text: str) -> str:
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)


def encode_prompt(tok, text: str) -> list[int]:
    """Token ids of the chat-formatted user turn plus the assistant header (what the policy continues)."""
    return tok(_chat_text(tok, text), add_special_tokens=False).input_ids


def check_lengths(task: Task, tok, context_len: int, max_new_tokens: int) -> None:
    """Refuse, before any training, a task with a prompt (train or test, as encode_prompt encodes it) whose
    tokens + max_new_tokens exceed context_len. The ValueError names the first such row and counts them all."""
    too_long = []  # (where, prompt tokens)
    for split, ds in (("train", task.train), ("test", task.test)):
        if not len(ds):
            continue
        lengths = map(len, tok([_chat_text(tok, p) for p in ds["prompt"]], add_special_tokens=False).input_ids)
        wheres = ds["where"] if "where" in ds.column_names else (f"{task.name}: {split} row {i}" for i in range(len(ds)))
        too_long += [(w, n) for w, n in zip(wheres, lengths) if n + max_new_tokens > context_len]
    if too_long:
        where, n = too_long[0]
        n_rows = len(task.train) + len(task.test)
        raise ValueError(f"check_lengths: {where}: the prompt is {n} tokens (chat-formatted) + max_new_tokens "
                         f"{max_new_tokens} = {n + max_new_tokens}, over the context length {context_len}; shorten "
                         f"the prompt or lower --max-new-tokens, or drop the row. {len(too_long)} of {n_rows} rows "
                         f"are too long, the longest prompt is {max(n for _, n in too_long)} tokens")


def score(task: Task, completions: list[str], answers: list[str]) -> torch.Tensor:
    """Run the task's reward function, refusing anything but one finite float per completion."""
    fn = getattr(task.reward_fn, "__name__", repr(task.reward_fn))
    try:
        rewards = task.reward_fn(completions, answers)
    except Exception as e:
        for i, (c, a) in enumerate(zip(completions, answers)):  # find the sample that breaks it
            try:
                task.reward_fn([c], [a])
            except Exception:
                raise RuntimeError(f"reward function {fn} raised on sample {i} (completion {c!r}, answer {a!r}): {e!r}") from e
        raise RuntimeError(f"reward function {fn} raised on the batch: {e!r}") from e
    n = len(rewards) if hasattr(rewards, "__len__") else None
    if n != len(completions):
        raise RuntimeError(f"reward function {fn} returned {type(rewards).__name__} of length {n} for {len(completions)} "
                           "completions; it must return one float per completion")
    f32_max = torch.finfo(torch.float32).max
    for i, r in enumerate(rewards):
        # numpy scalars are Real too; an int is finite however large (math.isfinite would overflow on it)
        if not isinstance(r, numbers.Real) or not (isinstance(r, numbers.Integral) or math.isfinite(r)):
            raise RuntimeError(f"reward function {fn} returned {r!r} for sample {i} (completion {completions[i]!r}); "
                               "rewards must be finite numbers")
        if abs(r) > f32_max:
            raise RuntimeError(f"reward function {fn} returned {r!r} for sample {i} (completion {completions[i]!r}), "
                               f"which is inf in float32 (|r| > {f32_max:.6g}); rewards must be finite in float32")
    return torch.tensor([float(r) for r in rewards])


TASKS = {"addition": addition_task, "sort": sort_task}


def get_task(name: str) -> Task:
    """A built-in task by name ("addition", "sort") or a user file (.jsonl / .parquet) by path."""
    if name in TASKS:
        return TASKS[name]()
    if name.lower().endswith((".jsonl", ".parquet")):
        return load_task(name)
    raise ValueError(f"unknown task {name!r}: choose one of {sorted(TASKS)} or give a path to a "
                     ".jsonl / .parquet file with 'prompt' and 'answer' fields")
