"""bench/value_ceiling.py end to end on the default addition model (a few seconds at this size)."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_value_ceiling_reads_off_the_written_answer(tmp_path):
    out = tmp_path / "ceiling.json"
    run = subprocess.run([sys.executable, "bench/value_ceiling.py", "--prompts", "48", "--k", "8", "--out", str(out)], cwd=REPO,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    got = json.loads(out.read_text())
    # Before <|im_end|> the whole answer is written, so V* is (almost) the return itself; at position 0 V* is the
    # prompt's success rate, which is what the prompt-only critic uses at every position.
    assert got["perfect/4-7"] > 0.9 and got["perfect/0"] == got["prompt_only/0"]
    assert got["perfect"] > got["prompt_only"] and all(f"probe/{p}" in got for p in ("0", "1", "2", "3", "4-7"))
    assert "perfect" in run.stdout and "prompt_only" in run.stdout and "probe" in run.stdout
