"""The run's options (Config, one field per command-line flag) and the checks that run before any model loads:
resolve (the options against each other and the world) and check_model (the model folder and every data row).
A resume is checked against the recorded run by checkpoint.check_resume."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
from dataclasses import dataclass, fields
from typing import Literal

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from agent import load_env
from checkpoint import safetensors_problem, shape_problem
from data.rewards import load_reward
from data.tasks import BUILTIN, check_lengths
from lora import target_modules
from moe import is_moe
from parallel import SUPPORTED_MODELS, check_tp
from rollout import Sampling
from tools import is_tool_env


@dataclass
class Config:
    """IcePop PPO (or GRPO) on a causal LM; each field's default is the project's (README, "The recipe")."""

    # run
    model: str = ""
    """Hugging Face model folder; empty = the embedded tiny model, built and warmed up on first use."""
    tiny: Literal["dense", "moe"] = "dense"
    """The embedded tiny model (when --model is empty): dense (Llama, ~1.0M parameters) or moe (its Qwen3-MoE twin:
    8 experts, top-2, ~1.0M active of 3.4M parameters)."""
    task: str = "addition"
    """'addition', 'sort', or your data: a .jsonl / .json / .csv / .parquet file, a datasets.save_to_disk folder or a
    hub dataset name owner/name, with a prompt (a string or a list of chat messages) and an answer per row (the
    default model is warmed up on sort for 'sort', on addition otherwise)."""
    split: str = "train"
    """The split of --task when it is a DatasetDict folder or a hub dataset."""
    prompt_key: str = "prompt"
    """The column of --task (and --eval-task) that holds the prompt."""
    answer_key: str = "answer"
    """The column of --task (and --eval-task) that holds the reference answer."""
    env: str = ""
    """Multi-turn: your environment class, 'path/to/file.py:Class' or 'package.module:Class' (reset(row) -> first user
    message, step(text) -> (observation or None, reward, done); docs/multiturn.md), played on the rows of
    --task. '' = none (--task guess is multi-turn on its own)."""
    max_turns: int = 0
    """Multi-turn: turns per episode; 0 = the task's (guess: 6) or 8 with --env."""
    compact_at: int = 0
    """Multi-turn context compaction: once a row's context would pass this many tokens, the policy is asked for a summary
    and the episode goes on in a new row from the task plus the summary; 0 = off."""
    tool_parser: Literal["hermes", "glm"] = "hermes"
    """A tool environment (--env with TRL's environment_factory form, docs/tools.md): how model turns write tool calls.
    hermes = JSON in <tool_call>...</tool_call> (Qwen2.5, Qwen3, ChatML models); glm = GLM-4.5/GLM-5's
    <tool_call>name<arg_key>..</arg_key><arg_value>..</arg_value></tool_call>, turns also ending at <|observation|>."""
    tool_calls_per_turn: int = 4
    """A tool environment: the calls run per model turn (each further one answers an error)."""
    tool_timeout: float = 10.0
    """A tool environment: seconds a tool call may take (the python tool is killed at its own limit, PythonLimits; a
    tool of yours past it stops the run, naming it)."""
    reward: str = ""
    """Reward: '' = the task's default (exact match), 'exact', 'math' (final answer checked by math-verify),
    'path/to/file.py:function' or 'package.module:function' (docs/byo.md)."""
    user_timeout: float = 120.0
    """Seconds a call of your code may take: the reward function over a batch, an environment's reset or step (each
    runs in a worker thread; a hang stops the run naming the function and the sample or turn); 0 = no limit."""
    out_dir: str = "outputs/run"
    """Run folder: config.json, metrics.jsonl, plots/, checkpoints/. An existing run there is resumed."""
    steps: int = 100
    """Policy steps (a critic warm-up step counts as a step)."""
    seed: int = 0
    """Seed of everything: data order, sampling, minibatch shuffles."""
    deterministic: bool = False
    """torch.use_deterministic_algorithms: bit-exact resume on CPU."""
    accept_changed_inputs: bool = False
    """Resume although the data, reward or environment files (or the splits) differ from those the run recorded."""
    # algorithm
    algo: Literal["ppo", "grpo", "reinforce", "vine"] = "ppo"
    """ppo: critic + token-level GAE. grpo: group-relative advantages, no critic. reinforce: no critic, the reward minus
    the mean of the prompt's last --baseline-window rewards from earlier steps (SAO's control). vine: Monte Carlo values
    from --vine-k continuations per state (VinePPO), no critic."""
    correction: Literal["icepop", "tis", "geo", "dis", "none"] = "icepop"
    """Train-inference mismatch correction: IcePop token masking, truncated IS, geometric sequence mask, DIS loss, none."""
    icepop_low: float = 0.5
    """The correction's band on k = pi_old / pi_infer, lower bound alpha: IcePop and the geo mask mask outside it."""
    icepop_high: float = 2.0
    """The band's upper bound beta (GLM-5: 2; Ring-1T: 5); TIS truncates its weights at it (the cap C)."""
    kl: Literal["none", "k1-reward", "k3-loss"] = "none"
    """KL to the frozen initial policy: none (GLM-5), a k1 penalty in the reward, or a k3 loss term."""
    kl_coef: float = 0.01
    """KL coefficient when kl != none."""
    gamma: float = 1.0
    """Discount."""
    lam_policy: float = 0.95
    """GAE lambda of the policy's advantages, decoupled from the critic's targets, which use lambda 1 (VC-PPO: Monte
    Carlo returns, unbiased however wrong the values)."""
    adaptive_lambda: float = 0.0
    """> 0: length-adaptive policy lambda = 1 - 1/(alpha L) with this alpha (VAPO 0.05)."""
    whiten_advantages: bool = True
    """Whiten PPO advantages over the global batch."""
    vine_k: int = 4
    """vine: continuations sampled from each state; V(s) is their mean reward."""
    vine_every: int = 1
    """vine: a state every this many response tokens (1 = before every token)."""
    grpo_std: bool = True
    """GRPO: divide by the group std (False = Dr. GRPO)."""
    baseline_window: int = 8
    """reinforce: the baseline is the mean of this many latest rewards of the same prompt from earlier steps, or the
    step's mean reward for a prompt without any; the advantage sits on every model token (whitened as PPO's)."""
    clip_low: float = 0.2
    """PPO clip epsilon below 1 (also DIS's band)."""
    clip_high: float = 0.28
    """PPO clip epsilon above 1 (DAPO clip-higher)."""
    dual_clip: float = 0.0
    """Dual-clip constant c (> 1, e.g. 3); 0 = off."""
    agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """Loss aggregation over tokens."""
    # batch and optimisation
    rollout_batch: int = 64
    """Completions per step over all ranks."""
    n_samples: int = 0
    """Samples per prompt; 0 = 1 for ppo and reinforce (individual rollouts), 4 for grpo."""
    ppo_epochs: int = 1
    """Passes over each batch."""
    minibatches: int = 1
    """Optimiser steps per epoch."""
    micro_batch: int = 64
    """Rows per forward/backward (gradient accumulation; the loss denominator stays global)."""
    lr: float = 2e-4
    """Policy learning rate (AdamW)."""
    critic_lr: float = 0.0
    """Critic learning rate; 0 = 5x lr."""
    critic_updates: int = 2
    """Critic optimiser passes per policy update (SAO: 2)."""
    critic_pretrain: int = 100
    """PPO: at most this many critic-only steps on the frozen start policy before step 1 (not counted in --steps;
    they stop earlier when explained variance plateaus); 0 = off."""
    freeze_critic_attention: bool = False
    """SAO's frozen-attention critic."""
    critic_context: Literal["policy", "answer", "env"] = "policy"
    """What the critic reads before each row's prompt, never shown to the policy (docs/critic.md): policy = nothing
    more than the policy; answer = "Reference answer: {answer}\\n"; env = the string the environment's optional
    critic_context() returns after reset (multi-turn). Unbiased only if the critic also sees the history."""
    critic_init: str = ""
    """Start the critic from one fitted offline (a folder of bench/value_fit.py --save), not from the policy with a fresh
    head; refused unless fitted on this --model (by content) with this --critic-context."""
    value_clip: float = 0.2
    """Value clipping epsilon; 0 = off."""
    # LoRA (peft): the base weights stay frozen and the engine gets the merged W + alpha / rank * B A (lora.py)
    lora_rank: int = 0
    """Policy: LoRA adapters of this rank on --lora-target; 0 = full fine-tuning. One process or data parallel only."""
    lora_alpha: float = 16.0
    """Policy LoRA scale numerator: the update is alpha / rank * B A."""
    lora_dropout: float = 0.0
    """Dropout on the policy's LoRA inputs (0: the recompute and the update see the same function)."""
    lora_target: str = "all-linear"
    """The policy's adapted modules: all-linear (every linear layer of the decoder layers), or names (q_proj,v_proj)."""
    critic_lora_rank: int = 0
    """Critic: LoRA adapters of this rank on --critic-lora-target (its value head stays fully trained); 0 = full."""
    critic_lora_alpha: float = 16.0
    """Critic LoRA scale numerator."""
    critic_lora_dropout: float = 0.0
    """Dropout on the critic's LoRA inputs."""
    critic_lora_target: str = "all-linear"
    """The critic's adapted modules, as --lora-target."""
    max_grad_norm: float = 1.0
    """Gradient clipping (policy and critic separately)."""
    max_bad_steps: int = 3
    """Stop after this many consecutive updates with a non-finite loss or gradient."""
    # sampling and engine
    temperature: float = 1.0
    """Sampling temperature (the trainer's log-probs use the same)."""
    top_k: int = 0
    """Top-k sampling, applied identically by engine and trainer; 0 = off."""
    top_p: float = 1.0
    """Top-p sampling, applied identically by engine and trainer; 1.0 = off."""
    max_new_tokens: int = 0
    """0 = the task's budget."""
    engine: Literal["embedded", "sglang"] = "embedded"
    """Rollout engine."""
    engine_dtype: Literal["fp32", "bf16", "fp8", "int4"] = "bf16"
    """Engine weights: fp32, bf16, fp8 (per-channel) or int4 (weight-only, groups of 32) fake-quantised decoder
    Linears over bf16 compute; against an fp32 trainer (--train-dtype) all but fp32 create the mismatch IcePop corrects."""
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    """Engine KV cache: auto = the engine's compute dtype; fp8 = float8_e4m3 keys and values (scale 1)."""
    sync_every: int = 1
    """The rollout engine gets the policy's weights after every N-th update (1 = each; the last step always): rollouts
    from weights up to N - 1 updates old, the colocated analogue of an asynchronous pipeline's staleness
    (rollout/staleness), which IcePop's ratio pi_old / pi_infer then measures. --save-every (and, evaluating with the
    rollout engine, --eval-every) must be multiples of N."""
    moe_flip: float = 0.0
    """Lab knob (off at 0): the embedded engine routes each token's k-th expert to the (k+1)-th best with this
    probability per token and MoE layer, a heavy-tailed discrete mismatch the trainer does not make (docs/engines.md)."""
    prefix_cache: bool = False
    """Embedded engine, multi-turn tasks: keep the last turn's keys and values, so the next turn prefills only its new
    tokens (bench/bench_episodes.py: 2.4x on --task guess). Log-probs equal a fresh prefill's to float rounding, not bit
    for bit, so it is off by default; not for MoE models. SGLang keeps its own prefix cache."""
    routing_replay: bool = False
    """MoE: the trainer's recompute and policy passes use the experts the engine chose for each token (R3); the gate
    weights stay the trainer router's softmax at those experts. Embedded engine, single-turn tasks."""
    tp: int = 1
    """Tensor-parallel ranks per replica (data parallel = world size / tp)."""
    fsdp: bool = False
    """Shard parameters, gradients and AdamW states of policy, critic and reference over the data-parallel ranks
    (FSDP2 on the mesh's dp axis; composes with --tp). Without it every dp rank holds full replicas."""
    shared_prefix: bool = True
    """With n > 1 samples per prompt, the trainer packs each prompt once with its n responses (a block attention mask)
    instead of n padded rows: the same outputs, the prompt computed once per group (needs SDPA attention)."""
    train_dtype: Literal["auto", "fp32", "bf16"] = "auto"
    """Trainer compute: bf16 = autocast over fp32 master weights (fp32 gradients, reductions, AdamW states, log-probs and
    losses); auto = bf16 on CUDA, fp32 on CPU (where the exactness tests run)."""
    # outputs
    eval_every: int = 20
    """Held-out evaluation (greedy and sampled accuracy) every N steps, and before and after the run."""
    eval_size: int = 500
    """Held-out problems per evaluation."""
    eval_task: str = ""
    """A separate held-out set (the forms of --task; its prompts are dropped from train); '' = a seeded split of --task."""
    eval_split: str = "test"
    """The split of --eval-task when it is a DatasetDict folder or a hub dataset."""
    eval_samples: int = 1
    """Sampled completions per held-out problem; n > 1 adds eval/mean@n, eval/pass@k and eval/maj@k (k = 1, 2, 4, ... <= n)."""
    eval_dtype: Literal["engine", "fp32"] = "engine"
    """Evaluate with the rollout engine, or with an fp32 embedded copy of the policy (the trainer's numbers, so
    quantised-rollout runs are judged on the policy they trained; a second copy of the weights)."""
    save_every: int = 50
    """Checkpoint every N steps (and at the end)."""
    keep_checkpoints: int = 2
    """Checkpoints kept on disk."""
    report_to: Literal["none", "wandb", "tensorboard"] = "none"
    """Also log to Weights & Biases or TensorBoard (needs that package installed); metrics.jsonl is always written."""
    token_records: int = 0
    """Every N steps, one parquet file of per-token records in out_dir/tokens/ (runlog.TOKEN_COLUMNS); 0 = off."""


