"""bench/value_ceiling.py and bench/critic_sweep.py end to end on the default addition model (seconds at this size)."""

import json

import pytest

from conftest import run as run_script

pytestmark = pytest.mark.e2e  # bench scripts as subprocess jobs


def test_value_ceiling_reads_off_the_written_answer(tmp_path):
    out = tmp_path / "ceiling.json"
    run = run_script("bench/value_ceiling.py", "--prompts", "48", "--k", "8", "--out", out)
    assert run.returncode == 0, run.stdout + run.stderr
    got = json.loads(out.read_text())
    # Before <|im_end|> the whole answer is written, so V* is (almost) the return itself; at position 0 V* is the
    # prompt's success rate, which is what the prompt-only critic uses at every position.
    assert got["perfect/4-7"] > 0.9 and got["perfect/0"] == got["prompt_only/0"]
    assert got["perfect"] > got["prompt_only"] and all(f"probe/{p}" in got for p in ("0", "1", "2", "3", "4-7"))
    assert "perfect" in run.stdout and "prompt_only" in run.stdout and "probe" in run.stdout


def test_critic_sweep_prints_one_row_per_setting():
    """bench/critic_sweep.py end to end: each setting runs its pretraining steps and gets a table row."""
    run = run_script("bench/critic_sweep.py", "--steps", "3", "--settings", "1e-3x1,3e-4x2")
    assert run.returncode == 0, run.stdout + run.stderr
    table = [line for line in run.stdout.splitlines() if line.startswith("| 1e-3x1 |") or line.startswith("| 3e-4x2 |")]
    assert len(table) == 2 and run.stdout.count("critic pretraining stopped after 3 steps (step cap") == 2


def _value_ceiling():
    import importlib.util
    import os

    from conftest import REPO

    spec = importlib.util.spec_from_file_location("value_ceiling", os.path.join(REPO, "bench", "value_ceiling.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_headroom_per_position_by_hand():
    """Position 0: V* is the prompt's value (ratio 1); position 1, over the 2 rows alive there: V* = R (ratio 0)."""
    import torch

    mask = torch.tensor([[True, True], [True, True], [True, False]])
    returns = torch.tensor([1.0, 0.0, 1.0])[:, None].expand(3, 2)
    prompt = torch.full((3, 2), 0.5)
    values = torch.tensor([[0.5, 1.0], [0.5, 0.0], [0.5, 7.0]])  # row 2 is not alive at position 1: its 7 is ignored
    assert _value_ceiling().headroom(values, prompt, returns, mask).tolist() == [1.0, 0.0]


RETRY = """
class Retry:
    def reseed(self, seed):
        pass

    def reset(self, row):
        self.answer = row["answer"]
        return row["prompt"]

    def step(self, text):
        return (None, 1.0, True) if text.strip() == self.answer else ("wrong, try again", 0.0, False)
"""


def test_measure_plays_episodes_from_the_turn_starts(tmp_path):
    """measure() on a multi-turn environment (a retry game on the addition rows): values at the turn starts."""
    env = tmp_path / "retry.py"
    env.write_text(RETRY)
    out = _value_ceiling().measure(task="addition", env=f"{env}:Retry", max_turns=2, prompts=24, k=4)
    assert out["states"] == "turn starts" and out["extra_tokens"] > 0
    assert out["perfect/0"] == out["prompt_only/0"] and out["perfect"] > out["prompt_only"]
    assert out["headroom"] >= 1 and 0 < out["headroom_ratio"] <= 1


def test_measure_with_states_every_two_tokens_and_an_own_reward(tmp_path):
    """--every 2: the token after a state takes that state's value, so at position 1 the perfect critic is the
    prompt-only one; --reward replaces the task's reward (here one that pays 1 for any answer); --max-new-tokens
    is the budget."""
    reward = tmp_path / "pays.py"
    reward.write_text("def pays(completions, **kw):\n    return [1.0] * len(completions)\n")
    measure = _value_ceiling().measure
    every2 = measure(task="addition", prompts=16, k=4, every=2)
    assert every2["states"] == "every 2 response tokens" and every2["perfect/1"] == every2["prompt_only/1"]
    full = measure(task="addition", prompts=16, k=4)
    assert full["perfect/1"] != full["prompt_only/1"] and every2["extra_tokens"] < full["extra_tokens"]
    paid = measure(task="addition", prompts=16, k=2, reward=f"{reward}:pays", max_new_tokens=2)
    assert paid["mean_return"] == 1.0 and paid["extra_tokens"] <= 16 * 2 * 2 * 2
