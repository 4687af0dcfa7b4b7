"""data/: tokenizer, tiny model save/load, tasks and rewards, user files, warm-up."""

import json
import os
import re

import datasets
import pyarrow as pa
import pyarrow.parquet
import pytest
import torch
import transformers

from conftest import CACHE, require_extras
from data.rewards import exact_match_reward, reward_columns, score
from data.tasks import (
    BUILTIN,
    Task,
    addition_task,
    check_lengths,
    encode_prompt,
    get_task,
    load_task,
    sort_task,
    warmup_kind,
)
from data.tiny import (
    DEFAULT_WARMUP,
    EOS_ID,
    PAD_ID,
    _sft_batch,
    build_tiny_model,
    build_tokenizer,
    default_model,
    greedy_completions,
    tiny_config,
    warmup,
)
from tools import is_tool_env


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny")), seed=3)


# --- tokenizer and model ---


def test_tokenizer_is_byte_level():
    tok = build_tokenizer()
    text = "042+315 héllo\n"
    ids = tok(text, add_special_tokens=False).input_ids
    assert ids == list(text.encode("utf-8"))  # one token per byte, id == byte value
    assert tok.decode(ids) == text
    assert len(tok) == 259 and (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (PAD_ID, EOS_ID, None)
    assert tok("<|im_start|>x<|im_end|>", add_special_tokens=False).input_ids == [257, ord("x"), 258]


def test_chat_template():
    tok = build_tokenizer()
    msgs = [{"role": "user", "content": "042+315"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\n042+315<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(msgs, tokenize=False) == "<|im_start|>user\n042+315<|im_end|>\n"


def test_save_load_roundtrip(tiny_dir):
    tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    ref_tok = build_tokenizer()
    torch.manual_seed(3)  # build_tiny_model's init, rebuilt independently in memory
    ref = transformers.LlamaForCausalLM(tiny_config(len(ref_tok))).eval()

    for text in ["<|im_start|>user\n042+315<|im_end|>\n", "sort: 07 42 é"]:
        assert tok(text).input_ids == ref_tok(text).input_ids
    assert tok.chat_template == ref_tok.chat_template
    assert 0.9e6 < sum(p.numel() for p in model.parameters()) < 1.1e6
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    assert model.generation_config.eos_token_id == EOS_ID
    ids = torch.randint(0, 259, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=0, atol=0)
    assert any(
        (p1 != p2).any()
        for p1, p2 in zip(model.parameters(), transformers.LlamaForCausalLM(tiny_config(259)).parameters())
    ), "a different seed must give different weights"


def test_greedy_completions_match_generate():
    """Left-padded batched greedy decoding equals HF generate run on each prompt alone."""
    tok = build_tokenizer()
    torch.manual_seed(0)  # large init: a default-init random model emits one token whatever the context
    model = transformers.LlamaForCausalLM(tiny_config(len(tok), initializer_range=0.5)).eval()
    prompts = ["1+1", "042+315", "sort: 07 42 93 11"]
    got = greedy_completions(model, tok, prompts, max_new_tokens=6)
    for prompt, completion in zip(prompts, got):
        text = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids
        out = model.generate(ids, max_new_tokens=6, do_sample=False)
        assert completion == tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


# --- tasks and rewards ---


def test_addition_task():
    task = addition_task(seed=1, n_train=300, n_test=50)
    again = addition_task(seed=1, n_train=300, n_test=50)
    assert task.train.to_dict() == again.train.to_dict() and task.test.to_dict() == again.test.to_dict()
    assert task.train.to_list() != addition_task(seed=2, n_train=300, n_test=50).train.to_list()
    assert (len(task.train), len(task.test)) == (300, 50)
    assert not set(task.train["prompt"]) & set(task.test["prompt"])
    for row in list(task.train) + list(task.test):
        a, b = row["prompt"].split("+")
        assert len(a) == len(b) == 3 and len(row["answer"]) == 4 and int(row["answer"]) == int(a) + int(b)
    assert task.max_new_tokens >= 5


def test_sort_task():
    task = sort_task(seed=0, n_train=200, n_test=20)
    assert task.train.to_dict() == sort_task(seed=0, n_train=200, n_test=20).train.to_dict()
    assert not set(task.train["prompt"]) & set(task.test["prompt"])
    tok = build_tokenizer()
    for row in list(task.train) + list(task.test):
        numbers = row["prompt"].removeprefix("sort: ").split()
        assert len(numbers) == 8 and row["answer"].split() == sorted(numbers) and all(len(x) == 1 for x in numbers)
        n_answer = len(tok(row["answer"] + "<|im_end|>", add_special_tokens=False).input_ids)
        assert n_answer == 16 <= task.max_new_tokens
    two = sort_task(n_train=50, n_test=5, n_numbers=3, digits=2).train[0]
    assert len(two["prompt"].split()) == 4 and all(len(x) == 2 for x in two["answer"].split())


def test_exact_match_reward():
    assert exact_match_reward(["0357", " 0357\n", "357", "03570", ""], ["0357"] * 5) == [1.0, 1.0, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="2 completions but 1 answers"):
        exact_match_reward(["a", "b"], ["a"])


ROWS = [{"prompt": f"q{i}", "answer": f"a{i}", "extra": i} for i in range(20)]


def _write(path, rows):
    if str(path).endswith(".parquet"):
        pyarrow.parquet.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("ext", ["jsonl", "parquet"])
def test_load_task(tmp_path, ext):
    path = _write(tmp_path / f"mine.{ext}", ROWS)
    task = load_task(path, test_fraction=0.25, seed=0)
    assert (task.name, len(task.train), len(task.test)) == ("mine", 15, 5)
    rows = task.train.to_list() + task.test.to_list()
    assert sorted((r["prompt"], r["answer"]) for r in rows) == sorted((r["prompt"], r["answer"]) for r in ROWS)
    assert task.test.to_list() == load_task(path, test_fraction=0.25, seed=0).test.to_list()
    assert task.test.to_list() != load_task(path, test_fraction=0.25, seed=1).test.to_list()
    assert task.max_new_tokens == len("a19") + 8
    assert task.reward_fn(["a1", "a2"], prompts=["q1", "q1"], answer=["a1", "a1"]) == [1.0, 0.0]
    assert get_task(path).train.column_names == ["prompt", "answer", "where", "extra"]  # other columns are kept
    for r in rows:  # each row still names its file row after the shuffle
        i = int(r["prompt"][1:])
        assert r["where"] == f"{path}: row {i}" + (f" (line {i + 1})" if ext == "jsonl" else "")
    renamed = [{"q": r["prompt"], "a": r["answer"]} for r in ROWS]
    assert len(load_task(_write(tmp_path / f"renamed.{ext}", renamed), prompt_field="q", answer_field="a").test) == 2


@pytest.mark.parametrize("ext", ["jsonl", "parquet"])
@pytest.mark.parametrize(
    "bad, message",
    [
        ({"answer": "a"}, "has no field 'prompt'"),
        ({"prompt": "q", "answer": None}, "field 'answer' is null"),
        ({"prompt": "  ", "answer": "a"}, "field 'prompt' is empty"),
    ],
)
def test_load_task_malformed_row(tmp_path, ext, bad, message):
    rows = [{"prompt": "q0", "answer": "a0"}, {"prompt": "q1", "answer": "a1"}, bad]
    path = _write(tmp_path / f"bad.{ext}", rows)
    if ext == "parquet" and "no field" in message:  # parquet has one schema: a row without the field reads as null
        message = "field 'prompt' is null"
    message = ("row 2 (line 3) " if ext == "jsonl" else "row 2 ") + message
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        load_task(path)
    assert path in str(err.value)


@pytest.mark.parametrize("ext", ["jsonl", "parquet"])
def test_load_task_non_string_field(tmp_path, ext):
    rows = [{"prompt": "q0", "answer": "a0"}, {"prompt": "q1", "answer": 7}]
    if ext == "parquet":  # a parquet column has one type, so the whole column is ints
        rows = [{"prompt": "q0", "answer": 3}, {"prompt": "q1", "answer": 7}]
    where = r"row 1 \(line 2\)" if ext == "jsonl" else "row 0"
    with pytest.raises(ValueError, match=f"{where} field 'answer' has type int, expected a string"):
        load_task(_write(tmp_path / f"bad.{ext}", rows))


def test_load_task_bad_inputs(tmp_path):
    (tmp_path / "x.jsonl").write_text('{"prompt": "q", "answer": "a"}\n\n{"prompt": \n')
    with pytest.raises(ValueError, match=r"row 1 \(line 3\) is not valid JSON"):  # blank lines are skipped
        load_task(str(tmp_path / "x.jsonl"))
    (tmp_path / "x.txt").write_text("prompt,answer\n")
    with pytest.raises(ValueError, match="unknown file type '.txt'"):
        load_task(str(tmp_path / "x.txt"))
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_task(str(tmp_path / "missing.jsonl"))
    with pytest.raises(
        ValueError,
        match=r"unknown task 'subtraction': choose one of \['addition', 'calc', 'guess', 'sort', 'walk'\], rg:<name>",
    ):
        get_task("subtraction")


def test_builtin_table_says_what_each_task_builds():
    """BUILTIN describes each built-in task before it is built (config.resolve reads it); built, the task agrees."""
    for name, builtin in BUILTIN.items():
        task = builtin.make()
        assert task.name == name
        assert builtin.multi_turn == (task.env is not None)
        assert builtin.tool_env == (task.env is not None and is_tool_env(task.env))
        assert builtin.warmup in DEFAULT_WARMUP
        assert builtin.multi_turn or (builtin.demo_move is None and not builtin.demo_compaction)
        assert warmup_kind(name) == builtin.warmup
    assert warmup_kind("data.jsonl") == "addition"  # any other task starts from the addition model
    assert warmup_kind("rg:leg_counting") == "addition"


def test_load_task_not_utf8_names_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "q0", "answer": "a0"}\n\n{"prompt": "caf\xe9", "answer": "a1"}\n')
    with pytest.raises(ValueError, match=r"latin1\.jsonl: line 3 is not valid UTF-8 .*the file must be UTF-8"):
        load_task(str(path))


@pytest.mark.parametrize("ext", ["jsonl", "parquet"])
def test_get_task_directory_is_not_a_data_file(tmp_path, ext):
    (tmp_path / f"x.{ext}").mkdir()
    with pytest.raises(IsADirectoryError, match=f"x.{ext} is a directory, not a data file"):
        get_task(str(tmp_path / f"x.{ext}"))
    with pytest.raises(FileNotFoundError, match="no such file"):
        get_task(str(tmp_path / f"missing.{ext}"))


@pytest.mark.parametrize("ext", ["jsonl", "parquet"])
def test_load_task_drops_duplicate_prompts(tmp_path, ext, capsys):
    rows = ROWS + [ROWS[3], ROWS[5], ROWS[3]]  # exact duplicates: 3 dropped, keeping the first rows
    path = _write(tmp_path / f"dups.{ext}", rows)
    task = load_task(path, test_fraction=0.25, seed=0)
    assert capsys.readouterr().out.count("dropped 3 duplicate rows") == 1
    assert (len(task.train), len(task.test)) == (15, 5)
    assert not set(task.train["prompt"]) & set(task.test["prompt"])
    assert task.test.to_list() == load_task(path, test_fraction=0.25, seed=0).test.to_list()
    wheres = list(task.train["where"]) + list(task.test["where"])  # the first 20 rows: the repeats were dropped
    assert sorted(wheres) == sorted(
        f"{path}: row {i}" + (f" (line {i + 1})" if ext == "jsonl" else "") for i in range(20)
    )

    conflict = ROWS + [{**ROWS[3], "answer": "other"}]
    with pytest.raises(
        ValueError,
        match=("row 20 \\(line 21\\)" if ext == "jsonl" else "row 20")
        + " repeats the prompt of row 3"
        + (" \\(line 4\\)" if ext == "jsonl" else "")
        + " \\('q3'\\) with a different answer \\('other', not 'a3'\\)",
    ):
        load_task(_write(tmp_path / f"conflict.{ext}", conflict))


def test_check_lengths_names_file_row(tmp_path):
    tok = build_tokenizer()
    rows = [{"prompt": f"q{i}", "answer": "a"} for i in range(12)]
    rows[7]["prompt"], rows[9]["prompt"] = "x" * 300, "y" * 300
    path = _write(tmp_path / "long.jsonl", rows)
    task = load_task(path)
    n = len(encode_prompt(tok, "x" * 300))  # 300 bytes + the chat template
    check_lengths(task, tok, context_len=n + 8, max_new_tokens=8)  # exactly fits
    with pytest.raises(ValueError) as err:
        check_lengths(task, tok, context_len=n + 7, max_new_tokens=8)
    message = str(err.value)
    assert re.search(f"{re.escape(path)}: row (7 \\(line 8\\)|9 \\(line 10\\)): the prompt is {n} tokens", message), (
        message
    )
    assert f"max_new_tokens 8 = {n + 8}, over the context length {n + 7}" in message
    assert "lower --max-new-tokens" in message and "2 of 12 rows are too long" in message


def test_check_lengths_builtin_task():
    tok = build_tokenizer()
    check_lengths(addition_task(), tok, context_len=256, max_new_tokens=8)  # 20000 + 3000 rows
    n = len(encode_prompt(tok, "042+315"))
    with pytest.raises(
        ValueError, match=f"addition: train row 0: the prompt is {n} tokens .* 55 of 55 rows are too long"
    ):
        check_lengths(addition_task(n_train=50, n_test=5), tok, context_len=n + 7, max_new_tokens=8)


def test_score_refuses_float32_overflow():
    ds = datasets.Dataset.from_dict({"prompt": ["p"], "answer": ["a"]})

    def task(rewards):
        return Task("t", ds, ds, lambda completions, **columns: rewards, 4)

    def cols(n):
        return {"prompt": ["p"] * n, "answer": ["a"] * n}

    with pytest.raises(RuntimeError, match=r"returned 1e\+39 for sample 1 \(completion 'b'\), which is inf in float32"):
        score(task([0.0, 1e39]), ["a", "b"], cols(2))
    with pytest.raises(RuntimeError, match="which is inf in float32"):  # an int too large for math.isfinite
        score(task([10**400]), ["a"], cols(1))
    with pytest.raises(
        RuntimeError, match=r"returned -inf for sample 0 \(completion 'a'\); rewards must be finite numbers"
    ):
        score(task([float("-inf")]), ["a"], cols(1))
    with pytest.raises(
        RuntimeError, match=r"returned inf for sample 0 .* rewards must be finite"
    ):  # also inside a dict
        score(task([{"score": float("inf")}]), ["a"], cols(1))
    rewards = score(task([-3e38, 2**100]), ["a", "b"], cols(2)).rewards  # finite in float32: they pass
    assert torch.isfinite(rewards).all() and rewards.tolist() == torch.tensor([-3e38, 2.0**100]).tolist()


# --- warm-up ---


def test_sft_batch_masks_response_tokens_only():
    tok = build_tokenizer()
    F, T = False, True
    ids, loss_mask = _sft_batch(
        tok, [([1, 2, 3, 4, 5], [F, F, F, T, T]), ([1, 2, 6], [F, F, T]), ([1, 7, 8, 9], [F, T, F, T])]
    )
    assert ids.tolist() == [[1, 2, 3, 4, 5], [1, 2, 6, PAD_ID, PAD_ID], [1, 7, 8, 9, PAD_ID]]
    # logits at position t predict token t + 1: row 0 predicts 4, 5 from positions 2, 3; row 1 predicts 6 from 1;
    # row 2 (a multi-turn demonstration) predicts its model tokens 7 and 9, not the observation token 8
    assert loss_mask.tolist() == [[F, F, T, T], [F, T, F, F], [T, F, T, F]]


def test_warmup_stops_at_target_and_is_deterministic(tiny_dir, tmp_path):
    task = addition_task(n_train=400, n_test=10)
    a = warmup(tiny_dir, str(tmp_path / "a"), task, target_acc=0.0, max_steps=50, n_eval=16, batch_size=8)
    assert a["steps"] == 0 and a["history"] == [{"step": 0, "loss": None, "accuracy": 0.0}]  # met before training
    b = warmup(tiny_dir, str(tmp_path / "b"), task, target_acc=1.0, max_steps=3, eval_every=2, n_eval=16, batch_size=8)
    c = warmup(tiny_dir, str(tmp_path / "c"), task, target_acc=1.0, max_steps=3, eval_every=2, n_eval=16, batch_size=8)
    assert b["steps"] == 3 and [h["step"] for h in b["history"]] == [0, 2, 3]  # the cap ends with an evaluation
    assert b["history"] == c["history"]
    mb, mc, m0 = (
        transformers.AutoModelForCausalLM.from_pretrained(d) for d in (tmp_path / "b", tmp_path / "c", tiny_dir)
    )
    for pb, pc, p0 in zip(mb.parameters(), mc.parameters(), m0.parameters()):
        torch.testing.assert_close(pb, pc, rtol=0, atol=0)
    assert any((pb != p0).any() for pb, p0 in zip(mb.parameters(), m0.parameters()))


def test_default_model_builds_with_fixed_threads(tmp_path, monkeypatch):
    """The build runs on BUILD_THREADS torch threads whatever the caller's count (the warm-up's outcome depends on
    it), restores the caller's count, and records the threads and versions in warmup.json."""
    import data.tiny as tiny

    seen = []

    def fake_warmup(model_dir, out_dir, task, **kw):
        seen.append(torch.get_num_threads())
        return {"steps": 0, "accuracy": 0.0, "seconds": 0.0, "history": []}

    monkeypatch.setattr(tiny, "warmup", fake_warmup)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        path = tiny.default_model(cache_dir=str(tmp_path), task="addition")
        assert seen == [tiny.BUILD_THREADS] and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    built = json.load(open(os.path.join(path, "warmup.json")))["built_with"]
    assert built == {
        "threads": tiny.BUILD_THREADS,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu": tiny.cpu_name(),
    }


def test_a_build_in_progress_is_waited_for_not_repeated(tmp_path, monkeypatch):
    """While another process holds a model's build lock, default_model waits; when that build has landed it returns
    the folder without building again. With no build there, it builds once the lock is free."""
    import fcntl
    import threading

    import data.tiny as tiny

    builds = []

    def fake_warmup(model_dir, out_dir, task, **kw):
        builds.append(out_dir)
        return {"steps": 0, "accuracy": 0.0, "seconds": 0.0, "history": []}

    monkeypatch.setattr(tiny, "warmup", fake_warmup)
    path = tiny.default_model_path(str(tmp_path), task="addition")
    got = []
    with open(path + ".lock", "w") as lock:  # "another process" building: an open file description of its own
        fcntl.flock(lock, fcntl.LOCK_EX)
        waiter = threading.Thread(target=lambda: got.append(tiny.default_model(str(tmp_path), task="addition")))
        waiter.start()
        waiter.join(timeout=2)
        assert waiter.is_alive() and not got and not builds  # waiting, not building
        os.makedirs(path)
        open(os.path.join(path, "warmup.json"), "w").write("{}")  # the other build lands
    waiter.join(timeout=30)
    assert got == [path] and not builds
    other = tiny.default_model(str(tmp_path), task="sort")  # nobody building: it builds
    assert len(builds) == 1 and os.path.isfile(os.path.join(other, "warmup.json"))


@pytest.mark.e2e  # the warm-up run that builds each task's default model (when .cache lacks it)
@pytest.mark.parametrize("task", [name for name, builtin in BUILTIN.items() if not builtin.multi_turn])
def test_default_model_reaches_target(task):
    """Builds each task's default model once (1-3 minutes, cached in .cache/) and re-checks its accuracy."""
    cache = CACHE

    def building():
        return {d for d in os.listdir(cache) if d.startswith(".building-")} if os.path.isdir(cache) else set()

    before = (
        building()
    )  # a build killed earlier (kill -9 cannot clean up) leaves its folder; this build must leave none
    path = default_model(cache_dir=cache, task=task)
    assert default_model(cache_dir=cache, task=task) == path  # cached: same folder, no rebuild
    assert f"tiny-{task}-" in path and building() <= before
    stats = json.load(open(os.path.join(path, "warmup.json")))
    target = DEFAULT_WARMUP[task]
    assert (
        stats["accuracy"] >= target["target_acc"] and stats["steps"] < target["max_steps"]
    )  # stopped at the target, not the cap
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    t = get_task(task)
    val = t.train[:256]  # warmup()'s validation slice
    completions = greedy_completions(model, tok, val["prompt"], max_new_tokens=t.max_new_tokens)
    assert sum(exact_match_reward(completions, val["answer"])) / 256 == stats["accuracy"]


# --- hostile inputs: data files as common tools write them, bad chat prompts, damaged model folders (issue 21) ---

CHAT_ROWS = [{"prompt": f"q{i}", "answer": str(i)} for i in range(4)]
_lines = "".join(json.dumps(r) + "\n" for r in CHAT_ROWS)
_csv = "prompt,answer\r\n" + "".join(f"{r['prompt']},{r['answer']}\r\n" for r in CHAT_ROWS)


@pytest.mark.parametrize(
    "name, data",
    [
        ("bom.jsonl", "\ufeff" + _lines),  # Notepad, PowerShell
        ("crlf.jsonl", _lines.replace("\n", "\r\n")),
        ("trailing.jsonl", _lines + "\n\n"),
        ("array.json", json.dumps(CHAT_ROWS)),
        ("bom_array.json", "\ufeff" + json.dumps(CHAT_ROWS)),
        ("lines.json", _lines),  # JSON lines under a .json name
        ("excel.csv", "\ufeff" + _csv),  # Excel's "CSV UTF-8": a byte-order mark and CRLF
        ("extra.parquet", [{**r, "n": i, "meta": {"k": i}} for i, r in enumerate(CHAT_ROWS)]),
    ],
)
def test_data_files_as_common_tools_write_them_load(tmp_path, name, data):
    path = tmp_path / name
    if name.endswith(".parquet"):
        pyarrow.parquet.write_table(pa.Table.from_pylist(data), path)
    else:
        path.write_text(data, encoding="utf-8", newline="")
    task = get_task(str(path))
    rows = task.train.to_list() + task.test.to_list()
    assert sorted((r["prompt"], r["answer"]) for r in rows) == [(r["prompt"], r["answer"]) for r in CHAT_ROWS]


def _msgs(*roles):
    return [{"role": r, "content": f"{r} text"} for r in roles]


@pytest.mark.parametrize(
    "name, data, kw, message",
    [
        (
            "role.jsonl",
            {"prompt": _msgs("user", "bot"), "answer": "1"},
            {},
            r"row 2 \(line 3\) field 'prompt' message 1 has role 'bot'; a message's role is one of system, user, assistant, tool",
        ),
        ("caps.jsonl", {"prompt": _msgs("User"), "answer": "1"}, {}, "message 0 has role 'User'"),
        (
            "no_user.jsonl",
            {"prompt": _msgs("system", "assistant"), "answer": "1"},
            {},
            r"row 2 \(line 3\) field 'prompt' has no user message \(roles: system, assistant\)",
        ),
        (
            "answered.jsonl",
            {"prompt": _msgs("system", "user", "assistant"), "answer": "1"},
            {},
            r"row 2 \(line 3\) field 'prompt' ends on message 2 of role 'assistant'; the last message must be a user",
        ),
        (
            "number.jsonl",
            {"prompt": "q9", "answer": 9},
            {},
            r"field 'answer' has type int, expected a string: write 9 as \"9\"",
        ),
        (
            "key.jsonl",
            {"prompt": "q9", "answer": "9"},
            {"prompt_key": "question"},
            r"row 0 \(line 1\) has no field 'question' \(--prompt-key; the row has \['answer', 'prompt'\]\)",
        ),
        (
            "comma.csv",
            "q9, with a comma,9\n",
            {},
            r"row 2 \(line 4\) has 3 field\(s\) where the header has 2 \(prompt, answer\); quote",
        ),
        ("short.csv", "q9\n", {}, r"row 2 \(line 4\) has 1 field\(s\) where the header has 2"),
        (
            "semicolon.csv",
            None,
            {},
            r"its header is one column, 'prompt;answer': the file must be comma-separated, not ';'",
        ),
        (
            "columns.json",
            {"prompt": {"0": "q0", "1": "q1"}, "answer": {"0": "0", "1": "1"}},
            {},  # pandas' to_json() default
            r"holds one JSON object of columns \(prompt, answer\), as pandas' DataFrame.to_json\(\) .* orient='records'",
        ),
    ],
)
def test_bad_rows_are_refused_naming_file_row_and_field(tmp_path, name, data, kw, message):
    """Each file holds a bad row (after two good ones) or a bad shape; the ValueError names the file, the row and the
    field or flag."""
    path = tmp_path / name
    if name == "semicolon.csv":
        path.write_text("prompt;answer\nq0;0\nq1;1\n")
    elif name.endswith(".csv"):
        path.write_text("prompt,answer\nq0,0\nq1,1\n" + data)
    elif name == "columns.json":
        path.write_text(json.dumps(data))
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in CHAT_ROWS[:2] + [data]))
    with pytest.raises(ValueError, match=message) as err:
        get_task(str(path), **kw)
    assert str(path) in str(err.value)