@dataclass(frozen=True)
class Plan:
    """What resolve() derives from the options and the world, once, before any work. The loop reads the algorithm's
    properties here (critic, grouped, monte_carlo, prompt_baseline); only train_ppo.advantages names the algorithm."""

    dp: int  # data-parallel replicas: world size / --tp
    n: int  # samples per prompt (--n-samples, or the algorithm's default)
    rows: int  # rollouts per dp rank and step
    prompts: int  # prompts per dp rank and step: rows / n
    critic_lr_used: float  # --critic-lr, or 5 x --lr
    multi_turn: bool  # episodes played by an environment (--env, or a built-in multi-turn task)
    tool_env: bool  # that environment is a tool environment (tools.ToolEpisode)
    critic: bool  # a value model is trained (ppo)
    grouped: bool  # rows are judged in groups of n: a group needs >= 2 rewarded rows (grpo)
    monte_carlo: bool  # Monte Carlo continuations from the engine's snapshots, after the rollout (vine)
    prompt_baseline: bool  # a running-mean reward per prompt is kept across steps (reinforce)


def _multi_turn(cfg: Config) -> bool:
    builtin = BUILTIN.get(cfg.task)
    return bool(cfg.env) or (builtin is not None and builtin.multi_turn)


def resolve(cfg: Config, world_size: int) -> Plan:
    """Validate the options against each other and the world, before any expensive work, and derive the plan. Every
    problem found is reported at once, each naming its flags."""
    dp = max(world_size // cfg.tp, 1)
    n = cfg.n_samples or (4 if cfg.algo == "grpo" else 1)
    rows = cfg.rollout_batch // dp
    tool_env, env_errors = _tool_env(cfg)
    plan = Plan(
        dp=dp,
        n=n,
        rows=rows,
        prompts=rows // n,
        critic_lr_used=cfg.critic_lr or 5 * cfg.lr,
        multi_turn=_multi_turn(cfg),
        tool_env=tool_env,
        critic=cfg.algo == "ppo",
        grouped=cfg.algo == "grpo",
        monte_carlo=cfg.algo == "vine",
        prompt_baseline=cfg.algo == "reinforce",
    )
    errors = [
        *check_sizes(cfg, plan, world_size),
        *check_algorithm(cfg, plan),
        *check_numbers(cfg, plan),
        *check_engine(cfg),
        *check_data(cfg),
        *env_errors,
        *check_multi_turn(cfg, plan),
        *check_outputs(cfg),
        *check_lora(cfg, plan),
    ]
    if errors:
        raise ValueError("invalid configuration:\n  " + "\n  ".join(errors))
    return plan


def _tool_env(cfg: Config) -> tuple[bool, list[str]]:
    """(whether the run's environment is a tool environment, the errors of loading --env). Loading runs the
    environment file's top level: its errors are named here, before any work."""
    if not cfg.env:
        builtin = BUILTIN.get(cfg.task)
        return builtin is not None and builtin.tool_env, []
    try:
        return is_tool_env(load_env(cfg.env)), []
    except ValueError as e:
        return False, [str(e)]


def check_sizes(cfg: Config, plan: Plan, world_size: int) -> list[str]:
    """The batch against the launch: --tp, --rollout-batch, --minibatches, --fsdp, and the counts that must be >= 1."""
    errors = []
    if world_size % cfg.tp:
        errors.append(f"--tp {cfg.tp} does not divide the {world_size} processes")
    if cfg.rollout_batch % (plan.n * plan.dp):
        errors.append(
            f"--rollout-batch {cfg.rollout_batch} must split into groups of {plan.n} samples over {plan.dp} "
            "data-parallel ranks"
        )
    if plan.rows % cfg.minibatches or plan.rows < cfg.minibatches:
        errors.append(f"{plan.rows} rows per rank do not split into --minibatches {cfg.minibatches}")
    counts = (
        "steps",
        "ppo_epochs",
        "minibatches",
        "micro_batch",
        "critic_updates",
        "eval_every",
        "save_every",
        "keep_checkpoints",
        "max_bad_steps",
        "eval_size",
        "eval_samples",
        "sync_every",
    )
    errors += [f"--{name.replace('_', '-')} must be >= 1" for name in counts if getattr(cfg, name) < 1]
    if cfg.n_samples < 0 or cfg.max_new_tokens < 0:
        errors.append(
            f"--n-samples and --max-new-tokens must be >= 0 (0 = the default), got {cfg.n_samples} and "
            f"{cfg.max_new_tokens}"
        )
    if cfg.token_records < 0:
        errors.append(f"--token-records must be >= 0 (0 = off), got {cfg.token_records}")
    if cfg.fsdp and plan.dp < 2:
        errors.append(
            f"--fsdp shards over data-parallel ranks and this launch has {plan.dp}: start at least 2 per replica "
            f"(torchrun --nproc_per_node {2 * cfg.tp}), or leave --fsdp off"
        )
    if cfg.fsdp and cfg.compact_at:
        errors.append(
            "--fsdp with --compact-at is not supported: compaction gives data-parallel ranks different numbers of "
            "rows, and FSDP needs every rank to run the same forwards"
        )
    return errors


def check_algorithm(cfg: Config, plan: Plan) -> list[str]:
    """What each algorithm needs and refuses: GRPO's groups, vine's states and rewards, the KL forms, a critic's
    context, reinforce's window, critic pretraining."""
    errors = []
    if plan.grouped and plan.n < 2:
        errors.append("--algo grpo needs --n-samples >= 2 (a group of one has no baseline)")
    if plan.monte_carlo:
        if cfg.vine_k < 1 or cfg.vine_every < 1:
            errors.append(f"--vine-k and --vine-every must be >= 1, got {cfg.vine_k} and {cfg.vine_every}")
        if cfg.vine_every != 1 and plan.multi_turn:
            errors.append(
                f"--vine-every {cfg.vine_every} with a multi-turn task: its states are the starts of the model turns "
                "(states inside a turn are not implemented); leave --vine-every 1"
            )
        if cfg.gamma != 1:
            errors.append(f"--algo vine takes --gamma 1 (its values are undiscounted mean rewards), got {cfg.gamma}")
        if cfg.kl == "k1-reward":
            errors.append(
                "--kl k1-reward with --algo vine is refused: the Monte Carlo values would have to include the KL "
                "penalty of every continuation token; use --kl k3-loss (a loss term) or --algo ppo"
            )
        if cfg.compact_at:
            errors.append(
                "--compact-at with --algo vine is not supported (a continuation would have to replay compaction); "
                "leave --compact-at 0"
            )
    if cfg.kl != "none" and cfg.kl_coef <= 0:
        errors.append(f"--kl {cfg.kl} needs --kl-coef > 0")
    if cfg.critic_init and (not plan.critic or cfg.critic_lora_rank):
        errors.append(
            f"--critic-init needs a full critic: --algo {cfg.algo}, --critic-lora-rank {cfg.critic_lora_rank}"
        )
    if cfg.critic_context != "policy" and not plan.critic:
        errors.append(f"--critic-context {cfg.critic_context} needs a critic: --algo {cfg.algo} has none")
    if cfg.critic_context == "env" and not plan.multi_turn:
        errors.append(
            "--critic-context env needs a multi-turn task (--env, or --task guess): its environment's critic_context()"
        )
    if cfg.baseline_window < 1:
        errors.append(f"--baseline-window must be >= 1, got {cfg.baseline_window}")
    if plan.prompt_baseline and cfg.kl == "k1-reward":
        errors.append(
            "--kl k1-reward with --algo reinforce is refused: its advantage is the row's outcome reward minus a "
            "per-prompt mean, with no per-token rewards; use --kl k3-loss"
        )
    if cfg.critic_pretrain < 0:
        errors.append(f"--critic-pretrain must be >= 0 (0 = off), got {cfg.critic_pretrain}")
    if cfg.compact_at and plan.grouped:
        errors.append(
            "--compact-at with --algo grpo is refused: a compacted episode is several rows, and GRPO's groups are "
            "rows of one prompt; use --algo ppo (every row carries its episode's return)"
        )
    return errors


def check_numbers(cfg: Config, plan: Plan) -> list[str]:
    """The ranges of the numeric options: learning rates, the clip and correction bands, discounts, timeouts, the
    sampling values (checked by Sampling itself, named here by their flags)."""
    errors = []
    if cfg.dual_clip and cfg.dual_clip <= 1:
        errors.append(f"--dual-clip must be > 1 (or 0 = off), got {cfg.dual_clip}")
    if not 0 < cfg.icepop_low < 1 < cfg.icepop_high:
        errors.append(f"the IcePop band must satisfy 0 < low < 1 < high, got [{cfg.icepop_low}, {cfg.icepop_high}]")
    if not 0 < cfg.clip_low < 1 or not 0 < cfg.clip_high:
        errors.append(f"--clip-low must be in (0, 1) and --clip-high > 0, got {cfg.clip_low} and {cfg.clip_high}")
    ranges = {
        "lr": (cfg.lr, cfg.lr > 0, "> 0"),
        "critic-lr": (cfg.critic_lr, cfg.critic_lr >= 0, ">= 0 (0 = 5 x --lr)"),
        "max-grad-norm": (cfg.max_grad_norm, cfg.max_grad_norm > 0, "> 0 (0 would zero every update)"),
        "gamma": (cfg.gamma, 0 < cfg.gamma <= 1, "in (0, 1]"),
        "lam-policy": (cfg.lam_policy, 0 <= cfg.lam_policy <= 1, "in [0, 1]"),
        "adaptive-lambda": (cfg.adaptive_lambda, cfg.adaptive_lambda >= 0, ">= 0"),
        "kl-coef": (cfg.kl_coef, cfg.kl_coef >= 0, ">= 0"),
        "value-clip": (cfg.value_clip, cfg.value_clip >= 0, ">= 0 (0 = off)"),
        "user-timeout": (cfg.user_timeout, cfg.user_timeout >= 0, ">= 0 (seconds; 0 = no limit)"),
    }
    errors += [
        f"--{flag} must be a finite number {want}, got {v}"
        for flag, (v, ok, want) in ranges.items()
        if not (ok and math.isfinite(v))
    ]
    try:  # the sampling values the engines check, here before any work, named by their flags
        Sampling(cfg.temperature, cfg.top_k, cfg.top_p, cfg.max_new_tokens or 1, (), max(plan.n, 1), cfg.seed)
    except ValueError as e:
        errors.append(re.sub(r"Sampling\.(\w+)", lambda x: "--" + x.group(1).replace("_", "-"), str(e)))
    if not 0 <= cfg.moe_flip <= 1:
        errors.append(f"--moe-flip must be a probability in [0, 1], got {cfg.moe_flip}")
    return errors


def check_engine(cfg: Config) -> list[str]:
    """The rollout engine's options: what SGLang can and cannot do, and that it is installed."""
    if cfg.engine != "sglang":
        return []
    errors = []
    if cfg.moe_flip:
        errors.append("--moe-flip is a knob of the embedded engine (--engine embedded)")
    if cfg.prefix_cache:
        errors.append("--prefix-cache is the embedded engine's (--engine embedded); SGLang keeps its own prefix cache")
    if cfg.engine_dtype in ("fp8", "int4"):
        errors.append(
            f"--engine sglang takes --engine-dtype fp32 or bf16 ({cfg.engine_dtype} fake-quantised weights are the "
            "embedded engine's; SGLang 0.5.23 has no on-the-fly weight quantisation that update_weights can refresh)"
        )
    if cfg.kv_cache_dtype == "fp8" and not torch.cuda.is_available():
        errors.append(
            "--kv-cache-dtype fp8 with --engine sglang needs CUDA (SGLang's CPU mode has no fp8 KV cache "
            "with its torch_native attention)"
        )
    try:
        import sglang  # noqa: F401
    except ImportError as e:
        errors.append(f"--engine sglang needs SGLang installed (see docs/engines.md): {e}")
    return errors


def check_data(cfg: Config) -> list[str]:
    """The model folder, the data's columns and splits, the held-out set, the reward (its file's top level runs
    here, so its errors are named before any work)."""
    errors = []
    if cfg.model and not os.path.isfile(os.path.join(cfg.model, "config.json")):
        errors.append(
            f"--model {cfg.model!r} is not a Hugging Face model folder (no config.json); hub names must be "
            "downloaded first"
        )
    if cfg.tiny != "dense" and cfg.model:
        errors.append(f"--tiny {cfg.tiny} picks the embedded default model; it cannot go with --model {cfg.model}")
    for flag in ("split", "prompt_key", "answer_key", "eval_split"):
        if not getattr(cfg, flag).strip():
            errors.append(f"--{flag.replace('_', '-')} must not be empty")
    if cfg.prompt_key == cfg.answer_key:
        errors.append(f"--prompt-key and --answer-key must name different columns, both are {cfg.prompt_key!r}")
    if cfg.eval_task and cfg.eval_task == cfg.task and cfg.eval_split == cfg.split:
        errors.append(
            f"--eval-task {cfg.eval_task!r} is --task with the same split: the held-out set would be the train set"
        )
    try:
        load_reward(cfg.reward)
    except ValueError as e:
        errors.append(str(e))
    return errors


def check_lora(cfg: Config, plan: Plan) -> list[str]:
    """The LoRA options' ranges, and what LoRA does not compose with (its targets are checked against the model's
    layers in check_model)."""
    errors = []
    for who, flag in (("lora", "--lora"), ("critic_lora", "--critic-lora")):
        rank, alpha, dropout = (getattr(cfg, f"{who}_{k}") for k in ("rank", "alpha", "dropout"))
        if rank < 0:
            errors.append(f"{flag}-rank must be >= 0 (0 = full fine-tuning), got {rank}")
        if rank and not alpha > 0:
            errors.append(f"{flag}-alpha must be > 0, got {alpha}")
        if rank and not 0 <= dropout < 1:
            errors.append(f"{flag}-dropout must be in [0, 1), got {dropout}")
    if cfg.critic_lora_rank and not plan.critic:
        errors.append(f"--critic-lora-rank {cfg.critic_lora_rank} needs a critic: --algo {cfg.algo} has none")
    if cfg.critic_lora_rank and cfg.freeze_critic_attention:
        errors.append("--critic-lora-rank with --freeze-critic-attention: a LoRA critic's base is frozen already")
    if (cfg.lora_rank or cfg.critic_lora_rank) and (cfg.tp > 1 or cfg.fsdp):
        errors.append(
            "LoRA (--lora-rank, --critic-lora-rank) with --tp > 1 or --fsdp is not implemented (the adapters are "
            "not sharded): use data parallel (torchrun without --tp), where each rank holds the whole small adapter"
        )
    return errors


def check_multi_turn(cfg: Config, plan: Plan) -> list[str]:
    """The options of multi-turn tasks and tool environments: turns, compaction, rewards, tool limits, routing replay."""
    errors = []
    tool_flags = [
        f"--{f.name.replace('_', '-')}"
        for f in fields(Config)
        if f.name.startswith("tool_") and getattr(cfg, f.name) != f.default
    ]
    if tool_flags and not plan.tool_env:
        errors.append(
            f"{', '.join(tool_flags)}: only for a tool environment (--env with reset(**row) and tools as methods, "
            "no step)"
        )
    if cfg.tool_calls_per_turn < 1 or cfg.tool_timeout <= 0:
        errors.append("--tool-calls-per-turn must be >= 1 and --tool-timeout > 0")
    if cfg.max_turns < 0 or cfg.compact_at < 0:
        errors.append(
            f"--max-turns and --compact-at must be >= 0 (0 = the default / off), got {cfg.max_turns} and "
            f"{cfg.compact_at}"
        )
    if not plan.multi_turn and (cfg.max_turns or cfg.compact_at):
        errors.append("--max-turns and --compact-at apply to multi-turn tasks: give --env (or --task guess)")
    if plan.multi_turn and cfg.reward and not plan.tool_env:
        errors.append(f"--reward {cfg.reward!r} with a multi-turn task: the environment's step() gives the rewards")
    if plan.tool_env and cfg.compact_at:
        errors.append("--compact-at is not implemented for tool environments")
    if cfg.routing_replay and (cfg.engine != "embedded" or plan.multi_turn):
        errors.append(
            "--routing-replay needs the embedded engine (it records the experts per token) and a single-turn task "
            "(multi-turn rows re-route their context each turn; replaying one record per token is not implemented)"
        )
    return errors


def check_outputs(cfg: Config) -> list[str]:
    """The run folder, checkpoints and evaluations against --sync-every, and the optional loggers."""
    errors = []
    if not cfg.out_dir.strip():  # '' would write the run (and resume one) in the current folder
        errors.append("--out-dir must not be empty (give the run folder, e.g. outputs/run)")
    elif os.path.exists(cfg.out_dir) and not os.path.isdir(cfg.out_dir):
        errors.append(f"--out-dir {cfg.out_dir!r} exists and is not a folder")
    else:
        parent = cfg.out_dir
        while not os.path.exists(parent):
            parent = os.path.dirname(os.path.abspath(parent))
        if not os.access(parent, os.W_OK | os.X_OK):
            errors.append(f"--out-dir {cfg.out_dir!r}: {parent!r} is not writable")
    if cfg.sync_every > 1 and cfg.save_every % cfg.sync_every:  # a checkpoint between syncs: fresher weights on resume
        errors.append(
            f"--save-every {cfg.save_every} must be a multiple of --sync-every {cfg.sync_every}: a resume loads the "
            "checkpoint's weights into the engine, which an uninterrupted run would not have until its next sync"
        )
    if cfg.sync_every > 1 and cfg.eval_dtype == "engine" and cfg.eval_every % cfg.sync_every:
        errors.append(
            f"--eval-every {cfg.eval_every} must be a multiple of --sync-every {cfg.sync_every} (the evaluation "
            "samples the rollout engine, whose weights would be stale), or evaluate an fp32 copy of the policy: "
            "--eval-dtype fp32"
        )
    if cfg.report_to != "none" and importlib.util.find_spec(cfg.report_to) is None:
        errors.append(f"--report-to {cfg.report_to} needs the {cfg.report_to} package: pip install {cfg.report_to}")
    return errors


def check_critic_context(cfg: Config, task) -> None:
    """--critic-context against the task: env needs an environment class with a critic_context method, answer a
    non-empty answer on every train row (the critic's prefix)."""
    if cfg.critic_context == "env" and not callable(getattr(task.env, "critic_context", None)):
        raise ValueError(
            f"--critic-context env: the environment {getattr(task.env, '__name__', task.env)!r} has no critic_context() "
            "method (def critic_context(self) -> str, called after reset; agent.py)"
        )
    if cfg.critic_context == "answer" and (
        bad := [i for i, a in enumerate(task.train["answer"]) if not str(a).strip()]
    ):
        raise ValueError(
            f"--critic-context answer: {len(bad)} train rows have no answer (first: {task.train[bad[0]].get('where', bad[0])})"
        )


def check_model(cfg: Config, path: str, task) -> "AutoTokenizer":
    """What can be checked of the model folder and the data without loading weights; returns the tokenizer. (Whether
    the weights fill the architecture is checked as they load: decoder.load_pretrained.)"""
    name = f"--model {path}" if cfg.model else f"the default model {path}"
    try:  # transformers' errors name neither the flag nor, for some, the file
        mc = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"{name}: its config.json cannot be read as a model config ({type(e).__name__}: {e})") from e
    if mc.model_type not in SUPPORTED_MODELS:
        raise ValueError(
            f"{name}: model type {mc.model_type!r} is not supported (the engine, the TP plan and the critic "
            f"implement {', '.join(SUPPORTED_MODELS)})"
        )
    if cfg.routing_replay and not is_moe(mc):
        raise ValueError(f"--routing-replay: {name} is not a mixture of experts (model type {mc.model_type!r})")
    if cfg.prefix_cache and is_moe(mc):
        raise ValueError(
            f"--prefix-cache is not implemented for mixtures of experts ({name}: a cached prefix has no recorded routing)"
        )
    files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any(os.path.isfile(os.path.join(path, f)) for f in files):
        raise ValueError(
            f"{name} has no tokenizer files (none of {', '.join(files)}); save one there with tokenizer.save_pretrained"
        )
    if bad := safetensors_problem(path):
        raise ValueError(f"{name}: {bad}")
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (
        Exception
    ) as e:  # a damaged tokenizer.json raises a bare JSONDecodeError; a slow-only one, a converter's error
        raise ValueError(
            f"{name}: its tokenizer cannot be loaded ({type(e).__name__}: {e}); save a working one there with "
            "tokenizer.save_pretrained"
        ) from e
    if len(tok) > mc.vocab_size:
        raise ValueError(f"{name}: the tokenizer has {len(tok)} tokens but the model's vocabulary only {mc.vocab_size}")
    try:
        with torch.device("meta"):  # a weightless copy: the shapes config.json gives, with nothing allocated
            shapes = AutoModelForCausalLM.from_config(mc)
    except Exception as e:  # transformers' own asserts (a pad id past the vocabulary) name neither flag nor file
        raise ValueError(f"{name}: its config.json does not build a model ({type(e).__name__}: {e})") from e
    if bad := shape_problem(path, shapes):
        raise ValueError(f"{name}: {bad}. Fix its config.json or the weights")
    if cfg.tp > 1:  # the head counts against --tp
        check_tp(shapes, cfg.tp)
    if (cfg.lora_rank or cfg.critic_lora_rank) and is_moe(mc):
        raise ValueError(f"LoRA (--lora-rank, --critic-lora-rank) on a mixture of experts ({name}) is not implemented")
    for flag, rank, target in (
        ("--lora-target", cfg.lora_rank, cfg.lora_target),
        ("--critic-lora-target", cfg.critic_lora_rank, cfg.critic_lora_target),
    ):
        try:
            if rank:
                target_modules(shapes, target)
        except ValueError as e:
            raise ValueError(f"{flag}: {e}") from None
    if tok.eos_token_id is None or not tok.chat_template:
        raise ValueError(
            f"{name}: the tokenizer needs an EOS token and a chat template (responses stop at EOS; prompts are chat turns)"
        )
    if tok.pad_token_id is None:  # many base models ship none (Llama 3); every forward masks padding out, so EOS serves
        tok.pad_token = tok.eos_token
    if cfg.algo == "vine" and task.env is not None and not callable(getattr(task.env, "reseed", None)):
        raise ValueError(
            f"--algo vine: the environment {task.env.__name__} has no reseed(seed) method. A continuation plays "
            "on a copy of the environment and must draw its own randomness afresh: define reseed (a no-op "
            "if the environment has no randomness of its own)"
        )
    new = cfg.max_new_tokens or task.max_new_tokens
    if new >= mc.max_position_embeddings:
        raise ValueError(
            f"--max-new-tokens {new} leaves no room for a prompt in the model's context of {mc.max_position_embeddings} tokens"
        )
    if cfg.compact_at and not cfg.compact_at + 2 * new < mc.max_position_embeddings:
        raise ValueError(
            f"--compact-at {cfg.compact_at} leaves no room for the summary request and the summary ({new} tokens) "
            f"in the model's context of {mc.max_position_embeddings} tokens"
        )
    check_lengths(task, tok, mc.max_position_embeddings, new, cfg.compact_at)  # every data row, naming the file row
    check_critic_context(cfg, task)
    if not any(f.endswith((".safetensors", ".bin")) for f in os.listdir(path)):
        raise ValueError(
            f"{name} has no weights (no *.safetensors or *.bin file); save the model there with model.save_pretrained"
        )
    index = os.path.join(path, "model.safetensors.index.json")  # a sharded folder: an interrupted copy lacks shards
    if os.path.isfile(index):
        try:
            with open(index) as f:
                shards = set(json.load(f)["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{name}: {index} is unreadable ({type(e).__name__}: {e})") from e
        if missing := sorted(s for s in shards if not os.path.isfile(os.path.join(path, s))):
            raise ValueError(f"{name}: {index} names {len(missing)} shard(s) the folder lacks: {', '.join(missing)}")
    return tok
