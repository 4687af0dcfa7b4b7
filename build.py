"""The run's set-up: its records (Run, Models, Engines) and the functions main() calls before the first step.

    run = setup(cfg)                                        # processes, mesh, the resolved plan, the folder's lock
    task, tok, model_path = load_task(run)                  # the task, every data row and the model folder checked
    models = build_models(run, model_path, task)            # policy, critic, reference, optimisers (or a resume's)
    engines = build_engines(run, models, task, tok)         # the rollout engine (make_engine) and the evaluation one
    log = start_log(run, models, engines, task, tok, model_path)

and `save`, the checkpoint of a step.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

import moe
from agent import DEFAULT_MAX_TURNS, load_env, run_episodes
from config import Config, check_model, resolve
from data.rewards import load_reward
from data.tasks import get_task, prompt_keys
from embedded_engine import EmbeddedEngine
from evaluation import evaluate
from forward import check_head
from parallel import Runtime, init_runtime, make_mesh, parallelize, print0
from rollout import Engine, Sampling
from runlog import (
    RunLog,
    check_fresh_start,
    check_inputs,
    check_resume,
    input_fingerprints,
    latest_checkpoint,
    load_trainer_state,
    lock_run_dir,
    save_checkpoint,
)
from tools import stop_ids, text_env
from value_model import (
    PromptBaseline,
    build_critic,
    freeze_attention,
    load_critic,
    load_policy,
)

REPO = os.path.dirname(os.path.abspath(__file__))


# ----------------------------------------------------------------------------- the run's records


@dataclass(frozen=True)
class Run:
    """The run's fixed settings, resolved once by setup()."""

    cfg: Config
    rt: Runtime
    plan: dict  # config.resolve: dp, n (samples per prompt), rows and prompts per dp rank, critic_lr_used
    dp_group: Any  # this rank's data-parallel process group (None in one process)
    tp_mesh: Any  # this replica's tensor-parallel mesh (None without a mesh)
    dp_rank: int
    fsdp: Any  # the data-parallel mesh when --fsdp shards over it, else None
    engine_rank: bool  # the first rank of each TP group holds the rollout engine
    ckpt: str | None  # the checkpoint this run resumes from
    changes: dict  # options (and, from load_task, inputs) the resume changed, {name: [old, new]}
    inputs: dict  # the run's input fingerprints (runlog.input_fingerprints), filled by load_task
    group: int  # rows kept together in minibatches: a prompt's n samples (1 with compaction)
    share: bool  # a group's rows share one forward of their prompt (TrainBatch.shared)
    lock: Any  # the run folder's lock (rank 0), held until the process ends


@dataclass
class Models:
    policy: Any
    critic: Any  # None for GRPO
    ref: Any  # the frozen initial policy with --kl, else None
    opts: dict  # "policy" (and "critic") AdamW
    path: str  # the folder the policy was loaded from (the engines load it too)
    start: int  # the step the run starts at (a resume's checkpoint step)
    bad: dict  # consecutive skipped updates per model (check_finite)
    fresh_head: bool  # a new critic: its head is set to the mean reward of the first batch
    saved_at: int  # the step of the newest checkpoint
    synced: int = 0  # the updates in the rollout engine's weights (--sync-every: staleness = step - synced)
    baseline: PromptBaseline | None = None  # --algo reinforce's per-prompt reward table (in the checkpoint)


@dataclass(frozen=True)
class Engines:
    rollout: Any  # the rollout engine on engine ranks, None on their TP peers
    eval: Any  # the engine evaluations use (the rollout engine, or an fp32 copy with --eval-dtype fp32)
    sampling: Sampling
    play: Any  # multi-turn: play(engine, rows, sampling) -> agent.Episodes; None for single-turn tasks
    max_len: int  # the model-token budget of a row (the Dr. GRPO denominator): a turn's, or the episode's (turns + 1)
    width: int  # the response block's width (the per-position metrics' keys): a turn's budget, or the context


# ----------------------------------------------------------------------------- set up


def setup(cfg: Config) -> Run:
    """Processes, mesh groups, the resolved plan, the run folder's lock, determinism, and the checkpoint to resume."""
    rt = init_runtime()
    if cfg.train_dtype == "auto":  # resolved before anything records or compares the config
        cfg = replace(cfg, train_dtype="bf16" if rt.device.type == "cuda" else "fp32")
    plan = resolve(cfg, rt.world_size)
    lock = lock_run_dir(cfg.out_dir) if rt.rank == 0 else None
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True)
    mesh = make_mesh(rt, cfg.tp)
    tp_mesh = mesh["tp"] if mesh else None
    ckpt = latest_checkpoint(cfg.out_dir, cfg.algo)
    changes = check_resume(cfg, ckpt, rt.world_size) if ckpt else check_fresh_start(cfg.out_dir, cfg.algo) or {}
    group = 1 if cfg.compact_at else plan["n"]
    return Run(
        cfg,
        rt,
        plan,
        dp_group=mesh["dp"].get_group() if mesh else None,
        tp_mesh=tp_mesh,
        dp_rank=mesh["dp"].get_local_rank() if mesh else 0,
        fsdp=mesh["dp"] if mesh and cfg.fsdp else None,
        engine_rank=tp_mesh is None or tp_mesh.get_local_rank() == 0,
        ckpt=ckpt,
        changes=changes,
        inputs={},
        group=group,
        share=cfg.shared_prefix and group > 1,
        lock=lock,
    )