def test_tool_results_and_system_prompts_are_prompts(tmp_path):
    path = tmp_path / "tool.jsonl"
    rows = [
        {"prompt": _msgs("system", "user", "assistant", "tool"), "answer": "1"},
        {"prompt": _msgs("user"), "answer": "2"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert len(get_task(str(path)).train) == 1


def test_a_chat_template_that_fails_is_named_with_the_row_and_folder(tmp_path, tiny_dir):
    tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
        "{% endif %}{{ m['content'] }}{% endfor %}"
    )
    path = tmp_path / "sys.jsonl"
    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "answer": str(i)} for i in range(3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows + [{"prompt": _msgs("system", "user"), "answer": "9"}]))
    with pytest.raises(
        ValueError,
        match=rf"sys.jsonl: row 3 \(line 4\): the chat template of {re.escape(tiny_dir)} fails on this "
        r"prompt \(roles: system, user\): TemplateError: System role not supported",
    ):
        check_lengths(get_task(str(path)), tok, context_len=256, max_new_tokens=8)


def test_compact_at_below_the_longest_prompt_and_a_turn_is_refused(tiny_dir):
    from config import Config, check_model

    task = get_task("guess")  # the longest prompt is 30 tokens chat-formatted, a turn at most 8
    with pytest.raises(
        ValueError,
        match=r"--compact-at 45 is below the longest prompt \(guess: \w+ row \d+: 30 tokens\) \+ a "
        r"summary and a turn \(2 x --max-new-tokens 8\) = 46",
    ):
        check_model(Config(task="guess", compact_at=45), tiny_dir, task)
    check_lengths(task, transformers.AutoTokenizer.from_pretrained(tiny_dir), 256, 8, compact_at=46)


