"""Bring your own reward, data and evaluation: --reward, --task forms and keys, chat prompts, --eval-task,
None rewards in PPO and GRPO, pass@k and maj@k, the samples file, and the run from the command line."""

import itertools
import json
import math
import time

import datasets
import pytest
import torch

import losses as L
from conftest import train_cli
from data.rewards import extract_answer, load_reward, majority_correct, math_reward, pass_at_k, reward_columns, score
from data.tasks import Task, check_lengths, encode_prompt, get_task, load_task
from data.tiny import build_tokenizer
from update import denominator


def addition_rows(n):
    return [{"question": f"{i:03d}+{2 * i:03d}", "solution": f"{3 * i:04d}", "difficulty": i % 3} for i in range(n)]


# ----------------------------------------------------------------------------- (a) the done criterion, end to end

REWARD_FILE = """
import json, os

def fn(completions, *, prompts, answer, difficulty, **columns):
    with open(os.environ["BYO_LOG"], "a") as f:
        f.write(json.dumps({"n": len(completions), "keys": sorted(columns) + ["difficulty"], "prompts": prompts,
                            "difficulty": difficulty}) + "\\n")
    return [None if d == 2 else {"score": float(c.strip() == a), "pred": c.strip(), "len": len(c)}
            for c, a, d in zip(completions, answer, difficulty)]
"""


@pytest.mark.e2e
def test_command_line_run_with_own_reward_and_folder(tmp_path):
    """A save_to_disk folder with other field names and an extra column, a reward file: one PPO step from the
    command line; the reward receives `difficulty` by name, aligned with its prompts; pass@k, maj@k, the None
    fraction and the samples files land in the run folder."""
    rows = addition_rows(80)  # a seeded 10% = 8 held-out problems
    folder = str(tmp_path / "data")
    datasets.Dataset.from_list(rows).save_to_disk(folder)
    (tmp_path / "reward.py").write_text(REWARD_FILE)
    out, log = tmp_path / "run", tmp_path / "calls.jsonl"
    res = train_cli(
        "--task",
        folder,
        "--prompt-key",
        "question",
        "--answer-key",
        "solution",
        "--reward",
        f"{tmp_path / 'reward.py'}:fn",
        "--steps",
        "1",
        "--rollout-batch",
        "8",
        "--eval-size",
        "8",
        "--critic-pretrain",
        "0",
        "--eval-samples",
        "4",
        "--out-dir",
        out,
        env={"BYO_LOG": str(log)},
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]

    truth = {r["question"]: r["difficulty"] for r in rows}
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert [c["n"] for c in calls] == [8, 32, 8, 8, 32]  # eval before RL (greedy 8, sampled 8 x 4), rollout, eval after
    for c in calls:
        assert c["keys"] == ["difficulty"]  # `where` is not passed; no other column exists
        assert c["difficulty"] == [truth[p] for p in c["prompts"]]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    last = metrics[-1]
    assert last["step"] == 1
    for k in ("eval/pass@1", "eval/pass@2", "eval/pass@4", "eval/maj@1", "eval/maj@4", "eval/mean@4", "reward/len"):
        assert k in last and math.isfinite(last[k]), k
    assert last["eval/pass@1"] <= last["eval/pass@2"] <= last["eval/pass@4"]
    train_call = calls[2]  # the rollout of step 1
    assert last["rollout/no_reward_frac"] == pytest.approx(sum(d == 2 for d in train_call["difficulty"]) / 8)
    for step in (0, 1):
        samples = [json.loads(line) for line in (out / "samples" / f"step_{step:06d}.jsonl").read_text().splitlines()]
        assert sum(s["kind"] == "greedy" for s in samples) == 8 and sum(s["kind"] == "sampled" for s in samples) == 32
        for s in samples:
            if truth[s["prompt"]] == 2:
                assert s["reward"] is None
            else:
                assert {"prompt", "answer", "completion", "pred", "len"} <= set(s) and s["reward"] in (0.0, 1.0)


# ----------------------------------------------------------------------------- (b) None rewards


