"""Bad input is refused before any model is loaded, with the flag named; a run folder is never corrupted, by a
second run, a damaged checkpoint, a torn metrics line or a changed resume; the non-finite guard is real."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, replace

import pytest
import torch

import evaluation
import train_ppo
from checkpoint import (
    check_fresh_start,
    check_inputs,
    check_resume,
    input_fingerprints,
    latest_checkpoint,
    lock_run_dir,
)
from config import Config, check_model
from conftest import ENV, REPO, read_metrics, small, start_train, train_cli
from data.rewards import Scores, load_reward
from data.tasks import get_task
from train_ppo import main
from update import check_finite, optimizer_step


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
        (
            "small_vocab",
            lambda p: _break_config(p, vocab_size=8),
            "the tokenizer has .* tokens but the model's vocabulary only 8",
        ),
        (
            "no_tok",
            lambda p: [
                os.remove(os.path.join(p, f))
                for f in os.listdir(p)
                if f.startswith(("tokenizer", "special", "vocab", "merges", "chat"))
            ],
            "has no tokenizer files",
        ),
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
    data.write_text(
        "".join(json.dumps({"prompt": f"{i}+{i}", "answer": str(2 * i)}) + "\n" for i in range(20))
        + json.dumps({"prompt": "9 " * 2000, "answer": "x"})
        + "\n"
    )
    with pytest.raises(ValueError, match=r"d.jsonl: row 20 \(line 21\)"):
        main(small(tmp_path / "run", task=str(data)))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_weights_of_another_shape_than_config_json_are_refused_before_any_allocation(tmp_path, model_copy, monkeypatch):
    """A config.json that claims a vocabulary of 10^8 over the tiny model's weights: transformers would allocate
    about 51 GB for it before its own shape report. The headers are compared with a weightless copy first."""
    import decoder

    path = model_copy()
    _break_config(path, vocab_size=10**8)
    monkeypatch.setattr(decoder, "load_pretrained", lambda *a, **k: pytest.fail("weights loaded before the check"))
    with pytest.raises(ValueError, match=r"model.embed_tokens.weight \(\(\d+, \d+\) in model.safetensors, "):
        main(small(tmp_path / "run", model=path))


def test_a_safetensors_header_that_is_a_json_list_is_named(tmp_path, model_copy):
    path = model_copy()
    _header_json(os.path.join(path, "model.safetensors"), b"[]")
    with pytest.raises(ValueError, match="model.safetensors has an unreadable header: a JSON list, not an object"):
        main(small(tmp_path / "run", model=path))


def _sum_rows(n=20) -> str:
    return "".join(json.dumps({"prompt": f"{i}+{i}", "answer": str(2 * i)}) + "\n" for i in range(n))


def test_a_prompt_of_megabytes_is_refused_by_row_before_the_tokenizer(tmp_path, monkeypatch):
    """One 5 MB prompt line (50 MB aborted the tokenizer after 31 s at 5.9 GB): refused by its characters, naming the
    row, with the tokenizer never called on it."""
    import transformers

    data = tmp_path / "d.jsonl"
    data.write_text(_sum_rows() + json.dumps({"prompt": "9" * 5_000_000, "answer": "x"}) + "\n")
    call = transformers.PreTrainedTokenizerBase.__call__

    def tokenize(self, text, *a, **k):
        assert max(map(len, [text] if isinstance(text, str) else text)) < 10**6, "the tokenizer got the huge prompt"
        return call(self, text, *a, **k)

    monkeypatch.setattr(transformers.PreTrainedTokenizerBase, "__call__", tokenize)
    with pytest.raises(ValueError, match=r"d.jsonl: row 20 \(line 21\): the prompt is 5000\d\d\d characters"):
        main(small(tmp_path / "run", task=str(data)))


def test_a_prompt_with_a_lone_surrogate_is_refused_with_its_row(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(_sum_rows() + '{"prompt": "2+\\ud800", "answer": "x"}\n')
    with pytest.raises(ValueError, match=r"d.jsonl: row 20 \(line 21\).*lone surrogate \('\\ud800' at character 2\)"):
        main(small(tmp_path / "run", task=str(data)))


def test_a_task_that_is_a_fifo_or_a_device_is_refused_as_such(tmp_path):
    fifo = tmp_path / "rows.jsonl"
    os.mkfifo(fifo)
    zero = tmp_path / "zero.jsonl"
    os.symlink("/dev/zero", zero)
    for path, kind in ((fifo, "a FIFO"), (zero, "a device or other special file")):
        with pytest.raises(ValueError, match=f"--task: {re.escape(str(path))} is {kind}, not a regular file"):
            main(small(tmp_path / "run", task=str(path)))


@pytest.mark.e2e
def test_a_reward_that_changes_the_working_folder_cannot_move_the_records(tmp_path, tiny_model_dir, monkeypatch):
    """--out-dir is resolved once at start: a reward calling os.chdir (into a folder that also holds a "run") used to
    crash the run at its first log, or send the records there."""
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "run").mkdir(parents=True)
    reward = tmp_path / "wanders.py"
    reward.write_text(
        f"import os\n\ndef reward(completions, **columns):\n    os.chdir({str(elsewhere)!r})\n"
        "    return [0.0] * len(completions)\n"
    )
    (tmp_path / "home").mkdir()
    monkeypatch.chdir(tmp_path / "home")
    main(small("run", steps=1, model=tiny_model_dir, reward=f"{reward}:reward"))
    assert (tmp_path / "home" / "run" / "metrics.jsonl").exists()
    assert os.listdir(elsewhere / "run") == []


def test_a_full_disk_during_a_save_is_named_with_the_folder_and_the_space(tmp_path):
    """Checkpoint saves into an 8 MiB tmpfs (a bubblewrap mount, so no root mount is needed): the first fits, then a
    filler leaves half a checkpoint's space for the second. The older checkpoint stays intact and the error names the full disk, the folder and the space,
    where torch alone says "basic_ios::clear: iostream error"."""
    if shutil.which("bwrap") is None:
        pytest.skip("needs bubblewrap (apt-get install -y bubblewrap) for a small disk")
    disk = tmp_path / "disk"
    disk.mkdir()
    script = f"""
