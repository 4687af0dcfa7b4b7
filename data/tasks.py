"""Tasks: a train/test split of prompts with reference answers, plus the reward function.

A prompt is the user message, or a list of chat messages (the chat template is applied once, by
encode_prompt); an answer is the reference string the reward compares with. All rewards here are single
terminal rewards; data/rewards.py holds the built-ins, the loader of --reward and `score`, which runs them.

    addition  "042+315" -> "0357"                          (5 response tokens with <|im_end|>)
    sort      "sort: 3 7 1 9 4 2 8 5" -> "1 2 3 4 5 7 8 9"  (16 response tokens: a longer horizon)
    guess     "guess 23-87", then a number per turn, answered "<", ">" or "?"  (multi-turn: data/guess.py)
    walk      "wind 9: 3 to go, 5 left", then "1" (step) or "2" (jump) per turn, a gust after turn 1  (data/walk.py)
    your data a .jsonl / .json / .csv / .parquet file, a datasets.save_to_disk folder or a hub name (load_task)

`get_task(name, ...)` picks one by name or path; BUILTIN says what each built-in task is (multi-turn, a tool
environment, its default model's warm-up) before it is built.
"""

import csv
import functools
import json
import numbers
import os
import random
import re
import stat
import socket
import urllib.parse
from dataclasses import dataclass
from typing import Callable

import datasets
import pyarrow.parquet
import torch

from data.calc import MAX_TURNS as CALC_TURNS, CalcTools, calc_rows
from data.calc import demo_move as calc_move
from data.guess import MAX_TURNS, GuessEnv, guess_rows
from data.rewards import DEFAULT_USER_TIMEOUT, check_reward, exact
from data.rg import rg_rows
from data.walk import TURNS, WalkEnv, walk_rows
from data.walk import demo_move as walk_move


@dataclass
class Task:
    name: str
    train: datasets.Dataset
    """Columns `prompt` (str, or a list of chat messages) and `answer` (str); file tasks keep their other columns."""
    test: datasets.Dataset
    """Same columns as `train`, prompts disjoint from it. File tasks (load_task) also have `where` in both
    (str): the row's origin for error messages, e.g. "data.jsonl: row 17 (line 18)"."""
    reward_fn: Callable[..., list]
    """fn(completions, *, prompts, answer, **columns) -> one float, None or dict per completion (data/rewards.py)."""
    max_new_tokens: int
    """Generation budget: the longest answer plus slack for <|im_end|> and near misses (per turn for multi-turn tasks)."""
    env: type | None = None
    """Multi-turn tasks: the environment class (agent.py); its step() gives the rewards, reward_fn is unused."""
    max_turns: int = 1
    """Multi-turn tasks: the default turn budget (--max-turns)."""
    user_timeout: float = DEFAULT_USER_TIMEOUT
    """Seconds per call of the reward function (over a batch) or of the environment's reset or step; 0 = no limit."""


def _dataset(rows: list[tuple[str, ...]], columns: tuple[str, ...] = ("prompt", "answer")) -> datasets.Dataset:
    return datasets.Dataset.from_dict({c: [row[i] for row in rows] for i, c in enumerate(columns)})


def _split_unique(
    make_example: Callable[[random.Random], tuple[str, str]], n_train: int, n_test: int, seed: int
) -> tuple[datasets.Dataset, datasets.Dataset]:
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
    return Task("addition", train, test, exact, max_new_tokens=8)


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

        def fmt(xs):
            return " ".join(f"{x:0{digits}d}" for x in xs)

        return "sort: " + fmt(numbers), fmt(sorted(numbers))

    train, test = _split_unique(make_example, n_train, n_test, seed)
    answer_tokens = (digits + 1) * n_numbers - 1
    return Task("sort", train, test, exact, max_new_tokens=answer_tokens + 8)


FILE_TYPES = (".jsonl", ".json", ".csv", ".parquet")
# Column names the project uses itself: a data column of that name would be overwritten or clash with a
# reward argument.
RESERVED = ("where", "prompts", "completions")