def test_grpo_advantages_use_the_rewarded_members_only():
    scores = torch.tensor([1.0, 0.0, 5.0, 1.0, 2.0, 3.0, 0.0, 9.0])
    valid = torch.tensor([True, True, False, True, True, False, False, False])
    adv = L.grpo_advantages(scores, 4, valid=valid)
    g = torch.tensor([1.0, 0.0, 1.0])  # group 0's rewarded members
    torch.testing.assert_close(adv[[0, 1, 3]], (g - g.mean()) / (g.std() + 1e-6))
    assert adv[2] == 0 and (adv[4:] == 0).all()  # a None member, and a group with 1 rewarded member: nothing
    torch.testing.assert_close(
        L.grpo_advantages(scores, 4, valid=torch.ones(8, dtype=torch.bool)), L.grpo_advantages(scores, 4)
    )
    dr = L.grpo_advantages(scores, 4, norm_std=False, valid=valid)
    torch.testing.assert_close(dr[[0, 1, 3]], g - g.mean())


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_ppo_none_row_leaves_the_loss(agg):
    """With a None row masked out, GAE advantages and the policy loss (its denominator over the kept rows) equal those of
    the batch without that row. (Masked entries leave the whitening: test_losses' hand case.)"""
    g = torch.Generator().manual_seed(0)
    B, T = 4, 5
    gen = torch.tensor([[1] * 5, [1] * 3 + [0] * 2, [1] * 4 + [0], [1] * 2 + [0] * 3]).bool()
    keep = torch.tensor([True, False, True, True])
    scores = torch.tensor([1.0, 7.0, 0.0, 1.0])
    values, old = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    logp = (old + 0.1 * torch.randn(B, T, generator=g)).requires_grad_()

    def run(rows, mask):
        r = torch.zeros(len(rows), T)
        r[torch.arange(len(rows)), gen[rows].sum(-1) - 1] = scores[rows]
        adv = L.gae(r, values[rows], mask, 1.0, 0.95)[0]
        denom = denominator(mask, keep[rows], agg, T, None)
        loss, _ = L.ppo_policy_loss(
            logp[rows], old[rows], adv, mask, clip_low=0.2, clip_high=0.28, agg=agg, num_tokens=denom
        )
        return adv, loss

    everything = torch.arange(B)
    adv_all, loss_all = run(everything, gen & keep[:, None])
    adv_sub, loss_sub = run(everything[keep], gen[keep])
    torch.testing.assert_close(adv_all[keep], adv_sub)
    assert (adv_all[1] == 0).all()
    torch.testing.assert_close(loss_all, loss_sub)


def test_score_none_and_dicts():
    ds = datasets.Dataset.from_dict({"prompt": ["p"], "answer": ["a"]})

    def task(fn):
        return Task("t", ds, ds, fn, 4)

    cols = {"prompt": ["p"] * 3, "answer": ["a"] * 3}
    sc = score(task(lambda c, **_: [None, {"score": 2.0, "pred": "x", "n": 3}, 1]), ["a", "b", "c"], cols)
    assert sc.rewards.tolist() == [0.0, 2.0, 1.0] and sc.rewarded.tolist() == [False, True, True]
    assert sc.extras == [{}, {"pred": "x", "n": 3}, {}]

    def no_score(completions, **_):
        return [{"pred": "x"}] * len(completions)

    with pytest.raises(RuntimeError, match=r"no_score returned a dict without 'score' for sample 0"):
        score(task(no_score), ["a", "b", "c"], cols)
    with pytest.raises(RuntimeError, match="unhashable 'pred'"):
        score(task(lambda c, **_: [{"score": 1, "pred": [1]}] * 3), ["a", "b", "c"], cols)


# ----------------------------------------------------------------------------- (c) the reward loader


def test_load_reward_errors_name_the_flag(tmp_path):
    f = tmp_path / "r.py"
    f.write_text("LIMIT = 3\ndef good(completions, **_):\n    return [1.0] * len(completions)\n")
    (tmp_path / "broken.py").write_text("raise RuntimeError('oops')\n")
    assert load_reward(f"{f}:good")(["a", "b"]) == [1.0, 1.0]
    assert load_reward("").__name__ == load_reward("exact").__name__ == "exact"
    assert load_reward("data.rewards:math_reward") is math_reward
    for spec, msg in [
        ("nonsense", "is not a reward: give '' or 'exact'"),
        (f"{tmp_path}/missing.py:fn", "no such file"),
        (f"{f}:bad", r"has no function 'bad' \(its callables: good\)"),
        (f"{f}:LIMIT", "is a int, not a function"),
        (f"{tmp_path}/broken.py:fn", r"running .*broken.py raised RuntimeError\('oops'\)"),
        ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz'"),
        (f"{f}:", "is not a reward"),
    ]:
        with pytest.raises(ValueError, match=r"--reward .*" + msg):
            load_reward(spec)  # (resolve names it as a configuration error: test_refusals.py)