def load_task(run: Run):
    """(task, tokenizer, model folder). A bad task, data file or row fails here, and a resume's changed inputs
    (runlog.check_inputs), before any model is built; the default model is built (rank 0) on first use."""
    cfg = run.cfg
    task = get_task(
        cfg.task,
        split=cfg.split,
        prompt_key=cfg.prompt_key,
        answer_key=cfg.answer_key,
        reward_fn=load_reward(cfg.reward),
        eval_task=cfg.eval_task,
        eval_split=cfg.eval_split,
        user_timeout=cfg.user_timeout,
    )
    if cfg.env:
        task.env, task.max_turns = load_env(cfg.env), DEFAULT_MAX_TURNS
    task.env = text_env(task, cfg)  # a tool environment (TRL's form) is played as a text one: tools.ToolEpisode
    run.inputs.update(input_fingerprints(cfg, task))
    if run.ckpt:
        run.changes.update(check_inputs(cfg, run.inputs, run.changes))
    model_path = cfg.model
    if not model_path:
        from data.tiny import default_model

        kind = (
            cfg.task if cfg.task in ("addition", "sort", "guess", "walk", "calc") else "addition"
        )  # the built-in tasks have their own warm-up
        if run.rt.rank == 0:
            default_model(os.path.join(REPO, ".cache"), task=kind, arch=cfg.tiny)  # the other ranks find it cached
        if dist.is_initialized():
            dist.barrier()
        model_path = default_model(os.path.join(REPO, ".cache"), task=kind, arch=cfg.tiny)
    return task, check_model(cfg, model_path, task), model_path


def build_models(run: Run, model_path: str, task) -> Models:
    """Policy, critic (PPO), frozen reference (--kl) and optimisers, sharded by the plan; restored from the checkpoint
    when resuming."""
    cfg, rt = run.cfg, run.rt
    path = os.path.join(run.ckpt, "policy") if run.ckpt else model_path
    torch.manual_seed(cfg.seed)
    policy = moe.install(
        load_policy(path, "the checkpoint" if run.ckpt else "--model").to(rt.device)
    )  # MoE: record / replay routing
    check_head(
        policy
    )  # on the plain model: a forward under FSDP would leave the root's weights gathered as the optimiser's
    if run.share and policy.config._attn_implementation != "sdpa":
        raise ValueError(
            f"--shared-prefix needs SDPA attention (a boolean block mask); the model uses "
            f"{policy.config._attn_implementation!r}: pass --no-shared-prefix"
        )
    policy = parallelize(policy, run.tp_mesh, run.fsdp)
    opts = {"policy": torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=0.0)}
    critic = ref = None
    if cfg.algo == "ppo":
        critic = (
            load_critic(os.path.join(run.ckpt, "critic"), torch.float32)
            if run.ckpt
            else build_critic(model_path, dtype=torch.float32)
        )
        if cfg.freeze_critic_attention:
            freeze_attention(critic)
        critic = parallelize(critic.to(rt.device), run.tp_mesh, run.fsdp)
        opts["critic"] = torch.optim.AdamW(
            [p for p in critic.parameters() if p.requires_grad], lr=run.plan["critic_lr_used"], weight_decay=0.0
        )
    if cfg.kl != "none":  # the frozen initial policy, also on resume
        ref = moe.install(load_policy(model_path).to(rt.device).requires_grad_(False))
        ref = parallelize(ref, run.tp_mesh, run.fsdp).eval()
    models = Models(
        policy,
        critic,
        ref,
        opts,
        path,
        start=0,
        bad={k: 0 for k in opts},
        fresh_head=critic is not None and not run.ckpt,
        saved_at=0,
        baseline=PromptBaseline(cfg.baseline_window, keys=prompt_keys(task.train)) if cfg.algo == "reinforce" else None,
    )
    if run.ckpt:
        state = load_trainer_state(run.ckpt, rt.rank, rt.world_size, opts)
        if (
            models.baseline and state.get("baseline_keys") != PromptBaseline.KEYS
        ):  # older: keyed by row; resuming would change the run
            raise ValueError(
                f"{run.ckpt}: its --algo reinforce baseline is keyed by train row, not prompt: use a new --out-dir"
            )
        models.baseline = models.baseline and PromptBaseline(
            cfg.baseline_window, state["baseline"], models.baseline.keys
        )
        models.start = models.saved_at = models.synced = state[
            "step"
        ]  # the engine loads the checkpoint's weights: a re-sync
        if (
            models.start % cfg.sync_every
        ):  # a SIGTERM's checkpoint between syncs (rollout/staleness records it; docs/engines.md)
            print0(
                f"resume: the engine starts from step {models.start}'s weights, fresher than an uninterrupted --sync-every {cfg.sync_every} run's"
            )
        models.bad = state["bad_steps"]
        for k, lr in (
            ("policy", cfg.lr),
            ("critic", run.plan["critic_lr_used"]),
        ):  # a changed --lr / --critic-lr applies
            for group in opts[k].param_groups if k in opts else []:
                group["lr"] = lr
    return models