def _damaged_copy(src, dst, *, drop=(), add=None, reshape=None, config=None, remove=(), write=None) -> str:
    """A copy of model folder src with tensors dropped, added or reshaped, config.json changed, files removed or
    overwritten (write: {file: text})."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = os.path.join(dst, "model.safetensors")
    sd = {k: v for k, v in load_file(weights).items() if k not in drop}
    sd.update(add or {})
    for k, shape in (reshape or {}).items():
        sd[k] = torch.zeros(shape)
    save_file(sd, weights, metadata={"format": "pt"})
    if config is not None:
        with open(os.path.join(dst, "config.json"), "w") as f:
            f.write(config)
    for f in remove:
        os.remove(os.path.join(dst, f))
    for f, text in (write or {}).items():
        with open(os.path.join(dst, f), "w") as fh:
            fh.write(text)
    return str(dst)


@pytest.mark.parametrize(
    "damage, message",
    [
        (dict(config='{"model_type": "llama", "hidden'), r"its config.json cannot be read as a model config \(OSError"),
        (dict(config="{}"), r"its config.json cannot be read as a model config \(ValueError: Unrecognized model"),
        (dict(write={"tokenizer.json": "{"}), r"its tokenizer cannot be loaded \(JSONDecodeError"),
        (dict(remove=["model.safetensors"]), r"has no weights \(no \*.safetensors or \*.bin file\)"),
        (
            dict(
                write={
                    "model.safetensors.index.json": json.dumps(
                        {"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}
                    )
                }
            ),
            r".*model.safetensors.index.json names 1 shard\(s\) the folder lacks: model-00002-of-00002.safetensors",
        ),
    ],
)
def test_damaged_model_folders_are_refused_before_any_model_loads(tmp_path, tiny_dir, damage, message):
    from config import Config, check_model

    path = _damaged_copy(tiny_dir, tmp_path / "m", **damage)
    with pytest.raises(ValueError, match=rf"--model {re.escape(path)}: {message}|--model {re.escape(path)} {message}"):
        check_model(Config(model=path), path, addition_task(n_train=10, n_test=2))


def test_a_tokenizer_without_a_pad_token_pads_with_eos(tmp_path, tiny_dir):
    """Llama 3 and other base models ship no pad token; the trainer pads (masked out) with EOS instead of failing
    on the first batch."""
    from config import Config, check_model

    config = json.load(open(os.path.join(tiny_dir, "tokenizer_config.json")))
    del config["pad_token"]
    path = _damaged_copy(tiny_dir, tmp_path / "m", write={"tokenizer_config.json": json.dumps(config)})
    assert transformers.AutoTokenizer.from_pretrained(path).pad_token_id is None
    assert check_model(Config(model=path), path, addition_task(n_train=10, n_test=2)).pad_token_id == EOS_ID


@pytest.mark.parametrize(
    "damage, message",
    [
        (
            dict(drop=["model.layers.1.mlp.down_proj.weight"]),
            "lacks 1 tensor(s) that {} needs: model.layers.1.mlp.down_proj.weight",
        ),
        (
            dict(add={"model.layers.9.mlp.up_proj.weight": torch.zeros(2)}),
            "has 1 tensor(s) that {} does not use: model.layers.9.mlp.up_proj.weight",
        ),
        (
            dict(reshape={"model.norm.weight": (7,)}),
            "has 1 tensor(s) of another shape than the model's: model.norm.weight ((7,) in the files, (128,) in the model)",
        ),
    ],
)
def test_weights_that_do_not_fill_the_architecture_are_refused_by_name(tmp_path, tiny_dir, damage, message):
    """Every place that loads a model folder: the policy and reference (load_policy), the critic's backbone
    (build_critic) and the embedded engine; transformers alone would fill a missing tensor with random values."""
    from embedded_engine import EmbeddedEngine
    from value_model import build_critic, load_critic, load_policy

    path = _damaged_copy(tiny_dir, tmp_path / "m", **damage)
    for load, cls in (
        (load_policy, "LlamaForCausalLM"),
        (build_critic, "LlamaForTokenClassification"),
        (EmbeddedEngine, "LlamaForCausalLM"),
    ):
        with pytest.raises(
            ValueError,
            match=re.escape(
                f"the weights in {path} (model.safetensors) do not match its config.json: "
                f"the folder {message.format(cls)}"
            ),
        ):
            load(path)
    critic = build_critic(tiny_dir)  # the policy's files have no value head: that one is new
    critic.save_pretrained(tmp_path / "critic")
    _damaged_copy(tmp_path / "critic", tmp_path / "critic_broken", drop=["score.weight"])
    with pytest.raises(
        ValueError,
        match=r"the critic checkpoint: .* lacks 1 tensor\(s\) that LlamaForTokenClassification needs: score.weight",
    ):
        load_critic(str(tmp_path / "critic_broken"))
    load_critic(str(tmp_path / "critic"))


SYSTEM_REFUSED = "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}{{ m['content'] }}{% endfor %}"


@pytest.mark.e2e
@pytest.mark.parametrize(
    "case, message",
    [
        (
            "missing_tensor",
            r"--model: the weights in .*/m \(model.safetensors\) do not match its config.json: the folder lacks 1 "
            r"tensor\(s\) that LlamaForCausalLM needs: model.layers.2.self_attn.o_proj.weight",
        ),
        ("truncated_config", r"--model .*/m: its config.json cannot be read as a model config"),
        ("answered_prompt", r"d.jsonl: row 2 \(line 3\) field 'prompt' ends on message 1 of role 'assistant'"),
        (
            "template_fails",
            r"d.jsonl: row \d \(line \d\): the chat template of .*/m fails on this prompt \(roles: system, user\)",
        ),
        ("compact_at", r"--compact-at 40 is below the longest prompt \(guess: \w+ row \d+: 30 tokens\)"),
    ],
)
def test_hostile_inputs_stop_the_run_before_training(tmp_path, tiny_dir, case, message):
    """main() on each: the error names the file, row, tensor or flag, and nothing is written to the run folder."""
    from conftest import small
    from train_ppo import main

    damage = {
        "missing_tensor": dict(drop=["model.layers.2.self_attn.o_proj.weight"]),
        "truncated_config": dict(config='{"model_'),
        "template_fails": dict(write={"chat_template.jinja": SYSTEM_REFUSED}),
    }.get(case, {})
    model = _damaged_copy(tiny_dir, tmp_path / "m", **damage)
    last = _msgs("system", "user") if case == "template_fails" else _msgs("user", "assistant")
    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "answer": str(i)} for i in range(2)] + [
        {"prompt": last, "answer": "9"}
    ]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    kw = dict(task=str(tmp_path / "d.jsonl")) if case in ("answered_prompt", "template_fails") else {}
    if case == "compact_at":
        kw = dict(task="guess", compact_at=40)
    with pytest.raises(ValueError, match=message):
        main(small(tmp_path / "run", model=model, **kw))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_reasoning_gym_task():
    """--task rg:<name>: train and test rows from disjoint index ranges of one generator (no shared question), the
    reward is the dataset's own score_answer on the entry (metadata included), and an unknown name is refused naming it."""
    require_extras(["reasoning_gym"], "pip install reasoning-gym (requirements-dev.txt)")
    import reasoning_gym

    task = get_task("rg:basic_arithmetic")
    train, test = task.train.to_list(), task.test.to_list()
    assert (
        len(train) == 10000
        and 400 < len(test) <= 500
        and not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    )
    ds = reasoning_gym.create_dataset("basic_arithmetic", seed=0, size=10500)
    row = test[3]
    assert ds[row["rg_index"]]["question"] == row["prompt"]
    completions = [row["answer"], row["answer"] + "1", " " + row["answer"] + "\n"]
    sc = score(task, completions, reward_columns(task.test.select([3, 3, 3])))
    assert (
        sc.rewards.tolist()
        == pytest.approx([ds.score_answer(answer=c, entry=ds[row["rg_index"]]) for c in completions])
        and sc.rewards[0] == 1
    )
    with pytest.raises(ValueError, match="reasoning-gym has no dataset 'no_such_task'"):
        get_task("rg:no_such_task")


