"""bench/value_fit.py: the offline critic fit learns a value that is readable from the response, and finds nothing in
a reward that is independent of it (held-out explained variance)."""

import importlib.util
import os

import pytest

from conftest import REPO

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
    out = value_fit.main(
        ["--rollouts", "512", "--epochs", "4", "--reward", f"{path}:{fn}", "--out", str(tmp_path / "fit.json")]
    )
    held = out["held"]["ev"]
    if fn == "first_odd":
        assert held > 0.4, out["held"]
        assert out["held"]["1"] > 0.6, out["held"]  # the state after the deciding token
    else:
        assert abs(held) < 0.1, out["held"]
    assert (tmp_path / "fit.json").is_file()