def _read_rows(path: str) -> list[tuple[str, dict]]:
    """(where, row) for each row of a .jsonl / .json / .csv / .parquet file, in file order. `where` names the row
    for error messages: "row 2 (line 3)" for JSONL (and .json holding JSON lines) and CSV, "row 2" otherwise.
    Text files are UTF-8, with or without the byte-order mark that Excel and Windows editors write."""
    ext = os.path.splitext(path)[1].lower()
    if ext == ".json":  # a list of objects, or JSON lines under a .json name
        with open(path, "rb") as f:
            raw = f.read()
        try:
            data = json.loads(raw.decode("utf-8-sig"))
        except UnicodeDecodeError:
            data = None  # _read_json_lines names the line
        except json.JSONDecodeError as e:
            if "Extra data" not in e.msg:  # not several JSON values: a broken file
                raise ValueError(f"{path}: not valid JSON: {e}") from None
            data = None
        values = list(data.values()) if isinstance(data, dict) else []
        if len(values) > 1 and (all(isinstance(v, dict) for v in values) or all(isinstance(v, list) for v in values)):
            raise ValueError(
                f"{path}: holds one JSON object of columns ({', '.join(map(str, data))}), as pandas' "
                "DataFrame.to_json() and Dataset.to_dict() write them; write one object per row: "
                "df.to_json(path, orient='records'), or lines=True for a .jsonl"
            )
        if data is None or isinstance(data, dict):
            return _read_json_lines(path)
        if not isinstance(data, list):
            raise ValueError(
                f"{path}: holds a JSON {type(data).__name__}, expected a list of objects like "
                '[{"prompt": ..., "answer": ...}] or one object per line'
            )
        for i, row in enumerate(data):
            if not isinstance(row, dict):
                raise ValueError(
                    f"{path}: row {i} is a {type(row).__name__}, expected a JSON object like "
                    '{"prompt": ..., "answer": ...}'
                )
        return [(f"row {i}", row) for i, row in enumerate(data)]
    if ext == ".jsonl":
        return _read_json_lines(path)
    if ext == ".csv":
        try:
            with open(path, newline="", encoding="utf-8-sig") as f:
                reader = csv.DictReader(f)
                rows = [(f"row {i} (line {reader.line_num})", row) for i, row in enumerate(reader)]
        except UnicodeDecodeError as e:
            raise ValueError(
                f"{path}: not valid UTF-8 ({e.reason} at byte {e.start}); the file must be UTF-8 encoded"
            ) from None
        header = reader.fieldnames or []
        sep = None
        if len(header) == 1:
            sep = next((c for c in ";\t|" if c in header[0]), None)
        if sep:
            raise ValueError(
                f"{path}: its header is one column, {header[0]!r}: the file must be comma-separated, not "
                f'{sep!r}-separated (in Excel: save as "CSV UTF-8 (comma delimited)")'
            )
        for where, row in rows:  # DictReader files a row's surplus fields under None and fills missing ones with None
            if None in row or None in row.values():
                n = sum(v is not None for k, v in row.items() if k is not None) + len(row.get(None, ()))
                raise ValueError(
                    f"{path}: {where} has {n} field(s) where the header has {len(header)} ({', '.join(header)}); "
                    'quote a field that holds a comma ("a, b")'
                )
        return rows
    if ext == ".parquet":
        # pyarrow directly: Dataset.from_parquet would also write a copy into the HF datasets cache.
        return [(f"row {i}", row) for i, row in enumerate(pyarrow.parquet.read_table(path).to_pylist())]
    raise ValueError(
        f"{path}: unknown file type {ext!r}; use {', '.join(FILE_TYPES)} or a datasets.save_to_disk folder"
    )


def _read_json_lines(path: str) -> list[tuple[str, dict]]:
    rows = []
    with open(path, "rb") as f:  # bytes, so that a decoding error can name its line
        for line_no, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{path}: line {line_no} is not valid UTF-8 ({e.reason} at byte {e.start} of the "
                    "line); the file must be UTF-8 encoded"
                ) from None
            if line_no == 1:
                line = line.removeprefix("\ufeff")  # a byte-order mark
            if not line.strip():
                continue
            where = f"row {len(rows)} (line {line_no})"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: {where} is not valid JSON: {e}") from None
            if not isinstance(row, dict):
                raise ValueError(
                    f"{path}: {where} is a {type(row).__name__}, "
                    'expected a JSON object like {"prompt": ..., "answer": ...}'
                )
            rows.append((where, row))
    return rows


