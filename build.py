"""The run's set-up: its records and the functions main() calls before the first step.

    run = setup(cfg)                                        # processes, mesh, the resolved plan, the folder's lock
    task, tok, model_path, inputs = load_task(run)          # the task, every data row and the model folder checked
    models, progress = build_models(run, model_path, task)  # policy, critic, reference, optimisers (or a resume's)
    gen = build_generation(run, models, task, tok)          # the engines (make_engine), sampling, the episode driver
    log = start_log(run, progress, gen, model_path, inputs) # the run log, and the "before RL" evaluation

The records: Run (fixed settings), Inputs (what the log records of the inputs), Models (the models and optimisers),
Progress (the loop's counters, the one record written as the run goes), Generation (engines, task, sampling). And
`save`, the checkpoint of a step.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

import moe
from agent import DEFAULT_MAX_TURNS, load_env, run_episodes
from checkpoint import (
    check_fresh_start,
    check_inputs,
    check_resume,
    input_fingerprints,
    latest_checkpoint,
    load_trainer_state,
    lock_run_dir,
    save_checkpoint,
    sha256_path,
)
from config import Config, Plan, check_model, resolve
from data.rewards import load_reward
from data.tasks import Task, get_task, prompt_keys, warmup_kind
from embedded_engine import EmbeddedEngine
from evaluation import evaluate
from forward import Forward, check_head
from lora import LoraSpec, add_lora, load_adapter
from parallel import Runtime, init_runtime, make_mesh, parallelize, print0
from rollout import Engine, Sampling, push_weights
from runlog import RunLog
from tools import ToolLimits, stop_ids, text_env
from value_model import PromptBaseline, build_critic, freeze_attention, load_critic, load_policy, read_critic_init

REPO = os.path.dirname(os.path.abspath(__file__))


# ----------------------------------------------------------------------------- the run's records


@dataclass(frozen=True)
class Run:
    """The run's fixed settings, resolved once by setup()."""

    cfg: Config
    rt: Runtime
    plan: Plan  # config.resolve: the per-rank sizes and the algorithm's properties
    dp_group: Any  # this rank's data-parallel process group (None in one process)
    tp_mesh: Any  # this replica's tensor-parallel mesh (None without a mesh)
    dp_rank: int
    fsdp: Any  # the data-parallel mesh when --fsdp shards over it, else None
    engine_rank: bool  # the first rank of each TP group holds the rollout engine
    ckpt: str | None  # the checkpoint this run resumes from
    option_changes: dict  # the options a resume changed, {name: [old, new]} (checkpoint.check_resume)
    group: int  # rows kept together in minibatches: a prompt's n samples (1 with compaction)
    share: bool  # a group's rows share one forward of their prompt (TrainBatch.shared)
    fwd: Forward  # how the trainer's forwards run (the sampling transform, bf16, routing replay)
    lock: Any  # the run folder's lock (rank 0), held until the process ends


@dataclass(frozen=True)
class Inputs:
    """What load_task recorded of the run's inputs, for the run log."""

    fingerprints: dict  # the input files' fingerprints (input_fingerprints)
    changes: dict  # the options and inputs a resume changed, {name: [old, new]}


@dataclass(frozen=True)
class Models:
    """The trained models and their optimisers."""

    policy: Any
    critic: Any  # the value model (Plan.critic), else None
    ref: Any  # the frozen initial policy with --kl, else None
    opts: dict  # "policy" (and "critic") AdamW
    path: str  # the folder the policy was loaded from (the engines load it too)
    baseline: PromptBaseline | None  # the per-prompt reward table (Plan.prompt_baseline; in the checkpoint)
    lora: dict  # {"policy" and/or "critic": lora.LoraSpec}: the models trained as LoRA adapters
    base: str  # with LoRA: the base model folder's sha256 (a LoRA checkpoint resumes only on it), else ""


@dataclass
class Progress:
    """The loop's counters, written as the run goes (and restored by a resume)."""

    start: int  # the step the run starts at (a resume's checkpoint step)
    saved_at: int  # the step of the newest checkpoint
    synced: int  # the updates in the rollout engine's weights (--sync-every: staleness = step - synced)
    bad: dict  # consecutive skipped updates per model (update.check_finite)
    fresh_head: bool  # a new critic: its head is set to the mean reward of the first batch


