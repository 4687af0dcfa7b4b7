"""--algo reinforce: REINFORCE with a running-mean per-prompt baseline (the SAO paper's control). The formula against
hand-computed cases, the table's window, fallback and order (a reward is never in its own baseline), a short run,
and a run stopped at a checkpoint and resumed that logs what an uninterrupted run logs (the table is in the checkpoint)."""

import json
import os
from dataclasses import replace

import datasets
import pytest
import torch

import losses as L
from conftest import read_metrics, small, torchrun, train_cli
from config import Config, resolve
from data.tasks import get_task, prompt_indices, prompt_keys
from train_ppo import main
from value_model import PromptBaseline


def test_running_mean_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.5])
    past = torch.tensor(
        [[1.0, 9.0, 9.0], [0.5, 1.0, 9.0], [9.0, 9.0, 9.0], [1.0, 1.0, 1.0]]
    )  # 9: past the count, ignored
    count = torch.tensor([1, 2, 0, 3])
    # baselines 1, (0.5 + 1) / 2, the batch mean 0.25 (no history), 1
    adv = L.running_mean_advantages(rewards, past, count, torch.tensor(0.25))
    assert adv.tolist() == [0.0, -0.75, 0.75, -0.5] and adv.dtype == torch.float32
    with pytest.raises(ValueError, match="do not match"):
        L.running_mean_advantages(rewards, past[:3], count[:3], torch.tensor(0.0))


def test_prompt_baseline_window_fallback_and_order():
    t = PromptBaseline(window=2)

    def step(p, r, v=None, s=None):
        return t.advantages(
            torch.tensor(p),
            torch.arange(len(p)) if s is None else torch.tensor(s),
            torch.tensor(r),
            torch.ones(len(p), dtype=torch.bool) if v is None else torch.tensor(v),
            len(p) if s is None else max(s) + 1,
        )

    # step 1: no history anywhere, prompt 3 twice: both rows get the batch mean 0.5, not each other's reward
    adv, had = step([3, 5, 3], [1.0, 0.0, 0.5])
    assert adv.tolist() == [0.5, -0.5, 0.0] and not had.any()
    assert t.table == {3: [1.0, 0.5], 5: [0.0]}
    # step 2: prompt 3's baseline 0.75, 5's 0; 7's row has no reward (0, not added); 8 has no history: the mean of this
    # step's rewarded rows, (0 + 1 + 0) / 3
    adv, had = step([3, 5, 7, 8], [0.0, 1.0, 1.0, 0.0], [True, True, False, True])
    assert adv.tolist() == pytest.approx([-0.75, 1.0, 0.0, -1 / 3], abs=1e-7) and had.tolist() == [
        True,
        True,
        False,
        False,
    ]
    assert t.table == {3: [0.5, 0.0], 5: [0.0, 1.0], 8: [0.0]}  # the window keeps the last 2: prompt 3 dropped its 1.0
    adv, _ = step([3], [1.0])
    assert adv.tolist() == [0.75]  # 1 - (0.5 + 0) / 2
    # the rows of one episode (compaction) share its sample: one pair per episode joins the table
    t2 = PromptBaseline(window=8)
    t2.advantages(
        torch.tensor([4, 4, 6]),
        torch.tensor([0, 0, 1]),
        torch.tensor([1.0, 1.0, 0.0]),
        torch.ones(3, dtype=torch.bool),
        2,
    )
    assert t2.table == {4: [1.0], 6: [0.0]}
    assert PromptBaseline(2, {"3": [1, 2, 3]}).table == {3: [2.0, 3.0]}  # a checkpoint's table, trimmed to the window


def test_prompt_keys_by_hand():
    """A row's key is the first row with its prompt; chat-message prompts compare as JSON, whatever their key order."""

    def chat(*kv):
        return [dict(kv)]

    ds = datasets.Dataset.from_list([{"prompt": "a"}, {"prompt": "b"}, {"prompt": "a"}])
    assert prompt_keys(ds) == [0, 1, 0]
    rows = {
        "prompt": [
            chat(("role", "user"), ("content", "x")),
            chat(("content", "y"), ("role", "user")),
            chat(("content", "x"), ("role", "user")),
        ]
    }
    assert prompt_keys(datasets.Dataset.from_dict(rows)) == [0, 1, 0]


def test_config():
    assert resolve(Config(algo="reinforce"), 1).n == 1
    for kw, msg in (
        (dict(kl="k1-reward"), "--kl k1-reward with --algo reinforce"),
        (dict(baseline_window=0), "--baseline-window must be >= 1"),
        (dict(critic_context="answer"), "--algo reinforce has none"),
    ):
        with pytest.raises(ValueError, match=msg):
            resolve(Config(algo="reinforce", **kw), 1)


PAIRS = [(12, 345), (999, 1), (500, 500), (7, 70), (123, 456), (31, 62), (250, 250), (808, 19), (111, 222), (321, 123)]


def _files(tmp_path):
    for name, pairs in (("train.jsonl", PAIRS[:8]), ("held.jsonl", PAIRS[8:])):
        (tmp_path / name).write_text(
            "".join(json.dumps({"prompt": f"{a:03d}+{b:03d}", "answer": f"{a + b:04d}"}) + "\n" for a, b in pairs)
        )