def _pick_split(ds, name: str, split: str, flag: str):
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise ValueError(
                f"{flag} {name}: no split {split!r}; it has {sorted(ds)}: choose one with "
                f"{'--split' if flag == '--task' else '--eval-split'}"
            )
        return ds[split], f"{name} (split {split})"
    return ds, name


def _load_hub(name: str, split: str, flag: str):
    """datasets.load_dataset(name), failing in seconds with a clear message when the hub cannot be reached."""
    hint = (
        f"{flag} {name!r} is not a file or folder here, so it was taken as a Hugging Face hub dataset, and {{why}}. "
        "On a machine with access, save it with datasets.load_dataset(name).save_to_disk(folder) and pass the "
        "folder, or give a .jsonl / .json / .csv / .parquet file"
    )
    if not datasets.config.HF_HUB_OFFLINE:  # probe first: an unreachable hub would otherwise retry for minutes
        url = urllib.parse.urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
        try:
            port = url.port or (443 if url.scheme == "https" else 80)
            socket.create_connection((url.hostname, port), timeout=3).close()
        except OSError as e:
            raise ValueError(
                hint.format(why=f"the hub ({url.geturl()}) cannot be reached from this machine ({e})")
            ) from None
    try:
        return datasets.load_dataset(name, split=split)
    except Exception as e:
        if datasets.config.HF_HUB_OFFLINE:
            why = "the hub is off (HF_HUB_OFFLINE) and it is not cached"
        else:
            why = "loading it failed"
        raise ValueError(hint.format(why=f"{why} ({type(e).__name__}: {e})")) from e


def _read_source(name: str, split: str, flag: str) -> tuple[str, list[tuple[str, dict]]]:
    """(label, [(where, row)]) of a data file, a datasets.save_to_disk folder (a Dataset, or a DatasetDict and
    `split`) or a hub dataset name "owner/name"; the label names the source in error messages."""
    if os.path.isdir(name):
        saved = ("dataset_info.json", "dataset_dict.json", "state.json")  # what save_to_disk writes
        if not any(os.path.isfile(os.path.join(name, f)) for f in saved):
            raise IsADirectoryError(
                f"{flag}: {name} is a directory, not a data file or a datasets.save_to_disk folder; "
                f"give a {' / '.join(FILE_TYPES)} file or a folder written by save_to_disk"
            )
        ds, label = _pick_split(datasets.load_from_disk(name), name, split, flag)
        return label, [(f"row {i}", row) for i, row in enumerate(ds.to_list())]
    if name.lower().endswith(FILE_TYPES) or os.sep in name and not re.fullmatch(r"[\w.-]+/[\w.-]+", name):
        if not os.path.exists(name):
            raise FileNotFoundError(f"{flag}: no such file: {name}")
        if not os.path.isfile(name):  # a FIFO would block the read, /dev/zero never end it
            kind = "a FIFO" if stat.S_ISFIFO(os.stat(name).st_mode) else "a device or other special file"
            raise ValueError(f"{flag}: {name} is {kind}, not a regular file; give a {' / '.join(FILE_TYPES)} file")
        return name, _read_rows(name)
    if re.fullmatch(r"[\w.-]+/[\w.-]+", name):
        ds, label = _pick_split(_load_hub(name, split, flag), name, split, flag)
        return label, [(f"row {i}", row) for i, row in enumerate(ds.to_list())]
    raise ValueError(
        f"unknown task {name!r}: choose one of {sorted(BUILTIN)}, rg:<name> (a reasoning-gym dataset), or give a {' / '.join(FILE_TYPES)} file, a "
        "datasets.save_to_disk folder or a hub dataset name owner/name"
    )