@dataclass(frozen=True)
class Generation:
    """How the run generates: its engines, the task and tokenizer, the sampling, and the row sizes that follow."""

    rollout_engine: Any  # on engine ranks; None on their TP peers
    eval_engine: Any  # the rollout engine, or an fp32 copy with --eval-dtype fp32
    task: Task
    tok: Any
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
    # resolved once: user code that changes the working folder (a reward's os.chdir) cannot move the run's records
    cfg = replace(cfg, out_dir=os.path.abspath(cfg.out_dir))
    lock = lock_run_dir(cfg.out_dir) if rt.rank == 0 else None
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True)
    mesh = make_mesh(rt, cfg.tp)
    tp_mesh = mesh["tp"] if mesh else None
    ckpt = latest_checkpoint(cfg.out_dir, cfg.algo)
    if ckpt:
        changes = check_resume(ckpt, rt.world_size, options=asdict(cfg), defaults=asdict(Config()))
    else:
        changes = check_fresh_start(cfg.out_dir, cfg.algo) or {}
    group = 1 if cfg.compact_at else plan.n
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
        option_changes=changes,
        group=group,
        share=cfg.shared_prefix and group > 1,
        fwd=Forward(cfg.temperature, cfg.top_k, cfg.top_p, cfg.train_dtype == "bf16", cfg.routing_replay),
        lock=lock,
    )


def load_task(run: Run) -> tuple[Task, Any, str, Inputs]:
    """(task, tokenizer, model folder, inputs). A bad task, data file or row fails here, and a resume's changed inputs
    (checkpoint.check_inputs), before any model is built; the default model is built (rank 0) on first use."""
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
        task.env = load_env(cfg.env)
        task.max_turns = DEFAULT_MAX_TURNS
    # A tool environment (TRL's form) is played as a text one: tools.ToolEpisode.
    limits = ToolLimits(calls_per_turn=cfg.tool_calls_per_turn, timeout=cfg.tool_timeout)
    source = f"--env {cfg.env}" if cfg.env else f"--task {cfg.task}"
    task.env = text_env(task, cfg.tool_parser, limits, cfg.max_turns or task.max_turns, source)
    fingerprints = input_fingerprints(
        task.train,
        task.test,
        model=cfg.model,
        task=cfg.task,
        eval_task=cfg.eval_task,
        reward=cfg.reward,
        env=cfg.env,
        critic_init=cfg.critic_init,
    )
    changes = dict(run.option_changes)
    if run.ckpt:
        accept = cfg.accept_changed_inputs
        changes.update(check_inputs(cfg.out_dir, fingerprints, run.option_changes, accept_changed_inputs=accept))
    model_path = cfg.model
    if not model_path:
        from data.tiny import default_model

        kind = warmup_kind(cfg.task)  # the built-in tasks have their own warm-up
        cache = os.path.join(REPO, ".cache")
        if run.rt.rank == 0:
            default_model(cache, task=kind, arch=cfg.tiny)  # the other ranks find it cached
        if dist.is_initialized():
            dist.barrier()
        model_path = default_model(cache, task=kind, arch=cfg.tiny)
    tok = check_model(cfg, model_path, task)
    if cfg.critic_init and not run.ckpt:  # a resume's critic is the checkpoint's
        check_critic_init(cfg, model_path)
    return task, tok, model_path, Inputs(fingerprints, changes)


def check_critic_init(cfg: Config, model_path: str) -> None:
    """--critic-init's record (value_model.CRITIC_INIT) must name this run's base model, by content, and its
    --critic-context: a critic fitted for another input would start from values of something else."""
    if not os.path.isdir(cfg.critic_init):
        raise ValueError(f"--critic-init {cfg.critic_init}: no such folder")
    record = read_critic_init(cfg.critic_init)
    errors = []
    if record.get("critic_context") != cfg.critic_context:
        errors.append(f"fitted with --critic-context {record.get('critic_context')}, this run has {cfg.critic_context}")
    if record.get("base_sha256") != sha256_path(model_path):
        errors.append(f"fitted on another base model than {model_path} (its sha256 differs)")
    if errors:
        raise ValueError(f"--critic-init {cfg.critic_init}: " + "; ".join(errors))