import os, shutil, torch, transformers
from checkpoint import save_checkpoint, checkpoint_problem
from data.tiny import build_tokenizer
tok = build_tokenizer()
cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
policy = transformers.LlamaForCausalLM(cfg)
opt = torch.optim.AdamW(policy.parameters())
policy(torch.tensor([[1, 2]])).logits.sum().backward()
opt.step()
def save(step):
    return save_checkpoint({str(disk)!r}, step, 0, 1, 2, policy=policy, critic=None, tokenizer=tok,
        optimizers={{"policy": opt}}, extra={{}})
first = save(1)
size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(first) for f in fs)
with open({str(disk)!r} + "/filler", "wb") as f:  # leave half a checkpoint free
    f.write(bytes(shutil.disk_usage({str(disk)!r}).free - size // 2))
try:
    save(2)
except OSError as e:
    print("ERROR", e)
print("INTACT", checkpoint_problem(first, "grpo"))
"""
    p = subprocess.run(
        ["bwrap", "--dev-bind", "/", "/", "--size", str(8 * 2**20), "--tmpfs", str(disk), sys.executable, "-c", script],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "INTACT None" in p.stdout, p.stdout + p.stderr
    assert re.search(rf"ERROR .*the disk holding {re.escape(str(disk))}/checkpoints is full \(\d", p.stdout), p.stdout


# ----------------------------------------------------------------------------- the non-finite guard


@pytest.mark.e2e
def test_huge_rewards_stop_the_run_on_the_critic(tmp_path, monkeypatch):
    """Rewards of 1e30 overflow the value loss: the critic's updates are skipped, and good policy updates no
    longer reset its count (one counter per model), so the run stops instead of exiting 0 having learned nothing."""
    monkeypatch.setattr(
        evaluation, "score", lambda task, completions, columns: Scores.of(torch.full((len(completions),), 1e30))
    )
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
    norm, ok, weights_ok = optimizer_step(model, opt, max_grad_norm=1.0, dp_group=None)
    assert ok and not weights_ok
    with pytest.raises(RuntimeError, match="the policy update made its weights non-finite.*lower --lr"):
        check_finite(
            ok, weights_ok, {"policy": 0}, "policy", "step 3", norm, max_bad_steps=3, find_checkpoint=lambda: None
        )


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
    monkeypatch.setattr(
        evaluation, "score", lambda task, completions, columns: Scores.of(torch.zeros(len(completions)))
    )
    hist = main(
        small(
            tmp_path, algo="grpo", grpo_std=False, steps=3, save_every=1, keep_checkpoints=5, max_bad_steps=3, lr=1e-5
        )
    )
    assert [r["step"] for r in hist if "pretrain/step" not in r] == [0, 1, 2, 3]
    state = torch.load(tmp_path / "checkpoints" / "step_000003" / "trainer_rank0.pt", weights_only=True)
    assert state["optimizers"]["policy"]["param_groups"][0]["lr"] == 1e-5
    assert json.load(open(tmp_path / "config.json"))["resumes"] == [
        {"step": 2, "changed": {"steps": [8, 3], "lr": [0.0002, 1e-05]}}
    ]


# ----------------------------------------------------------------------------- the run folder


@pytest.mark.e2e
def test_resume_refuses_changes_it_cannot_honour(tmp_path):
    main(small(tmp_path, steps=1))
    for kw, named in [
        (dict(algo="grpo"), "--algo 'ppo' -> 'grpo'"),
        (dict(task="sort"), "--task 'addition' -> 'sort'"),
        (dict(freeze_critic_attention=True), "--freeze-critic-attention False -> True"),
        (dict(clip_high=0.3), "--clip-high 0.28 -> 0.3"),
    ]:
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
    assert latest_checkpoint(str(tmp_path)) is None
    with pytest.raises(
        RuntimeError,
        match=r"holds a run's records but no usable checkpoint.*step_000003 \(.*trainer_rank0.pt is missing or damaged",
    ):
        check_fresh_start(str(tmp_path))


@pytest.mark.torchrun
def test_killing_the_torchrun_agent_kills_its_workers(tmp_path):
    script = tmp_path / "w.py"
    script.write_text(
        f"import os, sys, time\nsys.path.insert(0, {REPO!r})\nfrom parallel import init_runtime\ninit_runtime()\n"
        f"open({str(tmp_path / 'pid')!r}, 'w').write(str(os.getpid()))\ntime.sleep(120)\n"
    )
    agent = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", str(script)],
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
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
        check_model(small(tmp_path, tp=3), path, get_task("addition"))


class _Payload:
    def __reduce__(self):  # unpickling this runs os.system
        return (os.system, ("touch /tmp/icepop_payload_ran",))


def test_trainer_state_with_a_pickle_payload_is_refused(tmp_path):
    """A trainer_rank0.pt carrying a pickled callable is refused on load; the callable never runs."""
    from checkpoint import load_trainer_state

    marker = "/tmp/icepop_payload_ran"
    if os.path.exists(marker):
        os.remove(marker)
    torch.save(
        {"step": 1, "optimizers": {}, "rng": {"torch": torch.get_rng_state(), "python": None}, "x": _Payload()},
        tmp_path / "trainer_rank0.pt",
    )
    with pytest.raises(Exception, match="Weights only load failed"):
        load_trainer_state(str(tmp_path), 0, 1, {})
    assert not os.path.exists(marker)


# ----------------------------------------------------------------------------- hostile run folders (issue 21, class 2)


@pytest.fixture(scope="module")
def ppo_run(tmp_path_factory):
    """A finished 2-step PPO run with checkpoints at steps 1 and 2, to copy and damage."""
    out = tmp_path_factory.mktemp("ppo_run")
    main(small(out, steps=2, save_every=1))
    return out


def _ckpt(path, step, *parts):
    return os.path.join(path, "checkpoints", f"step_{step:06d}", *parts)


def _remove(*paths):
    for p in paths:
        shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)


def _bad_metrics_line(d):
    lines = open(os.path.join(d, "metrics.jsonl")).read().splitlines()
    open(os.path.join(d, "metrics.jsonl"), "w").write("\n".join([lines[0], lines[1][:20], *lines[2:]]) + "\n")


def _header_length(path, n):
    """Overwrite a safetensors file's 8-byte header length."""
    with open(path, "r+b") as f:
        f.write(n.to_bytes(8, "little"))


def _header_json(path, header: bytes):
    """Replace a safetensors file's header with `header` (padded to its length, so the size still adds up)."""
    with open(path, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        f.write(header.ljust(n))


# name -> (damage(run folder), the checkpoint step a resume takes, or the error a rerun stops with; the note or error)
HOSTILE_FOLDERS = {
    "newest_without_meta": (
        lambda d: _remove(_ckpt(d, 2, "meta.json")),
        1,
        r"skipped damaged step_000002 \(meta.json is missing",
    ),
    "newest_meta_truncated": (
        lambda d: os.truncate(_ckpt(d, 2, "meta.json"), 5),
        1,
        r"step_000002 \(meta.json is unreadable \(JSONDecodeError",
    ),
    "newest_without_critic": (
        lambda d: _remove(_ckpt(d, 2, "critic")),
        1,
        r"skipped damaged step_000002 \(critic/config.json is missing",
    ),
    "newest_critic_without_config": (
        lambda d: _remove(_ckpt(d, 2, "critic", "config.json")),
        1,
        r"skipped damaged step_000002 \(critic/config.json is missing",
    ),
    "newest_critic_without_weights": (
        lambda d: _remove(_ckpt(d, 2, "critic", "model.safetensors")),
        1,
        r"step_000002 \(critic/model.safetensors is missing",
    ),
    "newest_policy_config_truncated": (
        lambda d: os.truncate(_ckpt(d, 2, "policy", "config.json"), 20),
        1,
        r"step_000002 \(policy/config.json is not valid JSON",
    ),
    "newest_policy_header_length_overflows": (  # OverflowError on read(2**64 - 1), before: an unhandled crash
        lambda d: _header_length(_ckpt(d, 2, "policy", "model.safetensors"), 2**64 - 1),
        1,
        r"step_000002 \(.*policy/model.safetensors is damaged: its header claims 18446744073709551615 bytes",
    ),
    "newest_critic_header_length_2_60": (  # MemoryError, before
        lambda d: _header_length(_ckpt(d, 2, "critic", "model.safetensors"), 2**60),
        1,
        r"step_000002 \(.*critic/model.safetensors is damaged: its header claims 1152921504606846976 bytes",
    ),
    "newest_policy_header_a_json_list": (  # AttributeError, before
        lambda d: _header_json(_ckpt(d, 2, "policy", "model.safetensors"), b"[]"),
        1,
        r"step_000002 \(.*policy/model.safetensors has an unreadable header: a JSON list, not an object",
    ),
    "only_step_folder_without_meta": (
        lambda d: _remove(_ckpt(d, 2), _ckpt(d, 1, "meta.json")),
        RuntimeError,
        r"config.json; metrics.jsonl \(3 rows, up to step 2\); samples/ \(2 files\); "
        r"checkpoints/step_000001 \(meta.json is missing",
    ),
    "records_but_no_checkpoint": (
        lambda d: _remove(os.path.join(d, "checkpoints")),
        RuntimeError,
        r"no usable checkpoint to resume from: config.json; metrics.jsonl \(3 rows, up to step 2\); samples/",
    ),
    "config_json_only": (
        lambda d: _remove(*[os.path.join(d, f) for f in ("checkpoints", "metrics.jsonl", "samples")]),
        RuntimeError,
        r"no usable checkpoint to resume from: config.json\. Starting afresh would overwrite them: use a new --out-dir, "
        r"or remove those files",
    ),
    "metrics_bad_line_mid_file": (
        _bad_metrics_line,
        ValueError,
        r"metrics.jsonl: line 2 is not valid JSON .*; repair or remove it to resume",
    ),
}


@pytest.mark.e2e
@pytest.mark.parametrize("case", sorted(HOSTILE_FOLDERS))
def test_hostile_run_folders(case, ppo_run, tmp_path, capsys, monkeypatch):
    """Every step_* folder is a checkpoint: a damaged newest one (a file a resume loads is missing or broken, the
    critic's included) is skipped with a note naming it, and the resume takes the older intact one; a folder with
    records but no usable checkpoint, or a broken record, is refused before any model is built or anything is
    written, listing what it holds."""
    damage, want, msg = HOSTILE_FOLDERS[case]
    run = str(tmp_path / "run")
    shutil.copytree(ppo_run, run)
    damage(run)
    if isinstance(want, int):
        assert latest_checkpoint(run, "ppo") == _ckpt(run, want)
        assert re.search(msg, capsys.readouterr().out)
        return
    before = {
        f: open(os.path.join(run, f), "rb").read()
        for f in ("config.json", "metrics.jsonl")
        if os.path.exists(os.path.join(run, f))
    }
    monkeypatch.setattr(train_ppo, "build_models", lambda *a: pytest.fail("a model was built before the refusal"))
    with pytest.raises(want, match=msg):
        main(small(run, steps=3, save_every=1))
    assert before == {f: open(os.path.join(run, f), "rb").read() for f in before}  # nothing overwritten


@pytest.mark.e2e
def test_newest_checkpoint_without_critic_resumes_from_the_one_before(ppo_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(ppo_run, run)
    _remove(_ckpt(run, 2, "critic"))
    hist = main(small(run, steps=3, save_every=1))
    assert [r["step"] for r in hist] == [0, 1, 2, 3]


def test_a_folder_with_only_the_lock_is_a_fresh_start(tmp_path):
    held = lock_run_dir(str(tmp_path))
    check_fresh_start(str(tmp_path))
    held.close()


# ----------------------------------------------------------------------------- a run's identity (issue 21, class 4)


REWARD = (
    "def score(completions, *, answer, **_):\n    return [float(c.strip() == a) for c, a in zip(completions, answer)]\n"
)
ENV_FILE = "class Env:\n    def reset(self, row):\n        return 'go'\n    def step(self, text):\n        return None, 1.0, True\n"


def _rows(n):
    return "".join(json.dumps({"prompt": f"{i:03d}+{2 * i:03d}", "answer": f"{3 * i:04d}"}) + "\n" for i in range(n))


def _resume(cfg):
    """What a resume of cfg into a recorded folder (_record) does before any model loads: the option check, then the
    inputs' fingerprints after the task loads. Returns the accepted changes."""
    changes = check_resume(_ckpt(cfg.out_dir, 1), 1, options=asdict(cfg), defaults=asdict(Config()))
    task = get_task(cfg.task, reward_fn=load_reward(cfg.reward))
    now = _fingerprints(cfg, task)
    return {**changes, **check_inputs(cfg.out_dir, now, changes, accept_changed_inputs=cfg.accept_changed_inputs)}


def _fingerprints(cfg, task):
    """input_fingerprints of cfg's inputs and task's splits, taken as build.load_task takes them."""
    return input_fingerprints(
        task.train, task.test, model=cfg.model, task=cfg.task, eval_task=cfg.eval_task, reward=cfg.reward, env=cfg.env
    )


@pytest.fixture
def recorded(tmp_path):
    """A run folder recorded by hand as a launch records it (config.json with the inputs' fingerprints, a checkpoint's
    meta.json), with a data file, a reward file and an environment file; returns the launch's Config."""
    for name, text in (("d.jsonl", _rows(20)), ("reward.py", REWARD), ("env.py", ENV_FILE)):
        (tmp_path / name).write_text(text)
    cfg = small(
        tmp_path / "run",
        task=str(tmp_path / "d.jsonl"),
        reward=f"{tmp_path / 'reward.py'}:score",
        env=f"{tmp_path / 'env.py'}:Env",
    )
    os.makedirs(_ckpt(cfg.out_dir, 1))
    open(_ckpt(cfg.out_dir, 1, "meta.json"), "w").write(json.dumps({"step": 1, "world_size": 1}))
    inputs = _fingerprints(cfg, get_task(cfg.task, reward_fn=load_reward(cfg.reward)))
    open(os.path.join(cfg.out_dir, "config.json"), "w").write(json.dumps({"config": asdict(cfg), "inputs": inputs}))
    return cfg


def _edit(path, f):
    with open(path) as fh:
        text = fh.read()
    with open(path, "w") as fh:
        fh.write(f(text))


def _edit_record(cfg, f):
    _edit(os.path.join(cfg.out_dir, "config.json"), lambda t: json.dumps(f(json.loads(t))))


def _moved_run(cfg, tmp):
    shutil.move(cfg.out_dir, tmp / "elsewhere")
    return replace(cfg, out_dir=str(tmp / "elsewhere"))


def _moved_data(cfg, tmp):
    shutil.move(cfg.task, tmp / "renamed.jsonl")
    return replace(cfg, task=str(tmp / "renamed.jsonl"))


def _relative(cfg, tmp, key):  # the test runs in tmp
    return replace(cfg, **{key: os.path.relpath(getattr(cfg, key), tmp)})


# name -> (change(launch cfg, tmp_path) -> resume cfg, a refusal's pattern, or the accepted changes' keys)
IDENTITY = {
    "data_file_edited": (
        lambda c, t: _edit(c.task, lambda s: s.replace('"0003"', '"9999"')) or c,
        r"--task: .*d.jsonl \(sha256 \w+\) recorded, .*d.jsonl \(sha256 \w+\) now",
    ),
    "data_rows_appended": (
        lambda c, t: _edit(c.task, lambda s: s + _rows(23)[len(s) :]) or c,
        r"the held-out split: 2 rows \(sha256 \w+\) recorded, 2 rows \(sha256 \w+\) now; the train split: 18 rows",
    ),
    "reward_file_edited": (
        lambda c, t: _edit(c.reward.rpartition(":")[0], lambda s: s.replace("float(", "-float(")) or c,
        r"--reward's file: .*reward.py \(sha256",
    ),
    "env_file_edited": (
        lambda c, t: _edit(c.env.rpartition(":")[0], lambda s: s.replace("1.0", "2.0")) or c,
        r"--env's file: .*env.py",
    ),
    "another_reward_function": (
        lambda c, t: replace(c, reward=c.reward.replace(":score", ":other")),
        r"--reward '.*:score' -> '.*:other'",
    ),
    "missing_key_in_record": (
        lambda c, t: (
            _edit_record(c, lambda m: {**m, "config": {k: v for k, v in m["config"].items() if k != "algo"}})
            or replace(c, algo="grpo")
        ),
        r"--algo \(not recorded\) -> 'grpo'",
    ),
    "missing_key_at_its_default": (
        lambda c, t: (
            _edit_record(c, lambda m: {**m, "config": {k: v for k, v in m["config"].items() if k != "algo"}}) or c
        ),
        set(),
    ),  # an option newer than the run, at its default: no change
    "no_fingerprints_in_record": (
        lambda c, t: _edit_record(c, lambda m: {k: v for k, v in m.items() if k != "inputs"}) or c,
        r"inputs changed since it was launched: config.json records no fingerprints",
    ),
    "truncated_config_json": (
        lambda c, t: os.truncate(os.path.join(c.out_dir, "config.json"), 30) or c,
        r"config.json is unreadable or not valid JSON \(JSONDecodeError.*\); restore it",
    ),
    "config_json_not_a_record": (
        lambda c, t: _edit_record(c, lambda m: [1, 2]) or c,
        r'config.json has no "config" object',
    ),
    "out_dir_trailing_slash": (lambda c, t: replace(c, out_dir=c.out_dir + "/"), set()),
    "out_dir_relative": (lambda c, t: _relative(c, t, "out_dir"), set()),
    "run_folder_moved": (_moved_run, set()),
    "data_path_relative": (lambda c, t: _relative(c, t, "task"), set()),
    "data_file_moved_same_content": (_moved_data, {"inputs/task"}),
    "changed_data_accepted_with_the_flag": (
        lambda c, t: _edit(c.task, lambda s: s + _rows(23)[len(s) :]) or replace(c, accept_changed_inputs=True),
        {"accept_changed_inputs", "inputs/task", "inputs/train_split", "inputs/test_split"},
    ),
}


@pytest.mark.parametrize("case", sorted(IDENTITY))
def test_resume_identity(case, recorded, tmp_path, monkeypatch):
    """A resume is the recorded run: the data, reward and environment files and both splits compared by content
    (refused by name, recorded vs now, unless --accept-changed-inputs), a key the record lacks is a change, a broken
    record is named; paths compare resolved (the run folder or a data file moved or spelled otherwise is the same)."""
    monkeypatch.chdir(tmp_path)
    change, want = IDENTITY[case]
    cfg = change(recorded, tmp_path)
    if isinstance(want, str):
        with pytest.raises(ValueError, match=want):
            _resume(cfg)
    else:
        assert set(_resume(cfg)) == want


@pytest.mark.e2e
def test_appended_data_rows_are_refused_on_resume_and_accepted_with_the_flag(tmp_path):
    """Appending rows moves held-out prompts into train: the resume stops before any model loads; with
    --accept-changed-inputs it goes on, and config.json records what it accepted and the new fingerprints."""
    data = tmp_path / "d.jsonl"
    data.write_text(_rows(20))
    main(small(tmp_path / "run", task=str(data), steps=1))
    data.write_text(_rows(23))
    with pytest.raises(
        ValueError,
        match=r"the held-out split: 2 rows .* recorded, .*; the train split: 18 rows \(sha256 \w+\) recorded, 21 rows \(sha256 \w+\) now",
    ):
        main(small(tmp_path / "run", task=str(data), steps=2))
    hist = main(small(tmp_path / "run", task=str(data), steps=2, accept_changed_inputs=True))
    assert [r["step"] for r in hist] == [0, 1, 2]
    record = json.load(open(tmp_path / "run" / "config.json"))
    changed = record["resumes"][-1]["changed"]
    assert changed["accept_changed_inputs"] == [False, True] and changed["inputs/train_split"][1]["rows"] == 21
    assert record["inputs"]["train_split"]["rows"] == 21


# ----------------------------------------------------------------------------- save on SIGTERM


SIGTERM_ARGS = [
    "--steps",
    "12",
    "--save-every",
    "100",
    "--eval-every",
    "100",
    "--eval-size",
    "8",
    "--rollout-batch",
    "16",
    "--critic-pretrain",
    "0",
    "--deterministic",
]


@pytest.mark.e2e
def test_sigterm_saves_at_the_step_boundary_and_the_resume_equals_uninterrupted(tmp_path):
    """A SIGTERM after a few steps: the run finishes the step, writes a checkpoint at it, exits 143; rerun, it resumes
    there and logs what an uninterrupted run logs."""
    ref = train_cli(*SIGTERM_ARGS, "--out-dir", tmp_path / "ref")
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    proc = start_train(*SIGTERM_ARGS, "--out-dir", tmp_path / "run")
    metrics, deadline = tmp_path / "run" / "metrics.jsonl", time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 4:  # the evaluation before RL and 3 steps
            proc.send_signal(signal.SIGTERM)
            break
        time.sleep(0.05)
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 143, out[-3000:]
    step = read_metrics(tmp_path / "run")[-1]["step"]
    assert 3 <= step < 12 and f"SIGTERM: stopping after step {step}" in out
    assert os.listdir(tmp_path / "run" / "checkpoints") == [f"step_{step:06d}"]
    resumed = train_cli(*SIGTERM_ARGS, "--out-dir", tmp_path / "run")
    assert resumed.returncode == 0 and f"resuming at step {step}" in resumed.stdout, (
        resumed.stdout[-3000:] + resumed.stderr[-3000:]
    )
    assert read_metrics(tmp_path / "run", volatile=False) == read_metrics(tmp_path / "ref", volatile=False)


def test_sigterm_before_the_steps_or_twice_stops_at_once(tmp_path):
    """Before the RL steps (armed False) a SIGTERM stops at once; once armed, the first only asks for a checkpoint
    and a second stops at once: the process dies of the signal, as without the handler."""
    code = (
        "import os, signal, sys, time\nsys.path.insert(0, {repo!r})\nfrom parallel import PREEMPTION\nPREEMPTION.install()\n"
        "PREEMPTION.armed = {armed}\nos.kill(os.getpid(), signal.SIGTERM)\ntime.sleep(0.5)\nprint('requested', PREEMPTION.requested, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGTERM)\ntime.sleep(5)\nprint('survived')\n"
    )
    for armed, printed in ((False, ""), (True, "requested True\n")):
        p = subprocess.run(
            [sys.executable, "-c", code.format(repo=REPO, armed=armed)],
            env=ENV,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert p.returncode == -signal.SIGTERM and p.stdout == printed, (armed, p.stdout, p.stderr)


@pytest.mark.torchrun
def test_sigterm_to_one_rank_saves_on_every_rank(tmp_path):
    """Under torchrun (dp=2), a SIGTERM to rank 0 alone: the ranks agree at the step boundary (one all-reduce), so both
    write their trainer state into the checkpoint, and the job exits non-zero (a scheduler may requeue it)."""
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "train_ppo.py",
            *SIGTERM_ARGS,
            "--out-dir",
            str(out),
        ],
        cwd=REPO,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        if (out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= 4:
            os.kill(int((out / ".lock").read_text().split()[1]), signal.SIGTERM)  # the lock file names rank 0's pid
            break
        time.sleep(0.05)
    text = proc.communicate(timeout=300)[0]
    step = read_metrics(out)[-1]["step"]
    assert proc.returncode != 0 and step < 12 and f"SIGTERM: stopping after step {step}" in text, text[-3000:]
    assert {f for f in os.listdir(out / "checkpoints" / f"step_{step:06d}") if f.startswith("trainer_rank")} == {
        "trainer_rank0.pt",
        "trainer_rank1.pt",
    }