ROLES = ("system", "user", "assistant", "tool")  # what chat templates render; "tool" carries a tool's result
ANSWERED = ("user", "tool")  # the roles a prompt may end on: the policy answers them as the assistant


def _prompt_problem(p) -> str | None:
    """Why `p` is not a prompt: a non-empty string, or a non-empty list of {"role", "content"} string dicts with roles
    from ROLES, a user message among them, and the last one a user (or tool) message: the policy continues after the
    last message with an assistant header, so a prompt ending on an assistant message would have it answer itself
    (often the reference answer left in the prompt)."""
    if isinstance(p, str):
        return _text_problem(p) or (None if p.strip() else "is empty")
    if not isinstance(p, list):
        return (
            f"has type {type(p).__name__}, expected a string or a list of chat messages "
            '[{"role": ..., "content": ...}]'
        )
    if not p:
        return "is an empty list of messages"
    for j, msg in enumerate(p):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str) or not isinstance(msg.get("content"), str):
            return f"message {j} is {msg!r}, expected a dict with string 'role' and 'content'"
        if msg["role"] not in ROLES:
            return f"message {j} has role {msg['role']!r}; a message's role is one of {', '.join(ROLES)}"
        if bad := _text_problem(msg["content"]):
            return f"message {j} {bad}"
    if not any(m["role"] == "user" for m in p):
        return f"has no user message (roles: {', '.join(m['role'] for m in p)}); a prompt needs one for the policy to answer"
    if p[-1]["role"] not in ANSWERED:
        return (
            f"ends on message {len(p) - 1} of role {p[-1]['role']!r}; the last message must be a user (or tool) "
            "message, which the policy answers: drop the trailing message (is it the answer?)"
        )
    return None


def _text_problem(text: str) -> str | None:
    """Why a string is not text a tokenizer can take: a lone surrogate (JSON's "\\ud800" escape decodes to one) has
    no UTF-8 form."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"holds a lone surrogate ({text[e.start]!r} at character {e.start}), which is not text"
    return None


def prompt_key(p) -> str:
    """A prompt as a dict key: the string itself, or a message list's JSON (so repeats and splits see equal prompts)."""
    return p if isinstance(p, str) else json.dumps(p, sort_keys=True, ensure_ascii=False)


def _kind(v) -> str:
    return "number" if isinstance(v, numbers.Real) and not isinstance(v, bool) else type(v).__name__


def _examples(label: str, rows: list[tuple[str, dict]], prompt_field: str, answer_field: str) -> list[dict]:
    """Validated, deduplicated rows as dicts with "prompt", "answer", "where" and every other column. The first
    problem raises a ValueError naming the source, the row and the field (load_task's docstring)."""
    first: dict[str, tuple[str, str]] = {}  # prompt key -> (where, answer) of its first row
    examples = []
    n_repeats = 0
    kinds = {}  # column -> (kind, where) of its first non-null value
    for where, row in rows:
        for field in (prompt_field, answer_field):
            if field not in row:
                flag = "--prompt-key" if field == prompt_field else "--answer-key"
                raise ValueError(f"{label}: {where} has no field {field!r} ({flag}; the row has {sorted(row)})")
            if row[field] is None:
                raise ValueError(f"{label}: {where} field {field!r} is null, expected a string")
        answer = row[answer_field]
        if not isinstance(answer, str):
            fix = ""
            if _kind(answer) == "number":
                fix = f": write {answer!r} as {json.dumps(str(answer))} (rewards compare text)"
            raise ValueError(
                f"{label}: {where} field {answer_field!r} has type {type(answer).__name__}, expected a string{fix}"
            )
        why = _prompt_problem(row[prompt_field])
        if why:
            raise ValueError(f"{label}: {where} field {prompt_field!r} {why}")
        extra = {k: v for k, v in row.items() if k not in (prompt_field, answer_field)}
        for k in extra:
            if k in RESERVED + ("prompt", "answer"):
                raise ValueError(
                    f"{label}: column {k!r} clashes with a name the project uses ({', '.join(RESERVED)}, and "
                    f"'prompt' / 'answer', which --prompt-key {prompt_field} / --answer-key {answer_field} "
                    "are renamed to); rename that column"
                )
        for k, v in [("prompt", row[prompt_field]), *extra.items()]:
            if v is not None:
                kind = _kind(v)
                seen = kinds.setdefault(k, (kind, where))
                if seen[0] != kind:
                    raise ValueError(
                        f"{label}: {where} field {k!r} is a {kind}, but {seen[1]} has a {seen[0]}; a column "
                        "holds one type in every row"
                    )
        prompt, answer = row[prompt_field], row[answer_field]
        key = prompt_key(prompt)
        if key in first:
            first_where, first_answer = first[key]
            if answer != first_answer:
                raise ValueError(
                    f"{label}: {where} repeats the prompt of {first_where} ({prompt!r}) with a different "
                    f"answer ({answer!r}, not {first_answer!r}); keep one answer per prompt"
                )
            n_repeats += 1
            continue
        first[key] = (where, answer)
        examples.append({"prompt": prompt, "answer": answer, "where": f"{label}: {where}", **extra})
    if n_repeats:
        print(f"load_task: {label}: dropped {n_repeats} duplicate rows (same prompt and answer as an earlier row)")
    return examples


