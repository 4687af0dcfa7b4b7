"""bench/gpu_check.sh, the check a lent GPU machine runs, in its --dry-run mode on CPU (every stage with tiny shapes),
so a broken stage shows here and not in a GPU's 15 minutes; and the carried wheel list (bench/gpu_wheels.txt)."""

import json
import os
import subprocess
import sys
from importlib.metadata import version

import pytest
from packaging.requirements import Requirement

from conftest import ENV, REPO

sys.path.insert(0, os.path.join(REPO, "bench"))
from gpu_carry import pins, wheel_name  # noqa: E402


def requirements() -> dict[str, Requirement]:
    with open(os.path.join(REPO, "requirements.txt")) as f:
        lines = [line.split("#", 1)[0].strip() for line in f]
    reqs = [Requirement(line) for line in lines if line]
    return {wheel_name(f"{r.name}==0"): r for r in reqs}


def test_carried_pins_are_versions_the_project_accepts():
    reqs, carried = requirements(), pins()
    assert len(carried) == len({wheel_name(p) for p in carried}), "a package pinned twice"
    for pin in carried:
        name, v = pin.split("==")
        if wheel_name(pin) in reqs:
            assert reqs[wheel_name(pin)].specifier.contains(v), (pin, str(reqs[wheel_name(pin)]))
    assert {"tyro", "datasets", "math_verify"} <= {wheel_name(p) for p in carried}  # what the GPU image lacks


@pytest.mark.e2e
def test_dry_run_runs_every_stage(tmp_path):
    # The carried versions are the ones these tests run with (Makefile's .venv).
    for pin in pins():
        name, v = pin.split("==")
        assert version(name) == v, f"{pin} in bench/gpu_wheels.txt, {version(name)} installed here"
    out, work = tmp_path / "out", tmp_path / "work"
    # No carried wheels (.gpu-carry holds CPython 3.12's, for the GPU machine): this Python's own packages.
    env = {**ENV, "PY": sys.executable, "GPU_CARRY": str(tmp_path / "no-carry")}
    cmd = ["bash", "bench/gpu_check.sh", "--dry-run", "--out", str(out), "--work", str(work)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out / "gpu_check.json") as f:
        report = json.load(f)
    stages = report["stages"]
    assert list(stages) == ["setup", "tests", "main_job", "build:tiny", "rollout:tiny", "train:tiny"]
    assert all(s["status"] == "ok" for s in stages.values()), stages
    assert stages["tests"]["figures"]["skipped"] >= 3  # the gpu tests were collected; without CUDA they skip
    job = stages["main_job"]["figures"]
    assert job["steps"] == 2 and job["eval steps"] == [0, 2] and job["s/step"] > 0
    assert stages["build:tiny"]["figures"]["vocab_size"] == 151_936
    for batch in ("batch 4", "batch 8"):
        assert stages["rollout:tiny"]["figures"][batch]["engine tok/s"] > 0
    train = stages["train:tiny"]["figures"]
    assert train["ppo"]["critic"] > 0 and train["grpo"]["critic"] == 0 and train["ppo"]["resp"] == 8
    table = (out / "gpu_check.md").read_text()
    assert all(f"| {s} | ok |" in table for s in stages)
    assert not (out / "tiny").exists()  # model folders stay in --work: $OUT travels back from the GPU machine