def _cfg(tmp_path, out, steps):
    """8 train prompts (and 2 held out): a batch of 8 visits each once per step, so from step 2 on every prompt has
    history."""
    _files(tmp_path)
    return small(
        out,
        task=str(tmp_path / "train.jsonl"),
        eval_task=str(tmp_path / "held.jsonl"),
        algo="reinforce",
        steps=steps,
        rollout_batch=8,
        save_every=2,
        deterministic=True,
        eval_size=2,
    )


@pytest.mark.e2e
def test_short_run_and_resume_equal_uninterrupted(tmp_path):
    """3 steps uninterrupted, against 2 steps then a resume to 3 from the step-2 checkpoint: the same figures (the
    table came back; without it step 3's baseline would be the batch mean and its gradient another)."""
    try:
        ref = main(_cfg(tmp_path, tmp_path / "ref", 3))
        main(_cfg(tmp_path, tmp_path / "run", 2))
        main(_cfg(tmp_path, tmp_path / "run", 3))
    finally:
        torch.use_deterministic_algorithms(False)
    steps = [r for r in ref if r["step"] > 0]
    assert [r["reinforce/history_frac"] for r in steps] == [0.0, 1.0, 1.0]
    assert all("critic/value_loss" not in r and r["train/skipped_update"] == 0 for r in steps)
    assert not os.path.exists(tmp_path / "ref" / "checkpoints" / "step_000002" / "critic")
    assert torch.load(tmp_path / "ref" / "checkpoints" / "step_000002" / "trainer_rank0.pt", weights_only=True)[
        "baseline"
    ]

    def no_eval(rs):
        return [{k: v for k, v in r.items() if not k.startswith("eval/")} for r in rs]

    run, ref_rows = read_metrics(tmp_path / "run", volatile=False), read_metrics(tmp_path / "ref", volatile=False)
    assert no_eval(run) == no_eval(ref_rows) and run[-1] == ref_rows[-1]


@pytest.mark.torchrun
def test_dp2_ranks_hold_the_one_process_table(tmp_path):
    """3 steps with dp=2 (4 rows per rank): both ranks checkpoint the same table, the one a single process builds (the
    rollouts do not depend on the split), and every step's history share and gradient norm match."""
    _files(tmp_path)
    args = [
        "train_ppo.py",
        "--task",
        tmp_path / "train.jsonl",
        "--eval-task",
        tmp_path / "held.jsonl",
        "--algo",
        "reinforce",
        "--steps",
        "3",
        "--rollout-batch",
        "8",
        "--save-every",
        "3",
        "--eval-size",
        "2",
        "--eval-every",
        "100",
        "--critic-pretrain",
        "0",
    ]
    one, two = train_cli(*args[1:], "--out-dir", tmp_path / "one"), torchrun(2, *args, "--out-dir", tmp_path / "two")
    assert one.returncode == 0 and two.returncode == 0, one.stderr[-3000:] + two.stdout[-3000:] + two.stderr[-3000:]

    def table(out, r):
        return torch.load(out / "checkpoints" / "step_000003" / f"trainer_rank{r}.pt", weights_only=True)["baseline"]

    assert (
        table(tmp_path / "two", 0) == table(tmp_path / "two", 1) == table(tmp_path / "one", 0)
        and len(table(tmp_path / "one", 0)) == 8
    )
    a, b = (read_metrics(tmp_path / x) for x in ("one", "two"))
    for ra, rb in zip(a[1:], b[1:]):
        assert ra["reinforce/history_frac"] == rb["reinforce/history_frac"]
        assert rb["ppo/grad_norm"] == pytest.approx(ra["ppo/grad_norm"], rel=1e-4)


@pytest.mark.e2e
def test_rows_that_repeat_a_prompt_share_its_baseline(tmp_path, tiny_model_dir):
    """--task walk: 20,000 train rows, 71 prompts. Step 2's rows whose prompt step 1 drew have history (keyed by row
    they would not: a row comes once per epoch). A checkpoint whose table is keyed by row (no baseline_keys) is refused.
    The policy is the tiny addition model: which rows have history depends on the prompts drawn, not on what the policy
    answers, so the test needs no walk model (whose build tests/test_walk.py checks)."""
    cfg = small(
        tmp_path / "run",
        model=tiny_model_dir,
        task="walk",
        algo="reinforce",
        rollout_batch=32,
        save_every=2,
        eval_size=2,
        engine_dtype="fp32",
    )
    rows = main(cfg)
    keys = prompt_keys(get_task("walk").train)
    first = {keys[i] for i in prompt_indices(cfg.seed, len(keys), 0, 32)}
    expect = sum(keys[i] in first for i in prompt_indices(cfg.seed, len(keys), 32, 32)) / 32
    assert (
        len(set(keys)) == 71
        and expect > 0.2
        and [r["reinforce/history_frac"] for r in rows if r["step"] > 0] == [0.0, expect]
    )
    path = tmp_path / "run" / "checkpoints" / "step_000002" / "trainer_rank0.pt"
    state = torch.load(path, weights_only=True)
    assert state.pop("baseline_keys") == "prompt"
    torch.save(state, path)
    with pytest.raises(ValueError, match="keyed by train row, not prompt"):
        main(replace(cfg, steps=3))