def _from_examples(label: str, examples: list[dict]) -> datasets.Dataset:
    try:
        return datasets.Dataset.from_list(examples)
    except Exception as e:  # e.g. chat messages whose keys differ between rows
        raise ValueError(
            f"{label}: its rows do not form one table ({type(e).__name__}: {e}); give every row the same "
            "fields, and every chat message the same keys"
        ) from e


def load_task(
    path: str,
    *,
    prompt_field: str = "prompt",
    answer_field: str = "answer",
    test_fraction: float = 0.1,
    seed: int = 0,
    max_new_tokens: int | None = None,
    split: str = "train",
    eval_path: str = "",
    eval_split: str = "test",
    reward_fn: Callable | None = None,
) -> Task:
    """Your own prompts from a file (.jsonl, .json, .csv, .parquet), a datasets.save_to_disk folder (`split` of a
    DatasetDict) or a hub dataset name, scored by `reward_fn` (default: exact match against `answer_field`).

    Every row needs a prompt, a non-empty string or a non-empty list of chat messages ({"role", "content"}
    strings, a system prompt included), and a string answer; the first row that does not have them raises a
    ValueError naming the file, the row index (0-based; and the line for JSONL and CSV) and the field. The two
    columns are renamed to "prompt" and "answer"; every other column is kept (one type per column) and reaches
    the reward by name; a column named like one of RESERVED, or "prompt" / "answer" when renamed from elsewhere,
    is refused. Each row gets "where", its origin for error messages.
    A prompt that occurs again is dropped after its first row, so no test prompt is in train: a repeat with
    the same answer is dropped with a printed note, one with a different answer raises a ValueError naming
    both rows (message prompts compare by their JSON).
    Without `eval_path` the split is a seeded shuffle; `test_fraction` of the distinct prompts (at least one) become
    the test set. With it, `eval_path` (same forms; `eval_split` of a DatasetDict) is the whole test set, and train
    prompts that also occur there are dropped from train with a note.
    `max_new_tokens` defaults to the longest answer in UTF-8 bytes + 8, an upper bound on its token
    count for byte-level BPE tokenizers (every token covers at least one byte).
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"load_task: test_fraction must be in (0, 1), got {test_fraction}")
    label, rows = _read_source(path, split, "--task")
    examples = _examples(label, rows, prompt_field, answer_field)
    if eval_path:
        if not examples:
            raise ValueError(f"{label}: no rows to train on")
        test = eval_examples(eval_path, prompt_field=prompt_field, answer_field=answer_field, split=eval_split)
        train = _drop_overlap(label, examples, test)
    else:
        if len(examples) < 2:
            raise ValueError(f"{label}: need at least 2 distinct prompts (one train, one test), found {len(examples)}")
        random.Random(seed).shuffle(examples)
        n_test = min(len(examples) - 1, max(1, round(test_fraction * len(examples))))
        train, test = examples[n_test:], examples[:n_test]
    if max_new_tokens is None:
        max_new_tokens = max(len(e["answer"].encode("utf-8")) for e in train + test) + 8
    name = os.path.splitext(os.path.basename(os.path.normpath(path)))[0]
    train_ds = _from_examples(label, train)
    test_ds = _from_examples(eval_path or label, test)
    return Task(name, train_ds, test_ds, reward_fn or exact, max_new_tokens)


def eval_examples(
    path: str, *, prompt_field: str = "prompt", answer_field: str = "answer", split: str = "test"
) -> list[dict]:
    """Every row of an --eval-task source (a built-in task's test split, or load_task's forms), validated."""
    if path in BUILTIN:
        return [{**r, "where": f"{path}: test row {i}"} for i, r in enumerate(BUILTIN[path].make().test.to_list())]
    label, rows = _read_source(path, split, "--eval-task")
    examples = _examples(label, rows, prompt_field, answer_field)
    if not examples:
        raise ValueError(f"--eval-task {path}: no rows")
    return examples


def _drop_overlap(label: str, train: list[dict], test: list[dict]) -> list[dict]:
    held_out = {prompt_key(e["prompt"]) for e in test}
    kept = [e for e in train if prompt_key(e["prompt"]) not in held_out]
    if len(kept) < len(train):
        print(f"load_task: {label}: dropped {len(train) - len(kept)} train rows whose prompt is in the --eval-task set")
    if not kept:
        raise ValueError(f"{label}: every train prompt is also in the --eval-task set; nothing is left to train on")
    return kept


def _messages(prompt) -> list[dict]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    # a Dataset fills keys a message lacks with None
    return [{k: v for k, v in m.items() if v is not None} for m in prompt]


def _chat_text(tok, prompt) -> str:
    return tok.apply_chat_template(_messages(prompt), add_generation_prompt=True, tokenize=False)


def encode_prompt(tok, prompt) -> list[int]:
    """Token ids of the chat-formatted prompt (a user message string, or a list of chat messages, system prompts
    included) plus the assistant header: what the policy continues."""
    return tok(_chat_text(tok, prompt), add_special_tokens=False).input_ids


def check_lengths(task: Task, tok, context_len: int, max_new_tokens: int, compact_at: int = 0) -> None:
    """Refuse, before any training, a task with a prompt (train or test, as encode_prompt encodes it) that the chat
    template rejects, or whose tokens + max_new_tokens exceed context_len (the ValueError names the first such row
    and counts them all), and a `compact_at` (--compact-at) below the longest prompt + 2 x max_new_tokens: a row
    after a compaction starts with the prompt and the summary (up to max_new_tokens) and must fit a turn before the
    next, else every turn compacts. (With --env the prompts measured are the rows reset() is given.)"""
    lengths = []  # (prompt tokens, where) of every row
    # characters: a token covers at most this many (4 x: a normalizer may fold a few characters into one)
    longest_token = max(map(len, tok.get_vocab()))
    for split, ds in (("train", task.train), ("test", task.test)):
        if not len(ds):
            continue
        if "where" in ds.column_names:
            wheres = ds["where"]
        else:
            wheres = [f"{task.name}: {split} row {i}" for i in range(len(ds))]
        texts = []
        for where, p in zip(wheres, ds["prompt"]):
            try:
                text = _chat_text(tok, p)
            except Exception as e:  # jinja2's TemplateError (a template's raise_exception), or its own bugs
                roles = "user" if isinstance(p, str) else ", ".join(m["role"] for m in p)
                raise ValueError(
                    f"check_lengths: {where}: the chat template of {tok.name_or_path} fails on this prompt "
                    f"(roles: {roles}): {type(e).__name__}: {e}"
                ) from e
            if len(text) > 4 * longest_token * context_len:  # refused before the tokenizer sees it (50 MB aborts it)
                raise ValueError(
                    f"check_lengths: {where}: the prompt is {len(text)} characters (chat-formatted), more than 4 x "
                    f"{context_len} tokens (the context length) x {longest_token} characters (the longest token) "
                    "could hold; shorten the prompt or drop the row"
                )
            texts.append(text)
        lengths += zip(map(len, tok(texts, add_special_tokens=False).input_ids), wheres)
    too_long = [(n, w) for n, w in lengths if n + max_new_tokens > context_len]
    if too_long:
        n, where = too_long[0]
        raise ValueError(
            f"check_lengths: {where}: the prompt is {n} tokens (chat-formatted) + max_new_tokens "
            f"{max_new_tokens} = {n + max_new_tokens}, over the context length {context_len}; shorten "
            f"the prompt or lower --max-new-tokens, or drop the row. {len(too_long)} of {len(lengths)} rows "
            f"are too long, the longest prompt is {max(n for n, _ in too_long)} tokens"
        )
    longest, where = max(lengths, default=(0, ""), key=lambda x: x[0])
    if compact_at and compact_at < longest + 2 * max_new_tokens:
        raise ValueError(
            f"--compact-at {compact_at} is below the longest prompt ({where}: {longest} tokens) + a summary "
            f"and a turn (2 x --max-new-tokens {max_new_tokens}) = {longest + 2 * max_new_tokens}: every turn "
            "would end in a summary; raise --compact-at (or 0 = off)"
        )


def guess_task(seed: int = 0, n_train: int = 20000, n_test: int = 1000, test_ranges: float = 0.15) -> Task:
    """The multi-turn guessing task: data/guess.py's rows (test ranges disjoint from the train ranges) and environment."""
    train, test = guess_rows(seed, n_train, n_test, test_ranges)
    return Task(
        "guess", _dataset(train), _dataset(test), reward_fn=None, max_new_tokens=8, env=GuessEnv, max_turns=MAX_TURNS
    )