def test_math_reward_extracts_and_verifies():
    assert extract_answer("so \\boxed{\\frac{1}{2}} done") == "\\frac{1}{2}"
    assert extract_answer("first 3 then 1,234.5") == "1234.5" and extract_answer("none") is None
    got = math_reward(
        ["the answer is \\boxed{1/2}", "I get 0.5", "it is 7", "no idea", "\\boxed{3}"],
        answer=["0.5", "\\frac{1}{2}", "8", "1", "3.0"],
    )
    assert [g["score"] for g in got] == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert [g["pred"] for g in got] == ["1/2", "0.5", "7", None, "3"]


# ----------------------------------------------------------------------------- (d) data forms and chat prompts


def _write_forms(tmp_path, rows):
    import csv

    (tmp_path / "list.json").write_text(json.dumps(rows))
    (tmp_path / "lines.json").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with open(tmp_path / "t.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows), "dev": datasets.Dataset.from_list(rows[:5])}
    ).save_to_disk(str(tmp_path / "dd"))


def test_every_data_form_loads_with_keys_and_columns(tmp_path):
    rows = [{k: str(v) for k, v in r.items()} for r in addition_rows(20)]  # CSV holds strings
    _write_forms(tmp_path, rows)
    want = sorted((r["question"], r["solution"], r["difficulty"]) for r in rows)
    for name in ("list.json", "lines.json", "t.csv", "dd"):
        task = get_task(str(tmp_path / name), prompt_key="question", answer_key="solution")
        got = task.train.to_list() + task.test.to_list()
        assert sorted((r["prompt"], r["answer"], r["difficulty"]) for r in got) == want, name
        assert not set(task.train["prompt"]) & set(task.test["prompt"])
    assert len(get_task(str(tmp_path / "dd"), split="dev", prompt_key="question", answer_key="solution").train) == 4
    with pytest.raises(
        ValueError, match=r"--task .*dd: no split 'valid'; it has \['dev', 'train'\]: choose one with --split"
    ):
        get_task(str(tmp_path / "dd"), split="valid", prompt_key="question", answer_key="solution")
    with pytest.raises(ValueError, match=r"t.csv: row 0 \(line 2\) has no field 'prompt'"):
        get_task(str(tmp_path / "t.csv"))
    bad = rows[:3] + [{**rows[3], "solution": None}]
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=r"bad.json: row 3 field 'solution' is null"):
        get_task(str(tmp_path / "bad.json"), prompt_key="question", answer_key="solution")
    mixed = rows[:3] + [{**rows[3], "difficulty": 2}]
    (tmp_path / "mixed.json").write_text(json.dumps(mixed))
    with pytest.raises(ValueError, match=r"row 3 field 'difficulty' is a number, but row 0 has a str"):
        get_task(str(tmp_path / "mixed.json"), prompt_key="question", answer_key="solution")


def test_eval_task_is_the_whole_held_out_set(tmp_path, capsys):
    rows = addition_rows(20)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[15:] + addition_rows(30)[25:]))
    task = get_task(
        str(tmp_path / "train.jsonl"),
        prompt_key="question",
        answer_key="solution",
        eval_task=str(tmp_path / "eval.jsonl"),
    )
    assert len(task.test) == 10 and len(task.train) == 15  # the 5 shared prompts leave train
    assert "dropped 5 train rows whose prompt is in the --eval-task set" in capsys.readouterr().out
    assert not set(task.train["prompt"]) & set(task.test["prompt"])
    built_in = get_task(
        "addition", prompt_key="question", answer_key="solution", eval_task=str(tmp_path / "eval.jsonl")
    )
    assert len(built_in.test) == 10 and built_in.test["where"][0].endswith("eval.jsonl: row 0 (line 1)")


