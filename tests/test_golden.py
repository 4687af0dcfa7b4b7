"""The golden-numerics guard: seeded 3-step CPU runs of the whole loop reproduce recorded figures bit for bit.

A refactor of the loop must leave these unchanged. Only a deliberate change of the numerics may re-record them, in
its own commit that says why:

    OMP_NUM_THREADS=1 .venv/bin/python tests/test_golden.py --record

The runs are deterministic (torch.use_deterministic_algorithms) on one thread, so every float is exact: the file
stores them as JSON numbers (repr round-trips a float64) and the test compares with ==. They start from the seeded
random tiny model (data.tiny.build_tiny_model), not the warmed-up default model, so the guard depends on no cached
build, and score with `odd_bytes`, a dense reward a random model earns in part (a spread of rewards in every batch).

Exact floats depend on the CPU's kernels (the same commit gives other figures on another CPU model or vector
instruction set), so golden.json holds one record per CPU, and --record adds or replaces this CPU's. On a CPU with
no record the test checks what it can, that the run reproduces itself bit for bit, and warns: to guard a refactor
there, record on the commit before it.
"""

import hashlib
import json
import os
import sys
import warnings

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data.tiny import build_tiny_model, cpu_name  # noqa: E402
from train_ppo import Config, main  # noqa: E402

pytestmark = pytest.mark.e2e
GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden.json")
# Per-step figures the guard pins: the policy's and critic's grad norms, the value loss, the reward, the mismatch.
KEYS = (
    "ppo/grad_norm",
    "critic/grad_norm",
    "critic/value_loss",
    "rollout/reward_mean",
    "mismatch/k3",
    "mismatch/masked_frac",
    "eval/greedy_acc",
    "eval/sampled_acc",
)
RUNS = {
    # PPO + IcePop against a bf16 engine (real mismatch; a band narrow enough to mask some tokens), micro-batches and
    # two minibatches, critic pretraining (a 2-step cap), the "before RL" evaluation and one at the last step.
    "ppo": dict(algo="ppo", critic_pretrain=2, minibatches=2, micro_batch=4, icepop_low=0.999, icepop_high=1.001),
    # GRPO with groups sharing their prompt's forward, a k3 KL loss to the frozen reference, two epochs.
    "grpo": dict(algo="grpo", kl="k3-loss", ppo_epochs=2, micro_batch=8),
}


def odd_bytes(completions: list[str], **columns) -> list[float]:
    """The share of a completion's characters with an odd code point (0 for an empty one)."""
    return [sum(ord(c) % 2 for c in t) / len(t) if t else 0.0 for t in completions]


def golden_run(name: str, out_dir: str) -> dict:
    """Run RUNS[name] for 3 steps; returns {"rows": the pinned keys per logged row, "policy_sha256": of the final weights}."""
    model = build_tiny_model(os.path.join(out_dir, "model"), seed=3)
    cfg = Config(
        model=model,
        reward=f"{os.path.abspath(__file__)}:odd_bytes",
        out_dir=os.path.join(out_dir, "run"),
        steps=3,
        seed=3,
        deterministic=True,
        rollout_batch=16,
        eval_every=3,
        eval_size=32,
        save_every=100,
        train_dtype="fp32",
        **RUNS[name],
    )
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    try:
        history = main(cfg)
    finally:  # main() switches deterministic algorithms on for the whole process
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
    # Every logged metric is a float32 figure; the evaluation's are pinned at that precision too (rounding is exact).
    rows = [
        {
            k: r[k] if k in ("step", "pretrain/step") else float(torch.tensor(r[k], dtype=torch.float32))
            for k in ("step", "pretrain/step", *KEYS)
            if k in r
        }
        for r in history
    ]
    weights = load_file(os.path.join(cfg.out_dir, "checkpoints", "step_000003", "policy", "model.safetensors"))
    digest = hashlib.sha256()
    for key in sorted(weights):
        digest.update(key.encode())
        digest.update(weights[key].contiguous().view(torch.uint8).numpy().tobytes())
    return {"rows": rows, "policy_sha256": digest.hexdigest()}


def cpu_key() -> str:
    """Which record applies: the CPU model, the vector instructions torch dispatches to, and torch's version."""
    return f"{cpu_name()} / {torch.backends.cpu.get_cpu_capability()} / torch {torch.__version__}"


@pytest.mark.parametrize("name", sorted(RUNS))
def test_golden_run_is_reproduced_bit_for_bit(name, tmp_path):
    got = golden_run(name, str(tmp_path / "a"))
    with open(GOLDEN) as f:
        records = json.load(f)
    if cpu_key() in records:
        want = records[cpu_key()][name]
    else:
        warnings.warn(
            f"tests/golden.json has no record for this CPU ({cpu_key()}; recorded: {sorted(records)}): "
            "checked only that the run reproduces itself. Record one with `OMP_NUM_THREADS=1 .venv/bin/python "
            "tests/test_golden.py --record` on the commit before a change to guard it."
        )
        want = golden_run(name, str(tmp_path / "b"))
    assert len(got["rows"]) == len(want["rows"])
    for g, w in zip(got["rows"], want["rows"]):
        assert g == w, f"row {w.get('step')} / pretraining {w.get('pretrain/step')}: got {g}, recorded {w}"
    assert got["policy_sha256"] == want["policy_sha256"]


if __name__ == "__main__":
    import tempfile

    if sys.argv[1:] != ["--record"]:
        sys.exit(__doc__)
    record = {}
    for name in sorted(RUNS):
        with tempfile.TemporaryDirectory() as d:
            record[name] = golden_run(name, d)
    with open(GOLDEN) as f:
        records = json.load(f)
    records[cpu_key()] = record
    with open(GOLDEN, "w") as f:
        json.dump(records, f, indent=1)
        f.write("\n")
    print(f"wrote this CPU's record ({cpu_key()}) into {GOLDEN}")
