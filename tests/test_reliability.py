"""Bad input is refused before any model is loaded, with the flag named; a run folder is never corrupted, by a
second run, a damaged checkpoint, a torn metrics line or a changed resume; the non-finite guard is real."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import evaluation
import train_ppo
from conftest import ENV, REPO, small
from data.rewards import Scores
from data.tasks import get_task
from runlog import latest_checkpoint, lock_run_dir
from train_ppo import check_finite, main, optimizer_step


@pytest.fixture
def model_copy(tmp_path, tiny_model_dir):
    """model_copy(name): a copy of the default tiny model folder, to break in a test."""
    def copy(name="model") -> str:
        dst = str(tmp_path / name)
        shutil.copytree(tiny_model_dir, dst)
        return dst
    return copy


# ----------------------------------------------------------------------------- bad input, before any work (the config table: test_refusals.py)


def _break_config(path, **changes):
    cfg = json.loads(open(os.path.join(path, "config.json")).read())
    cfg.update(changes)
    open(os.path.join(path, "config.json"), "w").write(json.dumps(cfg))


def test_model_folder_problems_are_named_before_weights_load(tmp_path, model_copy):
    """Each folder has no weights at all: the error must come from the checks, not from loading."""
    for name, fix, msg in [
        ("gpt2", lambda p: _break_config(p, model_type="gpt2"), "model type 'gpt2' is not supported"),
        ("small_vocab", lambda p: _break_config(p, vocab_size=8), "the tokenizer has .* tokens but the model's vocabulary only 8"),
        ("no_tok", lambda p: [os.remove(os.path.join(p, f)) for f in os.listdir(p) if f.startswith(("tokenizer", "special", "vocab", "merges", "chat"))],
         "has no tokenizer files"),
    ]:
        path = model_copy(name)
        os.remove(os.path.join(path, "model.safetensors"))
        fix(path)
        with pytest.raises(ValueError, match=msg):
            main(small(tmp_path / f"run_{name}", model=path))


def test_max_new_tokens_beyond_the_context_names_the_flag(tmp_path):
    with pytest.raises(ValueError, match="--max-new-tokens 100000 leaves no room for a prompt"):
        main(small(tmp_path, max_new_tokens=100000))


def test_truncated_model_weights_are_named(tmp_path, model_copy):
    path = model_copy()
    st = os.path.join(path, "model.safetensors")
    os.truncate(st, os.path.getsize(st) // 2)
    with pytest.raises(ValueError, match="model.safetensors is truncated or damaged"):
        main(small(tmp_path / "run", model=path))


def test_over_long_data_row_is_found_before_training(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}", "answer": str(2 * i)}) + "\n" for i in range(20))
                    + json.dumps({"prompt": "9 " * 2000, "answer": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"d.jsonl: row 20 \(line 21\)"):
        main(small(tmp_path / "run", task=str(data)))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# ----------------------------------------------------------------------------- the non-finite guard


@pytest.mark.e2e
def test_huge_rewards_stop_the_run_on_the_critic(tmp_path, monkeypatch):
    """Rewards of 1e30 overflow the value loss: the critic's updates are skipped, and good policy updates no
    longer reset its count (one counter per model), so the run stops instead of exiting 0 having learned nothing."""
    monkeypatch.setattr(evaluation, "score", lambda task, completions, columns: Scores.of(torch.full((len(completions),), 1e30)))
    with pytest.raises(RuntimeError, match="consecutive critic updates had a non-finite loss or gradient"):
        main(small(tmp_path, steps=6, max_bad_steps=3))


def test_non_finite_weights_after_a_step_stop_the_run(tmp_path):
    class Poison(torch.optim.SGD):
        def step(self, closure=None):
            super().step(closure)
            self.param_groups[0]["params"][0].data.fill_(float("inf"))

    model = torch.nn.Linear(2, 1)
    opt = Poison(model.parameters(), lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    norm, ok, weights_ok = optimizer_step(model, opt, small(tmp_path), None)
    assert ok and not weights_ok
    with pytest.raises(RuntimeError, match="the policy update made its weights non-finite.*lower --lr"):
        check_finite(ok, weights_ok, {"policy": 0}, "policy", "step 3", norm, small(tmp_path))


@pytest.mark.e2e
def test_blow_up_points_at_the_checkpoint_before_it_and_resumes_with_a_new_lr(tmp_path, monkeypatch):
    """GRPO rewards of +-3e38 from step 3 on: updates 3, 4, 5 are skipped, no checkpoint is written meanwhile,
    the error names step 2's, and a resume with a lower --lr starts from it with that lr in the optimiser."""
    calls = {"train": 0}

    def score(task, completions, columns):
        if len(completions) == 16:  # a rollout batch (evaluation batches have 8)
            calls["train"] += 1
            if calls["train"] >= 3:
                return Scores.of(torch.tensor([3e38 if i % 2 else -3e38 for i in range(16)]))
        return Scores.of(torch.zeros(len(completions)))

    monkeypatch.setattr(evaluation, "score", score)
    cfg = small(tmp_path, algo="grpo", grpo_std=False, steps=8, save_every=1, keep_checkpoints=5, max_bad_steps=3)
    with pytest.raises(RuntimeError, match=r"3 consecutive policy updates.*resume from .*step_000002"):
        main(cfg)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_000001", "step_000002"]
    monkeypatch.setattr(evaluation, "score", lambda task, completions, columns: Scores.of(torch.zeros(len(completions))))
    hist = main(small(tmp_path, algo="grpo", grpo_std=False, steps=3, save_every=1, keep_checkpoints=5, max_bad_steps=3, lr=1e-5))
    assert [r["step"] for r in hist if "pretrain/step" not in r] == [0, 1, 2, 3]
    state = torch.load(tmp_path / "checkpoints" / "step_000003" / "trainer_rank0.pt", weights_only=True)
    assert state["optimizers"]["policy"]["param_groups"][0]["lr"] == 1e-5
    assert json.load(open(tmp_path / "config.json"))["resumes"] == [{"step": 2, "changed": {"steps": [8, 3], "lr": [0.0002, 1e-05]}}]