def walk_task(seed: int = 0, n_train: int = 20000, n_test: int = 1000, test_share: float = 0.15) -> Task:
    """The windy walk home: data/walk.py's rows (test configurations disjoint from the train ones) and environment.
    A turn is one character and <|im_end|> (max_new_tokens 4 leaves room for a near miss); max_turns is the longest
    walk, so every episode ends by its own last turn, where its reward is."""
    train, test = walk_rows(seed, n_train, n_test, test_share)
    return Task(
        "walk", _dataset(train), _dataset(test), reward_fn=None, max_new_tokens=4, env=WalkEnv, max_turns=max(TURNS)
    )


def calc_task(seed: int = 0, n_train: int = 20000, n_test: int = 1000) -> Task:
    """Products of 3-digit numbers with a calculator tool: data/calc.py's rows (test pairs disjoint from the train
    ones) and tool environment (CalcTools, TRL's form: train_ppo.py plays it through tools.ToolEpisode), exact match.
    max_new_tokens fits the calculator call (81 tokens) and <|im_end|>."""
    train, test = calc_rows(seed, n_train, n_test)
    return Task(
        "calc", _dataset(train), _dataset(test), reward_fn=exact, max_new_tokens=96, env=CalcTools, max_turns=CALC_TURNS
    )


def rg_task(name: str, n_train: int = 10000, n_test: int = 500) -> Task:
    """`--task rg:<name>`: reasoning-gym's procedural dataset `name` (data/rg.py: disjoint train and test seeds, its own
    score_answer as the reward). max_new_tokens: the longest answer plus room to reason (256)."""
    train, test, score = rg_rows(name, n_train, n_test)
    longest = max(len(r["answer"].encode("utf-8")) for r in train + test)
    return Task(
        f"rg:{name}",
        datasets.Dataset.from_list(train),
        datasets.Dataset.from_list(test),
        reward_fn=score,
        max_new_tokens=longest + 256,
    )


