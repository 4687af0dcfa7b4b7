"""--sync-every N: off-policy rollouts in the colocated loop. The engine's weights lag the policy by up to N - 1 steps;
its fp32 log-probs are a recompute with the stale weights, the ratio pi_old / pi_infer leaves 1 exactly on the stale
steps, the refusals, and a resume from a checkpoint at a sync that logs what an uninterrupted run logs."""

import pytest
import torch
from transformers import AutoModelForCausalLM

import losses as L
from conftest import read_metrics, small, trainer_logp
from config import Config, resolve
from build import build_generation, build_models, load_task, setup
from train_ppo import main, rollout_phase, train_step

FP32_LOGP_ATOL = 5e-5  # the fp32 engine against the trainer's forward (tests/test_rollout.py)


def test_refusals():
    for kw, msg in (
        (dict(sync_every=0), "--sync-every must be >= 1"),
        (dict(sync_every=3, save_every=4, eval_every=6), "--save-every 4 must be a multiple of --sync-every 3"),
        (dict(sync_every=3, save_every=6, eval_every=4), "--eval-every 4 must be a multiple of --sync-every 3"),
    ):
        with pytest.raises(ValueError, match=msg):
            resolve(Config(**kw), 1)
    resolve(
        Config(sync_every=3, save_every=6, eval_every=4, eval_dtype="fp32"), 1
    )  # an fp32 copy evaluates the current policy


@pytest.mark.e2e
def test_stale_engine_samples_the_old_weights(tmp_path):
    """After step 1's update with --sync-every 2, step 2's rollouts come from the start weights: the engine's fp32
    log-probs equal the start model's recompute, not the updated policy's."""
    cfg = small(tmp_path / "run", sync_every=2, save_every=2, engine_dtype="fp32", lr=5e-3, algo="grpo")
    run = setup(cfg)
    task, tok, path, _ = load_task(run)
    models, progress = build_models(run, path, task)
    gen = build_generation(run, models, task, tok)
    try:
        m = train_step(run, models, progress, gen, index=0, train_policy=True)
        assert m.reduce()["rollout/staleness"] == 0.0 and progress.synced == 0  # step 1 did not sync (2 does)
        _, ro = rollout_phase(run, gen, 1)
    finally:
        gen.rollout_engine.shutdown()
    start = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    s = gen.sampling
    assert ((ro.infer_logp - trainer_logp(start, ro, s, tok.pad_token_id)).abs() * ro.mask).max() < FP32_LOGP_ATOL
    assert ((ro.infer_logp - trainer_logp(models.policy, ro, s, tok.pad_token_id)).abs() * ro.mask).max() > 1e-3


@pytest.mark.e2e
def test_ratio_leaves_one_on_stale_steps_and_resume_is_exact(tmp_path):
    """4 steps, --sync-every 2, fp32 engine: staleness 0 1 0 1; pi_old / pi_infer stays at 1 (fp32 noise) on the fresh
    steps and leaves it on the stale ones. Stopped at step 2 (a checkpoint right after a sync) and resumed, the run
    logs what the uninterrupted one logs."""

    def cfg(out, steps):
        return small(out, steps=steps, sync_every=2, save_every=2, engine_dtype="fp32", lr=5e-3, deterministic=True)

    try:
        ref = main(cfg(tmp_path / "ref", 4))
        main(cfg(tmp_path / "run", 2))
        main(cfg(tmp_path / "run", 4))
    finally:
        torch.use_deterministic_algorithms(False)
    steps = [r for r in ref if r["step"] > 0]
    assert [r["rollout/staleness"] for r in steps] == [0.0, 1.0, 0.0, 1.0]
    assert all(r["mismatch/ratio_max"] < 1 + 1e-4 and r["mismatch/k3"] < 1e-8 for r in steps[::2])
    assert all(r["mismatch/ratio_max"] > 1 + 1e-3 and r["mismatch/k3"] > 1e-7 for r in steps[1::2])
    k3 = [
        r["mismatch/k3"] for r in steps
    ]  # k3's trend over the steps so far (up to runlog.K3_SLOPE_WINDOW): a sawtooth here
    assert "mismatch/k3_slope" not in steps[0] and steps[3]["mismatch/k3_slope"] == L.window_slope(k3) > 0
    assert all(
        0 < r["mismatch/ess"] <= 1 + 1e-6 and 0 < r["mismatch/seq_ess"] <= 1 + 1e-6 for r in steps
    )  # Cauchy-Schwarz, float32

    def no_eval(rs):
        return [{k: v for k, v in r.items() if not k.startswith("eval/")} for r in rs]  # (step 2 ends a run)

    run, ref_rows = read_metrics(tmp_path / "run", volatile=False), read_metrics(tmp_path / "ref", volatile=False)
    assert no_eval(run) == no_eval(ref_rows) and run[-1] == ref_rows[-1]
