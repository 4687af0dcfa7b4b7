"""The loop's own pieces: the metrics accumulator, the data stream, and a step whose micro-batches hold no kept token."""

import math
import os

import pytest
import torch

from data.tiny import build_tiny_model
from runlog import Metrics
from data.tasks import prompt_indices
from train_ppo import Config, main


def test_metrics_means_extremes_and_ratios():
    m = Metrics()
    for v in (1.0, 2.0, 4.0):
        m.add({"a": v, "len_max": v, "len_min": v})
    m.add_ratio("r", 3.0, 2)  # 3 over 2 tokens, then 0 over 0 (a micro-batch with nothing) and 1 over 2
    m.add_ratio("r", 0.0, 0)
    m.add_ratio("r", 1.0, 2)
    m.add_ratio("empty", 0.0, 0)
    out = m.reduce()
    assert out["a"] == pytest.approx(7 / 3) and out["len_max"] == 4.0 and out["len_min"] == 1.0
    assert out["r"] == 1.0  # (3 + 0 + 1) / (2 + 0 + 2): token-weighted, and the empty call adds nothing (not NaN)
    assert math.isnan(out["empty"])
    assert all(type(v) is float for v in out.values())


def test_metrics_ratio_is_a_float32_figure_like_the_means():
    m = Metrics()
    m.add({"mean": 1 / 3})
    m.add_ratio("ratio", 1, 3)
    out = m.reduce()
    assert out["ratio"] == out["mean"] == float(torch.tensor(1 / 3, dtype=torch.float32))


def test_prompt_indices_cross_epochs_in_seeded_permutations():
    n = 5

    def perm(e):
        return torch.randperm(n, generator=torch.Generator().manual_seed(7 + e)).tolist()

    assert prompt_indices(7, n, 3, 4) == perm(0)[3:] + perm(1)[:2]
    assert (
        prompt_indices(7, n, -2, 2) == perm(-1)[3:]
    )  # critic pretraining's negative batch indices have their own rows
    assert sorted(prompt_indices(7, n, 10, 5)) == list(range(n))  # an epoch visits every row once


def some_rewarded(completions, **columns):
    """Only the first completion of each call gets a reward; the rest get None and leave training."""
    return [1.0] + [None] * (len(completions) - 1)


@pytest.mark.e2e
def test_entropy_is_finite_when_micro_batches_hold_no_kept_token(tmp_path):
    """With one rewarded row in 8 and micro-batches of 2, most micro-batches have no kept token: the step's entropy is
    the token-weighted mean over the kept tokens, not a mean of per-micro-batch means with NaNs in it."""
    model = build_tiny_model(str(tmp_path / "model"), seed=1)
    cfg = Config(
        model=model,
        reward=f"{os.path.abspath(__file__)}:some_rewarded",
        out_dir=str(tmp_path / "run"),
        steps=1,
        rollout_batch=8,
        micro_batch=2,
        eval_every=100,
        eval_size=4,
        critic_pretrain=0,
        train_dtype="fp32",
    )
    row = main(cfg)[-1]
    assert row["rollout/no_reward_frac"] == 7 / 8
    assert math.isfinite(row["ppo/entropy"]) and row["ppo/entropy"] > 0
