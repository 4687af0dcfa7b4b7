"""Every configuration refusal, in one table: config.resolve names the flag before any model, data or process group
is touched. (Refusals that need a model folder, a data file or a run folder are tested beside what they guard:
test_reliability, test_train, test_byo, test_agent, test_data.)"""

import pytest

from config import Config, resolve


def config(tmp_path, **kw) -> Config:
    return Config(**{"out_dir": str(tmp_path / "run"), **kw})


def test_the_base_of_the_table_is_accepted(tmp_path):
    """Each row below changes only what it names, so its refusal is that change's."""
    assert resolve(config(tmp_path), 1).dp == 1 and resolve(config(tmp_path, tp=2), 4).dp == 2


@pytest.mark.parametrize(
    "kw,world,msg",
    [
        # launch shape, groups, minibatches
        (dict(tp=2), 3, "does not divide the 3 processes"),
        (dict(algo="grpo", n_samples=1), 1, "needs --n-samples >= 2"),
        (dict(rollout_batch=30, n_samples=4, algo="grpo"), 1, "groups of 4"),
        (dict(rollout_batch=64, minibatches=3), 1, "do not split into --minibatches 3"),
        (dict(fsdp=True), 1, "--fsdp shards over data-parallel ranks and this launch has 1"),
        (dict(fsdp=True, tp=2), 2, "--fsdp shards over data-parallel ranks and this launch has 1"),
        (dict(fsdp=True, task="guess", compact_at=64), 2, "--fsdp with --compact-at is not supported"),
        # numbers, named by their flags
        (dict(lr=float("inf")), 1, "--lr must be a finite number > 0, got inf"),
        (dict(lr=float("nan")), 1, "--lr must be a finite number > 0, got nan"),
        (dict(critic_lr=float("nan")), 1, "--critic-lr must be a finite number"),
        (dict(max_grad_norm=0.0), 1, "--max-grad-norm must be a finite number > 0"),
        (dict(clip_low=-0.2), 1, "--clip-low must be in"),
        (dict(clip_high=-0.1), 1, "--clip-high > 0"),
        (dict(eval_size=0), 1, "--eval-size must be >= 1"),
        (dict(critic_pretrain=-1), 1, "--critic-pretrain must be >= 0"),
        (dict(token_records=-1), 1, "--token-records must be >= 0"),
        (dict(critic_init="fit", algo="grpo"), 1, "--critic-init needs a full critic: --algo grpo"),
        (dict(critic_init="fit", critic_lora_rank=8), 1, "--critic-init needs a full critic.*--critic-lora-rank 8"),
        (dict(temperature=0.0), 1, "--temperature must be a finite number > 0"),
        (dict(top_p=2.0), 1, r"--top-p must be in \(0, 1\]"),
        (dict(top_k=-1), 1, "--top-k must be an int >= 0"),
        (dict(n_samples=-1), 1, "--n-samples and --max-new-tokens must be >= 0"),
        (dict(gamma=0.0), 1, r"--gamma must be a finite number in \(0, 1\]"),
        (dict(lam_policy=1.5), 1, r"--lam-policy must be a finite number in \[0, 1\]"),
        (dict(kl="k3-loss", kl_coef=0.0), 1, "needs --kl-coef > 0"),
        (dict(icepop_low=1.5), 1, "IcePop band"),
        # vine
        (dict(algo="vine", vine_k=0), 1, "--vine-k and --vine-every must be >= 1, got 0 and 1"),
        (dict(algo="vine", vine_every=0), 1, "--vine-k and --vine-every must be >= 1, got 4 and 0"),
        (dict(algo="vine", task="guess", vine_every=2), 1, "--vine-every 2 with a multi-turn task"),
        (dict(algo="vine", kl="k1-reward"), 1, "--kl k1-reward with --algo vine is refused"),
        (dict(algo="vine", gamma=0.99), 1, "--algo vine takes --gamma 1"),
        (dict(algo="vine", task="guess", compact_at=100), 1, "--compact-at with --algo vine is not supported"),
        # model, engine, reward
        (dict(model="/no/such/model"), 1, "not a Hugging Face model folder"),
        (dict(out_dir=""), 1, "--out-dir must not be empty"),
        (dict(engine_dtype="fp8", engine="sglang"), 1, "--engine sglang takes --engine-dtype fp32 or bf16"),
        (dict(engine_dtype="int4", engine="sglang"), 1, "--engine sglang takes --engine-dtype fp32 or bf16"),
        (dict(prefix_cache=True, engine="sglang"), 1, "--prefix-cache is the embedded engine's"),
        (dict(reward="nonsense"), 1, "(?s)invalid configuration:.*--reward 'nonsense'"),
        # multi-turn
        (dict(task="guess", reward="math"), 1, "the environment's step"),
        (dict(task="guess", algo="grpo", compact_at=100), 1, "--compact-at with --algo grpo is refused"),
        (dict(task="addition", max_turns=3), 1, "apply to multi-turn tasks"),
        # tool environments
        (dict(tool_parser="glm"), 1, "--tool-parser: only for a tool environment"),
        (dict(env="data.guess:GuessTools", tool_timeout=0.0), 1, "--tool-timeout > 0"),
        (dict(env="data.guess:GuessTools", compact_at=100), 1, "--compact-at is not implemented for tool environments"),
        (
            dict(env="data.guess:GuessEnv", tool_calls_per_turn=2),
            1,
            "--tool-calls-per-turn: only for a tool environment",
        ),
    ],
    ids=lambda x: ",".join(f"{k}={v}" for k, v in x.items()) if isinstance(x, dict) else None,
)
def test_bad_configs_are_refused_before_work(tmp_path, kw, world, msg):
    with pytest.raises(ValueError, match=msg):
        resolve(config(tmp_path, **kw), world)


def test_out_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match="--out-dir .* exists and is not a folder"):
        resolve(Config(out_dir=str(tmp_path / "f")), 1)
