"""bench/value_fit.py: the offline critic fit learns a value that is readable from the response, and finds nothing in
a reward that is independent of it (held-out explained variance)."""

import importlib.util
import os

import pytest

from conftest import REPO, small, token_records
from config import Config

spec = importlib.util.spec_from_file_location("value_fit", os.path.join(REPO, "bench", "value_fit.py"))
value_fit = importlib.util.module_from_spec(spec)
spec.loader.exec_module(value_fit)

REWARDS = """
import random
_rng = random.Random(0)

def first_odd(completions, **_):  # decided by the first response token: readable from position 1 on
    return [float(c[:1] in "13579") for c in completions]

def coin(completions, **_):  # independent of the prompt and the response
    return [float(_rng.random() < 0.5) for _ in completions]
"""


@pytest.mark.e2e
@pytest.mark.parametrize("fn", ["first_odd", "coin"])
def test_value_fit_learns_what_is_readable_and_nothing_else(tmp_path, fn):
    path = tmp_path / "rewards.py"
    path.write_text(REWARDS)
    args = ["--rollouts", "512", "--epochs", "4", "--reward", f"{path}:{fn}", "--out", str(tmp_path / "fit.json")]
    out = value_fit.main(args + (["--save", str(tmp_path / "critic")] if fn == "first_odd" else []))
    held = out["held"]["ev"]
    if fn == "first_odd":
        assert held > 0.4, out["held"]
        assert out["held"]["1"] > 0.6, out["held"]  # the state after the deciding token
        _check_critic_init(tmp_path, f"{path}:{fn}", held)
    else:
        assert abs(held) < 0.1, out["held"]
    assert (tmp_path / "fit.json").is_file()


def _check_critic_init(tmp_path, reward: str, held_ev: float):
    """train_ppo.py --critic-init starts from the saved fit: step 1's values (the recompute, before any critic
    update) explain the returns as the fit did on held-out rows, where a fresh head's constant values explain nothing
    (EV 0); with --token-records the values it used are on record, and recompute from the saved critic exactly."""
    import json

    import torch
    from transformers import AutoTokenizer

    from data.tasks import encode_prompt, get_task, prompt_indices
    from train_ppo import main
    from value_model import CRITIC_INIT, critic_values, load_critic

    record = json.load(open(tmp_path / "critic" / CRITIC_INIT))
    assert record["critic_context"] == "policy" and record["held"]["ev"] == held_ev and record["rollouts"] == 512
    run = tmp_path / "run"
    hist = main(
        small(run, steps=1, rollout_batch=64, reward=reward, critic_init=str(tmp_path / "critic"), token_records=1)
    )
    assert hist[-1]["critic/explained_variance"] > 0.5 * held_ev, hist[-1]
    # The values on record are the saved critic's: row 0's recomputed from its prompt (the step's first train row,
    # data.tasks.prompt_indices) and response, V of the state before each response token.
    d = token_records(run)
    tok = AutoTokenizer.from_pretrained(json.load(open(run / "config.json"))["config"]["model_path"])
    train = get_task("addition").train
    prompt = encode_prompt(tok, train[prompt_indices(0, len(train), 0, 1)[0]]["prompt"])
    row = d[d.row == 0].sort_values("position")
    ids = torch.tensor([prompt + row.token.tolist()])
    with torch.no_grad():
        v = critic_values(load_critic(str(tmp_path / "critic"), torch.float32), ids)[0, len(prompt) - 1 : -1]
    assert torch.allclose(v, torch.tensor(row.value.to_numpy()), atol=1e-5), (v, row.value)


def test_critic_init_is_refused_before_any_weights_load(tmp_path, tiny_model_dir):
    """A fitted critic whose record names another --critic-context or another base model, or a folder without the
    record, is refused by load_task, naming --critic-init, before build_models loads a weight."""
    import torch

    from build import check_critic_init
    from checkpoint import sha256_path
    from value_model import build_critic, save_fitted_critic

    critic = build_critic(tiny_model_dir, dtype=torch.float32)
    save_fitted_critic(
        critic, str(tmp_path / "answer"), base_sha256=sha256_path(tiny_model_dir), critic_context="answer"
    )
    save_fitted_critic(critic, str(tmp_path / "other"), base_sha256="0" * 64, critic_context="policy")
    (tmp_path / "bare").mkdir()
    for folder, msg in (
        ("answer", "fitted with --critic-context answer, this run has policy"),
        ("other", "fitted on another base model"),
        ("bare", "no critic_init.json there"),
        ("missing", "no such folder"),
    ):
        with pytest.raises(ValueError, match=f"--critic-init .*{folder}.*{msg}"):
            check_critic_init(Config(critic_init=str(tmp_path / folder)), tiny_model_dir)
    check_critic_init(Config(critic_init=str(tmp_path / "answer"), critic_context="answer"), tiny_model_dir)