def build_models(run: Run, model_path: str, task: Task) -> tuple[Models, Progress]:
    """Policy, critic, frozen reference (--kl) and optimisers, sharded by the plan, and the loop's counters; restored
    from the checkpoint when resuming."""
    cfg, rt = run.cfg, run.rt
    specs = lora_specs(cfg)
    base = sha256_path(model_path) if specs else ""
    # a LoRA checkpoint holds the adapter only: the base model is loaded, the adapter restored on it
    path = os.path.join(run.ckpt, "policy") if run.ckpt and "policy" not in specs else model_path
    torch.manual_seed(cfg.seed)
    policy = load_policy(path, "the checkpoint" if path != model_path else "--model").to(rt.device)
    policy = moe.install(policy)  # MoE: record / replay routing
    if "policy" in specs:
        policy = add_lora(policy, specs["policy"])
        if run.ckpt:
            load_adapter(policy, os.path.join(run.ckpt, "policy"), specs["policy"], base)
    check_head(policy)  # on the plain model: a forward under FSDP would leave the root's weights gathered
    if run.share and policy.config._attn_implementation != "sdpa":
        raise ValueError(
            f"--shared-prefix needs SDPA attention (a boolean block mask); the model uses "
            f"{policy.config._attn_implementation!r}: pass --no-shared-prefix"
        )
    policy = parallelize(policy, run.tp_mesh, run.fsdp)
    trained = [p for p in policy.parameters() if p.requires_grad]
    opts = {"policy": torch.optim.AdamW(trained, lr=cfg.lr, weight_decay=0.0)}
    critic = ref = None
    if run.plan.critic:
        if run.ckpt and "critic" not in specs:
            critic = load_critic(os.path.join(run.ckpt, "critic"), torch.float32)
        elif cfg.critic_init:
            critic = load_critic(cfg.critic_init, torch.float32, "--critic-init")
        else:
            critic = build_critic(model_path, dtype=torch.float32)
        if "critic" in specs:
            critic = add_lora(critic, specs["critic"], train=("score.",))
            if run.ckpt:
                load_adapter(critic, os.path.join(run.ckpt, "critic"), specs["critic"], base)
        if cfg.freeze_critic_attention:
            freeze_attention(critic)
        critic = parallelize(critic.to(rt.device), run.tp_mesh, run.fsdp)
        trained = [p for p in critic.parameters() if p.requires_grad]
        opts["critic"] = torch.optim.AdamW(trained, lr=run.plan.critic_lr_used, weight_decay=0.0)
    if cfg.kl != "none":  # the frozen initial policy, also on resume
        ref = moe.install(load_policy(model_path).to(rt.device).requires_grad_(False))
        ref = parallelize(ref, run.tp_mesh, run.fsdp).eval()
    baseline = None
    if run.plan.prompt_baseline:
        baseline = PromptBaseline(cfg.baseline_window, keys=prompt_keys(task.train))
    progress = Progress(
        start=0, saved_at=0, synced=0, bad={k: 0 for k in opts}, fresh_head=critic is not None and not cfg.critic_init
    )
    if run.ckpt:
        state = load_trainer_state(run.ckpt, rt.rank, rt.world_size, opts)
        if baseline is not None:
            if state.get("baseline_keys") != PromptBaseline.KEYS:  # older: keyed by row; resuming changes the run
                raise ValueError(
                    f"{run.ckpt}: its --algo reinforce baseline is keyed by train row, not prompt: use a new --out-dir"
                )
            baseline = PromptBaseline(cfg.baseline_window, state["baseline"], baseline.keys)
        # The engine loads the checkpoint's weights: a re-sync.
        progress = Progress(state["step"], state["step"], state["step"], state["bad_steps"], fresh_head=False)
        if progress.start % cfg.sync_every:  # a SIGTERM's checkpoint between syncs (rollout/staleness; docs/engines.md)
            print0(
                f"resume: the engine starts from step {progress.start}'s weights, fresher than an uninterrupted "
                f"--sync-every {cfg.sync_every} run's"
            )
        for k, lr in (("policy", cfg.lr), ("critic", run.plan.critic_lr_used)):  # a changed --lr / --critic-lr applies
            for group in opts[k].param_groups if k in opts else []:
                group["lr"] = lr
    return Models(policy, critic, ref, opts, path, baseline, specs, base), progress


def lora_specs(cfg: Config) -> dict[str, LoraSpec]:
    """The LoRA settings of the models trained as adapters (--lora-*, --critic-lora-*)."""
    specs = {}
    if cfg.lora_rank:
        specs["policy"] = LoraSpec(cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target)
    if cfg.critic_lora_rank:  # config.check_lora: only with a critic
        specs["critic"] = LoraSpec(
            cfg.critic_lora_rank, cfg.critic_lora_alpha, cfg.critic_lora_dropout, cfg.critic_lora_target
        )
    return specs


