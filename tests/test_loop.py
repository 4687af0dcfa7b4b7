"""The loop's own pieces: the metrics accumulator, the data stream, a step whose micro-batches hold no kept token, and
the explained variance of a micro-batched step."""

import math
import os

import pytest
import torch

import losses as L
from data.tiny import build_tiny_model
from runlog import Metrics
from data.tasks import prompt_indices
import train_ppo
from conftest import direct_ev, small
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


def test_metrics_ev_sums_the_statistics_of_every_call_before_the_division():
    """Two calls (micro-batches) whose returns sit 3 apart: reduce() gives the EV of all their tokens, a float32 figure,
    not the mean of the two calls' EVs; a key with no token is NaN."""
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(4, 6, dtype=torch.bool)
    r = torch.randn(4, 6, generator=g) + 3.0 * (torch.arange(4) >= 2)[:, None]
    v = r + 0.8 * torch.randn(4, 6, generator=g)
    m = Metrics()
    for h in (slice(0, 2), slice(2, 4)):
        m.add_ev({"ev": L.ev_stats(v[h], r[h], mask[h]), "none": L.ev_stats(v[h], r[h], torch.zeros_like(mask[h]))})
    out = m.reduce()
    whole = L.explained_variance(v, r, mask)
    assert out["ev"] == pytest.approx(whole.item(), abs=1e-6) and type(out["ev"]) is float
    halves = (L.explained_variance(v[:2], r[:2], mask[:2]) + L.explained_variance(v[2:], r[2:], mask[2:])) / 2
    assert whole - halves > 0.2
    assert math.isnan(out["none"])


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


@pytest.mark.e2e
def test_logged_ev_of_a_micro_batched_step_is_the_ev_of_its_whole_batch(tmp_path, monkeypatch):
    """16 rollouts in 2 minibatches of 2 micro-batches (micro_batch 4): critic/explained_variance and critic/ev_pos_*
    are the EV of the step's whole batch, computed here from the values and returns update_critic got. One critic
    pretraining step first, so that step 1's values are not the fresh head's constant (whose EV is 0 on any split)."""
    update_critic = train_ppo.update_critic
    seen = []

    def spy(run, models, progress, batch, old, returns, *args):
        seen.append((old.values.clone(), returns.clone(), batch.mask.clone(), batch.width))
        return update_critic(run, models, progress, batch, old, returns, *args)

    monkeypatch.setattr(train_ppo, "update_critic", spy)
    cfg = small(tmp_path, steps=1, critic_pretrain=1, micro_batch=4, minibatches=2)
    hist = [r for r in main(cfg) if "critic/explained_variance" in r]
    assert [r["step"] for r in hist] == [0, 1] and len(seen) == 2
    for row, (v, r, mask, width) in zip(hist, seen):
        assert row["critic/explained_variance"] == pytest.approx(direct_ev(v, r, mask), abs=1e-6)
        cols = torch.arange(mask.size(1))
        for label, lo, hi in L.position_buckets(max(width, mask.size(1))):
            want = direct_ev(v, r, mask & (cols >= lo) & (cols < hi))
            assert row[f"critic/ev_pos_{label}"] == pytest.approx(want, abs=1e-6, nan_ok=True), label
    assert abs(hist[-1]["critic/explained_variance"]) > 0.01  # the pretrained critic's values are not constant