# ----------------------------------------------------------------------------- the run folder


@pytest.mark.e2e
def test_resume_refuses_changes_it_cannot_honour(tmp_path):
    main(small(tmp_path, steps=1))
    for kw, named in [(dict(algo="grpo"), "--algo 'ppo' -> 'grpo'"), (dict(task="sort"), "--task 'addition' -> 'sort'"),
                      (dict(freeze_critic_attention=True), "--freeze-critic-attention False -> True"),
                      (dict(clip_high=0.3), "--clip-high 0.28 -> 0.3")]:
        with pytest.raises(ValueError, match="that this resume would change: " + named.replace("(", r"\(")):
            main(small(tmp_path, steps=2, **kw))
    assert os.listdir(tmp_path / "checkpoints") == ["step_000001"]
    hist = main(small(tmp_path, steps=2, eval_size=16))  # more steps and another evaluation size are fine
    assert hist[-1]["step"] == 2


def test_a_second_live_run_into_the_folder_is_refused(tmp_path):
    held = lock_run_dir(str(tmp_path))
    with pytest.raises(RuntimeError, match="is in use by a live run"):
        main(small(tmp_path))
    held.close()
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.e2e
def test_damaged_newest_checkpoint_falls_back_and_torn_metrics_line_is_dropped(tmp_path, capsys):
    main(small(tmp_path, steps=2, save_every=1))
    st = tmp_path / "checkpoints" / "step_000002" / "policy" / "model.safetensors"
    os.truncate(st, os.path.getsize(st) - 100)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "rollout/rew')
    assert latest_checkpoint(str(tmp_path)).endswith("step_000001")
    assert "skipped damaged step_000002" in capsys.readouterr().out
    hist = main(small(tmp_path, steps=3, save_every=1))
    assert [r["step"] for r in hist] == [0, 1, 2, 3]
    for d in os.listdir(tmp_path / "checkpoints"):
        os.truncate(tmp_path / "checkpoints" / d / "trainer_rank0.pt", 10)
    with pytest.raises(RuntimeError, match="every checkpoint in .* is damaged"):
        latest_checkpoint(str(tmp_path))


@pytest.mark.torchrun
def test_killing_the_torchrun_agent_kills_its_workers(tmp_path):
    script = tmp_path / "w.py"
    script.write_text(f"import os, sys, time\nsys.path.insert(0, {REPO!r})\nfrom parallel import init_runtime\ninit_runtime()\n"
                      f"open({str(tmp_path / 'pid')!r}, 'w').write(str(os.getpid()))\ntime.sleep(120)\n")
    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", str(script)],
                             env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not (tmp_path / "pid").exists() and time.time() < deadline:
        time.sleep(0.2)
    worker = int((tmp_path / "pid").read_text())
    agent.send_signal(signal.SIGKILL)
    agent.wait(30)
    for _ in range(50):
        if not os.path.exists(f"/proc/{worker}") or open(f"/proc/{worker}/stat").read().split()[2] == "Z":
            return
        time.sleep(0.1)
    os.kill(worker, signal.SIGKILL)
    pytest.fail("the worker outlived its torchrun agent")


def test_tp_that_cannot_split_the_heads_is_refused_before_weights_load(tmp_path, model_copy):
    path = model_copy()
    os.remove(os.path.join(path, "model.safetensors"))  # the check must not need the weights
    with pytest.raises(ValueError, match="not divisible by tp=3"):
        train_ppo.check_model(small(tmp_path, tp=3), path, get_task("addition"))


class _Payload:
    def __reduce__(self):  # unpickling this runs os.system
        return (os.system, ("touch /tmp/icepop_payload_ran",))


def test_trainer_state_with_a_pickle_payload_is_refused(tmp_path):
    """A trainer_rank0.pt carrying a pickled callable is refused on load; the callable never runs."""
    from runlog import load_trainer_state

    marker = "/tmp/icepop_payload_ran"
    if os.path.exists(marker):
        os.remove(marker)
    torch.save({"step": 1, "optimizers": {}, "rng": {"torch": torch.get_rng_state(), "python": None}, "x": _Payload()},
               tmp_path / "trainer_rank0.pt")
    with pytest.raises(Exception, match="Weights only load failed"):
        load_trainer_state(str(tmp_path), 0, 1, {})
    assert not os.path.exists(marker)