def test_reasoning_gym_options():
    """--task rg:<name>:<option>=<value>,...: the options reach the dataset's config (read as its defaults are typed:
    a bool, an int, a tuple of "|"-separated items), suffix= ends every prompt, train and test stay disjoint."""
    require_extras(["reasoning_gym"], "pip install reasoning-gym (requirements-dev.txt)")
    import reasoning_gym

    from data.rg import rg_rows

    spec = "basic_arithmetic:min_terms=2,max_terms=2,max_digits=2,operators=+|-,allow_negation=false,suffix=Say it."
    train, test, score_fn = rg_rows(spec, n_train=200, n_test=50)
    kw = dict(min_terms=2, max_terms=2, max_digits=2, operators=("+", "-"), allow_negation=False)
    ds = reasoning_gym.create_dataset("basic_arithmetic", seed=0, size=250, **kw)
    assert [r["prompt"] for r in train] == [f"{ds[i]['question'].rstrip()} Say it." for i in range(200)]
    assert all("*" not in r["prompt"] and "/" not in r["prompt"] for r in train + test)
    assert test and not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    row = test[0]
    assert score_fn([row["answer"], "x"], answer=[row["answer"]] * 2, rg_index=[row["rg_index"]] * 2) == [1.0, 0.0]
    # train=N: N train entries, so a config with few distinct questions (about 200 here) keeps held-out ones
    train, test, _ = rg_rows("chain_sum:min_terms=2,max_terms=2,max_digits=1,train=100", n_test=500)
    assert len(train) == 100 and len(test) > 50 and not {r["prompt"] for r in train} & {r["prompt"] for r in test}