def build_generation(run: Run, models: Models, task: Task, tok) -> Generation:
    """The rollout engine (engine ranks), the evaluation engine, the sampling settings and the multi-turn driver."""
    cfg, device = run.cfg, run.rt.device
    engine = make_engine(cfg, models.path, device) if run.engine_rank else None
    eval_engine = engine
    if cfg.eval_dtype == "fp32":
        eval_engine = EmbeddedEngine(models.path, dtype="fp32", device=device) if run.engine_rank else None
    if run.ckpt and "policy" in models.lora:  # the engines loaded the base: they get the checkpoint's merged weights
        for e in {id(e): e for e in (engine, eval_engine) if e is not None}.values():
            push_weights(models.policy, e)
    sampling = Sampling(
        cfg.temperature,
        cfg.top_k,
        cfg.top_p,
        cfg.max_new_tokens or task.max_new_tokens,
        stop_ids(tok, task.env),
        run.plan.n,
        cfg.seed,
    )
    budget = sampling.max_new_tokens
    if task.env is None:
        return Generation(engine, eval_engine, task, tok, sampling, None, budget, budget)
    turns = cfg.max_turns or task.max_turns
    context = models.policy.config.max_position_embeddings

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

    return Generation(engine, eval_engine, task, tok, sampling, play, (turns + 1) * budget, context)


def start_log(run: Run, progress: Progress, gen: Generation, model_path: str, inputs: Inputs) -> RunLog:
    """The run log (a fresh run drops whatever an earlier, killed attempt logged) and, on a fresh run, the "before RL"
    evaluation."""
    cfg, plan = run.cfg, run.plan
    log = RunLog(
        cfg.out_dir,
        run.rt.rank,
        {**asdict(cfg), **record(plan), "model_path": model_path},
        progress.start if run.ckpt else -1,
        cfg.report_to == "wandb",
        cfg.report_to == "tensorboard",
        inputs.changes,
        inputs.fingerprints,
    )
    how = f"resuming at step {progress.start}" if run.ckpt else "starting"
    print0(
        f"{how}: {cfg.algo} + {cfg.correction}, model {model_path}, world {run.rt.world_size} (dp {plan.dp} x tp "
        f"{cfg.tp}), {cfg.rollout_batch} completions/step, run folder {cfg.out_dir}"
    )
    if run.ckpt is None:
        before, records = evaluate_policy(run, gen)
        log.log({"step": 0, **before})
        log.samples(0, records)
        print0(
            f"before RL: greedy accuracy {before['eval/greedy_acc']:.1%}, sampled {before['eval/sampled_acc']:.1%} "
            f"on {min(cfg.eval_size, len(gen.task.test))} held-out problems"
        )
    log.start_progress(cfg.steps, progress.start)
    return log


def record(plan: Plan) -> dict:
    """The plan's sizes, as config.json records them beside the options (its properties follow from --algo)."""
    return {
        "dp": plan.dp,
        "n": plan.n,
        "rows": plan.rows,
        "prompts": plan.prompts,
        "critic_lr_used": plan.critic_lr_used,
    }


def evaluate_policy(run: Run, gen: Generation) -> tuple[dict, list[dict]]:
    """evaluation.evaluate with the run's --eval-size and --eval-samples on the evaluation engine."""
    return evaluate(
        gen.eval_engine,
        gen.tok,
        gen.task,
        gen.sampling,
        size=run.cfg.eval_size,
        samples=run.cfg.eval_samples,
        dp_rank=run.dp_rank,
        dp=run.plan.dp,
        play=gen.play,
    )


def save(run: Run, models: Models, progress: Progress, tok, step: int) -> None:
    """The checkpoint of `step` (checkpoint.save_checkpoint): the models, optimisers and the loop's counters."""
    extra = {"bad_steps": dict(progress.bad), "tp": run.cfg.tp}
    if models.baseline is not None:
        extra.update(baseline=models.baseline.table, baseline_keys=PromptBaseline.KEYS)
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
        extra=extra,
        lora=models.lora,
        base=models.base,
    )
    progress.saved_at = step


# ----------------------------------------------------------------------------- engines

# Share of each GPU that SGLang reserves for weights + KV cache when colocated with the trainer.
SGLANG_GPU_MEM_FRACTION = 0.4


def make_engine(cfg: Config, path: str, device: torch.device) -> Engine:
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