@dataclass(frozen=True)
class Builtin:
    """A built-in task (--task <name>): what the checks, the loop and the default model need to know of it, before
    it is built."""

    make: Callable[[], Task]
    """Builds the task at its default seed and sizes."""
    multi_turn: bool
    """Played by agent.run_episodes on its own environment (Task.env)."""
    tool_env: bool
    """Its environment is a tool environment (TRL's form, played through tools.ToolEpisode)."""
    warmup: str
    """The warm-up of the default model it starts from: data.tiny.default_model's task (a DEFAULT_WARMUP key)."""
    demo_move: Callable[[str, random.Random], str] | None = None
    """A multi-turn task's warm-up demonstrations: the move data.tiny.demo_engine plays (None: noisy bisection)."""
    demo_compaction: bool = False
    """A third of its warm-up demonstrations are compacted (the bisection answers a summary request)."""


BUILTIN = {
    "addition": Builtin(addition_task, multi_turn=False, tool_env=False, warmup="addition"),
    "sort": Builtin(sort_task, multi_turn=False, tool_env=False, warmup="sort"),
    "guess": Builtin(guess_task, multi_turn=True, tool_env=False, warmup="guess", demo_compaction=True),
    "walk": Builtin(walk_task, multi_turn=True, tool_env=False, warmup="walk", demo_move=walk_move),
    "calc": Builtin(calc_task, multi_turn=True, tool_env=True, warmup="calc", demo_move=calc_move),
}