def test_chat_message_prompts(tmp_path):
    tok = build_tokenizer()

    def msgs(i):
        return [{"role": "system", "content": "add"}, {"role": "user", "content": f"{i:03d}+{i:03d}"}]

    rows = [{"prompt": msgs(i), "answer": f"{2 * i:04d}"} for i in range(12)]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows + [rows[4]]))  # an exact repeat is dropped
    task = load_task(str(path), test_fraction=0.25)
    assert len(task.train) + len(task.test) == 12

    def keys(ds):
        return {json.dumps(p, sort_keys=True) for p in ds["prompt"]}

    assert not keys(task.train) & keys(task.test)
    p = task.train[0]["prompt"]
    assert (
        encode_prompt(tok, p)
        == tok(
            tok.apply_chat_template(p, add_generation_prompt=True, tokenize=False), add_special_tokens=False
        ).input_ids
    )
    assert tok.decode(encode_prompt(tok, p)).startswith("<|im_start|>system\nadd<|im_end|>\n<|im_start|>user\n")
    check_lengths(task, tok, context_len=256, max_new_tokens=8)
    sc = score(task, ["0000"] * 2, reward_columns(task.train.select([0, 1])))
    assert sc.rewarded.all()
    folder = str(tmp_path / "chat_ds")  # the same rows through save_to_disk (a struct column)
    datasets.Dataset.from_list(rows).save_to_disk(folder)
    assert get_task(folder).train[0]["prompt"][0] == {"role": "system", "content": "add"}

    path.write_text("".join(json.dumps(r) + "\n" for r in rows + [{**rows[4], "answer": "9"}]))
    with pytest.raises(ValueError, match=r"row 12 \(line 13\) repeats the prompt of row 4 \(line 5\)"):
        load_task(str(path))
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:3] + [{"prompt": [{"role": "user"}], "answer": "1"}]))
    with pytest.raises(
        ValueError,
        match=r"row 3 \(line 4\) field 'prompt' message 0 is \{'role': 'user'\}, expected a dict with string 'role' and 'content'",
    ):
        load_task(str(path))


# ----------------------------------------------------------------------------- (e) the hub, offline


def test_hub_name_fails_fast_with_a_clear_offline_message(monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there: refused at once
    t = time.perf_counter()
    with pytest.raises(
        ValueError,
        match=r"--task 'someone/some-data' is not a file or folder here, so it was taken as a "
        r"Hugging Face hub dataset, and the hub \(http://127.0.0.1:9\) cannot be reached.*save_to_disk",
    ):
        get_task("someone/some-data")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # offline mode: only a cached copy could load
    with pytest.raises(
        ValueError, match=r"--eval-task 'someone/other'.*the hub is off \(HF_HUB_OFFLINE\) and it is not cached"
    ):
        get_task("addition", eval_task="someone/other")
    assert time.perf_counter() - t < 60


# ----------------------------------------------------------------------------- (f) pass@k and maj@k


def test_pass_at_k_equals_enumeration_over_k_subsets():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                correct = [True] * c + [False] * (n - c)
                subsets = list(itertools.combinations(range(n), k))
                slow = sum(any(correct[i] for i in s) for s in subsets) / len(subsets)
                assert pass_at_k(n, c, k) == pytest.approx(slow, abs=1e-12), (n, c, k)
    assert 0 < pass_at_k(1000, 1, 1) == pytest.approx(1e-3) and pass_at_k(200, 3, 100) < 1  # no overflow
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)


def test_majority_vote():
    assert majority_correct(["a", "b", "b", "a"], [0, 1, 1, 0], 3)  # b wins 2 to 1, its sample is rewarded
    assert not majority_correct(["a", "b", "b", "a"], [0, 1, 1, 0], 4)  # 2-2 tie: a came first, its reward is 0
    assert majority_correct(["a", "b", "b", "a"], [0, 1, 1, 0], 1) is False
    assert majority_correct([None, None, "x"], [0, 0, 1], 3)  # None does not vote
    assert not majority_correct([None, None, "x"], [0, 0, 1], 2)  # no vote at all: incorrect
    assert majority_correct([3, 3.0, 2], [1, 0, 0], 3)  # the first sample with the voted pred decides
