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