@pytest.mark.parametrize(
    "spec, message",
    [
        (
            "chain_sum:max_digit=2",
            r"--task rg:chain_sum:max_digit=2: ChainSumConfig has no option 'max_digit' \(it has",
        ),
        ("chain_sum:max_digits=two", r"option max_digits='two' is not an int \(its default is 4\)"),
        ("chain_sum:max_digits=2.5", r"option max_digits='2.5' is not an int"),
        ("chain_sum:allow_negation=maybe", r"option allow_negation='maybe' is not true or false"),
        ("chain_sum:min_terms=5,max_terms=2", r"--task rg:chain_sum:min_terms=5,max_terms=2: ChainSumConfig refuses"),
        ("chain_sum:seed=3", r"option 'seed' is set by data/rg.py"),
        ("chain_sum:max_digits", r"'max_digits' is not option=value"),
        ("chain_sum:max_digits=1,max_digits=2", r"option 'max_digits' is given twice"),
        ("chain_sum:train=0", r"train='0' must be a whole number of train rows >= 1"),
        (
            "chain_sum:min_terms=2,max_terms=2,max_digits=1",
            r"every one of the 500 test questions is also a train question",
        ),
    ],
)
def test_reasoning_gym_bad_options(spec, message):
    """A bad --task rg: option is a ValueError naming --task and the option, raised while the task is built (before
    any model loads); so is a config too small to leave a test question that no train question repeats."""
    require_extras(["reasoning_gym"], "pip install reasoning-gym (requirements-dev.txt)")
    with pytest.raises(ValueError, match=message):
        get_task(f"rg:{spec}")