def warmup_kind(task: str) -> str:
    """The warm-up of the default model (data.tiny.default_model's task) for --task `task`: a built-in task's own,
    addition's for any other (a file, a hub dataset, rg:<name>)."""
    return BUILTIN[task].warmup if task in BUILTIN else "addition"


def get_task(
    name: str,
    *,
    split: str = "train",
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    reward_fn: Callable | None = None,
    eval_task: str = "",
    eval_split: str = "test",
    user_timeout: float = DEFAULT_USER_TIMEOUT,
) -> Task:
    """A built-in task by name ("addition", "sort", "guess", "walk", "calc"), a reasoning-gym one ("rg:<name>",
    data/rg.py) or your data (load_task's forms), with `reward_fn` (default: exact match) and, if given, `eval_task` as
    the whole held-out set. A reward that cannot take the data's columns is refused here (check_reward), before any
    model loads."""
    if name in BUILTIN or name.startswith("rg:"):
        task = rg_task(name[3:]) if name.startswith("rg:") else BUILTIN[name].make()
        if reward_fn is not None:
            task.reward_fn = reward_fn
        if eval_task:
            test = eval_examples(eval_task, prompt_field=prompt_key, answer_field=answer_key, split=eval_split)
            train = _drop_overlap(name, task.train.to_list(), test)
            task.train = datasets.Dataset.from_list(train)
            task.test = _from_examples(eval_task, test)
            task.max_new_tokens = max(task.max_new_tokens, max(len(e["answer"].encode("utf-8")) for e in test) + 8)
    else:
        task = load_task(
            name,
            prompt_field=prompt_key,
            answer_field=answer_key,
            split=split,
            eval_path=eval_task,
            eval_split=eval_split,
            reward_fn=reward_fn,
        )
    if task.reward_fn is not None:
        for ds in (task.train, task.test):  # the held-out set may have other columns
            check_reward(task.reward_fn, ds.column_names)
    task.user_timeout = user_timeout
    return task


@functools.lru_cache(maxsize=4)
def epoch_order(seed: int, n_train: int, epoch: int) -> torch.Tensor:
    """The permutation in which epoch `epoch` of the data stream visits the train set (the same on every rank);
    cached, so a step does not redraw it."""
    return torch.randperm(n_train, generator=torch.Generator().manual_seed(seed + epoch))


def prompt_indices(seed: int, n_train: int, first: int, count: int) -> list[int]:
    """Train rows first .. first + count - 1 of the data stream: row i is row i % n_train of epoch i // n_train."""
    return [int(epoch_order(seed, n_train, i // n_train)[i % n_train]) for i in range(first, first + count)]


def prompt_keys(train: datasets.Dataset) -> list[int]:
    """Each train row's prompt key: the index of the first row with the same prompt (chat-message prompts compared as
    JSON). --algo reinforce's baseline is per prompt, so rows that repeat a prompt (walk's 20,000 rows hold 71) share it."""
    first: dict[str, int] = {}
    return [
        first.setdefault(p if isinstance(p, str) else json.dumps(p, sort_keys=True), i)
        for i, p in enumerate(train["prompt"])
    ]