def build_engines(run: Run, models: Models, task, tok) -> Engines:
    """The rollout engine (engine ranks), the evaluation engine, the sampling settings and the multi-turn driver."""
    cfg, device = run.cfg, run.rt.device
    engine = make_engine(cfg, models.path, device) if run.engine_rank else None
    eval_engine = engine
    if cfg.eval_dtype == "fp32":
        eval_engine = EmbeddedEngine(models.path, dtype="fp32", device=device) if run.engine_rank else None
    sampling = Sampling(
        cfg.temperature,
        cfg.top_k,
        cfg.top_p,
        cfg.max_new_tokens or task.max_new_tokens,
        stop_ids(tok, task.env),
        run.plan["n"],
        cfg.seed,
    )
    if task.env is None:
        return Engines(engine, eval_engine, sampling, None, sampling.max_new_tokens, sampling.max_new_tokens)
    turns, context = cfg.max_turns or task.max_turns, models.policy.config.max_position_embeddings

    def play(eng, rows, s, **vine):
        return run_episodes(
            eng,
            tok,
            task.env,
            rows,
            s,
            max_turns=turns,
            context_len=context,
            compact_at=cfg.compact_at,
            timeout=task.user_timeout,
            **vine,
        )

    return Engines(engine, eval_engine, sampling, play, (turns + 1) * sampling.max_new_tokens, context)


def start_log(run: Run, models: Models, engines: Engines, task, tok, model_path: str) -> RunLog:
    """The run log (a fresh run drops whatever an earlier, killed attempt logged) and, on a fresh run, the "before RL"
    evaluation."""
    cfg, plan = run.cfg, run.plan
    log = RunLog(
        cfg.out_dir,
        run.rt.rank,
        {**asdict(cfg), **plan, "model_path": model_path},
        models.start if run.ckpt else -1,
        cfg.wandb,
        cfg.tensorboard,
        run.changes,
        run.inputs,
    )
    print0(
        f"{'resuming at step ' + str(models.start) if run.ckpt else 'starting'}: {cfg.algo} + {cfg.correction}, model {model_path}, "
        f"world {run.rt.world_size} (dp {plan['dp']} x tp {cfg.tp}), {cfg.rollout_batch} completions/step, run folder {cfg.out_dir}"
    )
    if run.ckpt is None:
        before, records = evaluate(
            engines.eval, tok, task, cfg, engines.sampling, run.dp_rank, plan["dp"], engines.play
        )
        log.log({"step": 0, **before})
        log.samples(0, records)
        print0(
            f"before RL: greedy accuracy {before['eval/greedy_acc']:.1%}, sampled {before['eval/sampled_acc']:.1%} "
            f"on {min(cfg.eval_size, len(task.test))} held-out problems"
        )
    log.start_progress(cfg.steps, models.start)
    return log


def save(run: Run, models: Models, tok, step: int) -> None:
    save_checkpoint(
        run.cfg.out_dir,
        step,
        run.rt.rank,
        run.rt.world_size,
        run.cfg.keep_checkpoints,
        policy=models.policy,
        critic=models.critic,
        tokenizer=tok,
        optimizers=models.opts,
        extra={
            "bad_steps": dict(models.bad),
            "tp": run.cfg.tp,
            **({"baseline": models.baseline.table, "baseline_keys": PromptBaseline.KEYS} if models.baseline else {}),
        },
    )
    models.saved_at = step


# ----------------------------------------------------------------------------- engines

# Share of each GPU that SGLang reserves for weights + KV cache when colocated with the trainer.
SGLANG_GPU_MEM_FRACTION = 0.4


def make_engine(cfg, path: str, device: torch.device) -> Engine:
    """The rollout engine of a run: --engine, --engine-dtype, --kv-cache-dtype, --seed (and the embedded engine's
    --moe-flip, --prefix-cache)."""
    if cfg.engine == "sglang":
        from sglang_engine import SGLangEngine  # SGLang is optional: imported only when asked for

        # Colocated on this rank's GPU: the engine gets a fixed share, the trainer the rest (the engine's
        # memory is released in sleep() during training, but its reservation is sized at start).
        gpu = (
            dict(base_gpu_id=device.index, mem_fraction_static=SGLANG_GPU_MEM_FRACTION) if device.type == "cuda" else {}
        )
        # --seed seeds SGLang's sampling stream (on CPU the only seed it honours; see sglang_engine's docstring).
        return SGLangEngine(
            path, dtype=cfg.engine_dtype, kv_cache_dtype=cfg.kv_cache_dtype, random_seed=cfg.seed, **gpu
        )
    return EmbeddedEngine(
        path,
        dtype=cfg.engine_dtype,
        kv_cache_dtype=cfg.kv_cache_dtype,
        device=device,
        moe_flip=cfg.moe_flip,
        prefix_cache=cfg.prefix_cache,
    )
