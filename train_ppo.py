"""IcePop PPO with a trained value model (the GLM-5.2 recipe): one torchrun job, engine and trainer colocated.

    make train                                                   # = bash runs/cpu.sh: tiny model, 2 CPU processes
    torchrun --standalone --nproc_per_node 2 train_ppo.py        # the same by hand (dp=2)
    torchrun --standalone --nproc_per_node 2 train_ppo.py --tp 2 # policy and critic sharded over 2 ranks
    bash runs/gpu_qwen3.sh                                       # a real HF model with SGLang on GPUs
    python train_ppo.py --help                                   # every option, from the Config docstrings

Every rank holds a shard of the policy and the critic; the first rank of each TP group also holds a
rollout engine (embedded torch sampler or SGLang) that generates that data-parallel replica's share.
main() reads as the run: set up, load the task, build the models and engines, start the log, pretrain the
critic, then train_step and finish_step per step. train_step calls the phases in order, and what occupies
each device's memory during each (colocated: the phases take turns):

    phase                                engine (weights + KV cache)   policy / critic / optimiser states
    rollout_phase (and vine_phase)       awake, generating             resident, idle
    score_batch ... correction           asleep (released)             forward activations (no grad)
    update_critic, update_policy         asleep                        activations + gradients
    sync_weights                         wake, then full weights pushed bucket by bucket, cache flushed
    finish_step (metrics / eval / ckpt)  awake (eval generates)        resident

The order sleep -> train -> wake -> sync is written once: rollout_phase (--algo vine: vine_phase) sleeps the engine,
sync_weights wakes it.
"""

from __future__ import annotations

import functools
import math
import os
import resource
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from tqdm import tqdm

import losses
import moe
import vine
from agent import DEFAULT_MAX_TURNS, Episodes, episode_metrics, load_env, run_episodes
from config import Config, check_model, resolve
from data.rewards import load_reward
from data.tasks import get_task, prompt_indices, prompt_keys
from evaluation import evaluate, rollouts, scored
from forward import (
    check_finite,
    check_head,
    context_ids,
    critic_batch,
    denominator,
    micro,
    minibatches,
    optimizer_step,
    response_logprobs,
    response_values,
)
from parallel import PREEMPTION, Runtime, all_reduce, init_runtime, make_mesh, parallelize, print0, tp_share
from rollout import EmbeddedEngine, Rollout, Sampling, TrainBatch, make_engine, push_weights, sync_weights
from runlog import (
    Metrics,
    RunLog,
    check_fresh_start,
    check_inputs,
    check_resume,
    input_fingerprints,
    latest_checkpoint,
    load_trainer_state,
    lock_run_dir,
    save_checkpoint,
    timed,
)
from tools import stop_ids, text_env
from value_model import (
    PLATEAU_WINDOW,
    PromptBaseline,
    build_critic,
    ev_plateaued,
    finite_mean,
    freeze_attention,
    load_critic,
    load_policy,
    set_head_to_mean,
)

REPO = os.path.dirname(os.path.abspath(__file__))


# ----------------------------------------------------------------------------- the loop


def main(cfg: Config) -> list[dict]:
    """Run (or resume) training; returns the metrics history (rank 0; other ranks get an empty list)."""
    run = setup(cfg)
    task, tok, model_path = load_task(run)
    models = build_models(run, model_path, task)
    engines = build_engines(run, models, task, tok)
    log = start_log(run, models, engines, task, tok, model_path)
    if models.fresh_head and run.cfg.critic_pretrain > 0:
        pretrain_critic(run, models, engines, task, tok, log)
    PREEMPTION.armed = True  # from here a SIGTERM saves at the next step boundary (parallel.Preemption)
    for step in range(models.start, run.cfg.steps):
        m = train_step(run, models, engines, task, tok, index=step, train_policy=True)
        if finish_step(run, models, engines, task, tok, log, step, m):
            break  # stopped on SIGTERM, after a checkpoint
    return shutdown(run, engines, log)


def train_step(run: Run, models: Models, engines: Engines, task, tok, *, index: int, train_policy: bool) -> Metrics:
    """One batch through the phases. index: the batch's place in the data and sampling streams (the step; critic
    pretraining's batches are -1, -2, ...). train_policy=False: only the critic learns (no value clipping, no sync)."""
    m, start, cfg = Metrics(), time.perf_counter(), run.cfg
    where = f"step {index + 1}" if train_policy else f"critic pretraining step {-index}"
    with timed(m, "rollout"):
        rows, out = rollout_phase(run, engines, task, tok, index)
    m.add(
        {"rollout/staleness": float(index - models.synced if train_policy else 0)}
    )  # updates the rollouts' weights lag
    mc = vine_phase(run, engines, task, tok, rows, out, index, m) if cfg.algo == "vine" else None
    with timed(m, "reward"):
        batch = score_batch(run, engines, task, tok, rows, out, m)._replace(vine=mc)
    if models.fresh_head:
        set_head_to_mean(models.critic, *all_reduce(batch.reward_sum_count(), run.dp_group))
        models.fresh_head = False
    with timed(m, "recompute"), torch.no_grad():
        old = recompute(run, models, batch, m)
    with timed(m, "advantages"):
        adv, returns = advantages(run, models, batch, old, task, index, m)
    with timed(m, "correction"):
        is_w, loss_mask = correction(run, batch, old, m)
    if models.critic is not None:
        with timed(m, "critic"):
            clip = (cfg.value_clip or None) if train_policy else None  # pretraining: the first values are the head's
            update_critic(run, models, batch, old, returns, index, clip, where, m)
    if train_policy:
        with timed(m, "policy"):
            update_policy(run, models, batch, old, adv, is_w, loss_mask, index, where, m)
    with timed(m, "sync"):  # the engine gets the weights after every --sync-every-th update, and the last
        sync = train_policy and ((index + 1) % cfg.sync_every == 0 or index + 1 == cfg.steps)
        models.synced = index + 1 if sync else models.synced
        sync_weights(models.policy, engines.rollout, changed=sync)
    m.add(step_metrics(run, batch, m, time.perf_counter() - start))
    return m


def pretrain_critic(run: Run, models: Models, engines: Engines, task, tok, log: RunLog) -> None:
    """Critic pretraining (VC-PPO, VAPO): critic-only steps on the frozen start policy before step 1 until the explained
    variance plateaus (ev_plateaued) or --critic-pretrain steps, then the step-0 checkpoint. Its batches draw their own
    prompts and seeds (the RL steps see the same data either way); a kill before it ends redoes it."""
    cap, evs = run.cfg.critic_pretrain, []
    for pre in range(1, cap + 1):
        m = train_step(run, models, engines, task, tok, index=-pre, train_policy=False)
        row = {"step": 0, "pretrain/step": pre, **m.reduce()}
        evs.append(row["critic/explained_variance"])
        row["pretrain/done"] = float((plateau := ev_plateaued(evs)) or pre == cap)
        log.log(row)
        ev_window = finite_mean(evs[-PLATEAU_WINDOW:])
        if run.rt.rank == 0 and (pre % 10 == 0 or row["pretrain/done"]):
            tqdm.write(
                f"critic pretraining {pre:3d} | vloss {row['critic/value_loss']:.4f} | ev {evs[-1]:.2f} | ev last {PLATEAU_WINDOW} {ev_window:.3f}"
            )
        if plateau:
            break
    print0(
        f"critic pretraining stopped after {pre} steps ({'plateau' if plateau else 'step cap --critic-pretrain'}): "
        f"mean explained variance of the last {PLATEAU_WINDOW} steps {ev_window:.3f}"
    )
    save(run, models, tok, 0)


def finish_step(run: Run, models: Models, engines: Engines, task, tok, log: RunLog, step: int, m: Metrics) -> bool:
    """Reduce the step's metrics, evaluate when due, log, plot, checkpoint; on a SIGTERM (any rank's) checkpoint and
    return True: the run stops."""
    cfg, last = run.cfg, step + 1 == run.cfg.steps
    row, records = {"step": step + 1, **m.reduce()}, None
    if (step + 1) % cfg.eval_every == 0 or last:
        if cfg.eval_dtype == "fp32":  # the fp32 copy gets the new weights only when it is used
            push_weights(models.policy, engines.eval)
        metrics, records = evaluate(
            engines.eval, tok, task, cfg, engines.sampling, run.dp_rank, run.plan["dp"], engines.play
        )
        row.update(metrics)
    log.log(row)
    if records is not None:
        log.samples(step + 1, records)
    log.progress(row)
    if run.rt.rank == 0:
        tqdm.write(
            f"step {step + 1:4d} | reward {row['rollout/reward_mean']:.3f} | len {row['rollout/response_len_mean']:.1f}"
            f" | masked {row['mismatch/masked_frac']:.3%} | k3 {row['mismatch/k3']:.2e}"
            + (
                f" | vloss {row['critic/value_loss']:.4f} | ev {row['critic/explained_variance']:.2f}"
                if models.critic is not None
                else ""
            )
            + (f" | greedy acc {row['eval/greedy_acc']:.1%}" if records is not None else "")
            + f" | {row['time/step']:.2f}s"
        )
    if records is not None or last:
        log.plot()
    due = (step + 1) // cfg.save_every > models.saved_at // cfg.save_every  # a multiple of --save-every passed since
    stop = PREEMPTION.agreed(run.rt.device) and not last
    if last or (
        (due or stop) and not any(models.bad.values())
    ):  # never mid-streak of skipped updates: see check_finite
        save(run, models, tok, step + 1)
    if stop:
        PREEMPTION.stopped = True
        print0(
            f"SIGTERM: stopping after step {step + 1}, checkpoint {os.path.join(cfg.out_dir, 'checkpoints', f'step_{models.saved_at:06d}')}"
            " (exit code 143); rerun the same command to resume"
        )
    return stop


def shutdown(run: Run, engines: Engines, log: RunLog) -> list[dict]:
    log.close()
    if run.rt.rank == 0 and log.history:
        first, final = log.history[0], log.history[-1]
        if "eval/greedy_acc" in first and "eval/greedy_acc" in final:
            print(
                f"after RL ({run.cfg.steps} steps): greedy accuracy {first['eval/greedy_acc']:.1%} -> {final['eval/greedy_acc']:.1%}, "
                f"sampled {first['eval/sampled_acc']:.1%} -> {final['eval/sampled_acc']:.1%}"
            )
    for e in {id(x): x for x in (engines.rollout, engines.eval) if x is not None}.values():
        e.shutdown()
    return log.history


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


class Batch(NamedTuple):
    """One step's scored rollouts on the trainer's device. B rows, T response columns."""

    out: Any  # the engine's Rollout, or agent.Episodes
    ro: Rollout  # the training rows (out.rollout for episodes)
    tb: TrainBatch  # the trainer's forward inputs
    ctb: TrainBatch  # the critic's: tb itself, or with --critic-context its prefix before each prompt (forward.critic_batch)
    tokens: torch.Tensor  # [B, T] response tokens
    gen_mask: torch.Tensor  # [B, T] every model token (mismatch metrics); observations excluded
    mask: torch.Tensor  # [B, T] the model tokens of rows kept for training (every loss, whitening, denominator)
    infer_logp: torch.Tensor  # [B, T] the engine's log-probs
    scores: torch.Tensor  # [B] each row's reward (multi-turn: its episode's return)
    rewarded: torch.Tensor  # [B] bool: the row has a reward
    keep_rows: torch.Tensor  # [B] bool: rewarded, and for GRPO in a group with >= 2 rewarded rows
    token_rewards: torch.Tensor  # [B, T] the reward on the last model token (of each turn)
    fed: torch.Tensor  # real tokens one trainer pass computes (a shared prompt once per group)
    max_len: int  # Engines.max_len
    width: int  # Engines.width
    vine: Any = None  # vine.Values of the rows (--algo vine)

    def reward_sum_count(self) -> torch.Tensor:
        return torch.stack([self.scores[self.rewarded].sum(), self.rewarded.sum().float()])


class Old(NamedTuple):
    """The recompute at the rollout weights, [B, T] each."""

    logp: torch.Tensor  # pi_old
    ref_logp: torch.Tensor | None  # pi_ref (with --kl)
    values: torch.Tensor | None  # V_old (PPO)


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


# ----------------------------------------------------------------------------- the phases of a step


def batch_prompts(run: Run, n_train: int, index: int) -> list[int]:
    """This replica's train rows of batch `index` (its share of the data stream, data.tasks.prompt_indices)."""
    return prompt_indices(
        run.cfg.seed, n_train, (index * run.plan["dp"] + run.dp_rank) * run.plan["prompts"], run.plan["prompts"]
    )


def rollout_sampling(run: Run, engines: Engines, index: int) -> Sampling:
    """This replica's sampling of batch `index`: row (episode) r draws from seed + r, so no dp split changes the batch."""
    return replace(
        engines.sampling,
        seed=(run.cfg.seed * 1_000_003 + index * run.cfg.rollout_batch + run.dp_rank * run.plan["rows"]) % 2**31,
    )


def rollout_phase(run: Run, engines: Engines, task, tok, index: int):
    """This replica's prompts of batch `index`, generated by its engine rank and shared with its TP peers; the engine
    sleeps after (with --algo vine after vine_phase). Returns (task rows, Rollout or agent.Episodes)."""
    cfg = run.cfg
    rows, out = task.train.select(batch_prompts(run, len(task.train), index)), None
    if engines.rollout is not None:
        play = functools.partial(engines.play, snapshots=True) if engines.play and cfg.algo == "vine" else engines.play
        out = rollouts(engines.rollout, tok, rows, rollout_sampling(run, engines, index), play)
        if cfg.algo != "vine":
            engines.rollout.sleep()
    shared = tp_share(
        replace(out, starts=[]) if isinstance(out, Episodes) else out, run.tp_mesh
    )  # snapshots: engine rank only
    return rows, shared if out is None else out


def vine_phase(run: Run, engines: Engines, task, tok, rows, out, index: int, m: Metrics) -> vine.Values:
    """--algo vine (time/vine): the Monte Carlo values of this replica's rows (vine.mc_values) from the engine, still
    awake after the rollout; then it sleeps. Logs the continuations' tokens, summed over dp ranks and per rollout token."""
    mc = None
    with timed(m, "vine"):
        if engines.rollout is not None:
            mc = vine.mc_values(
                engines.rollout,
                tok,
                task,
                rows,
                out,
                rollout_sampling(run, engines, index),
                k=run.cfg.vine_k,
                every=run.cfg.vine_every,
                play=engines.play,
            )
            engines.rollout.sleep()
        mc = tp_share(mc, run.tp_mesh)
    m.add({"vine/extra_tokens": mc.extra_tokens * run.plan["dp"]})  # the mean over ranks, times dp: the sum over dp
    m.add_ratio("vine/extra_token_ratio", mc.extra_tokens, (out.rollout if engines.play else out).mask.sum())
    return mc


def score_batch(run: Run, engines: Engines, task, tok, rows, out, m: Metrics) -> Batch:
    """The outcome reward on the last model token (multi-turn: each turn's reward on the turn's last model token), and
    the batch on the trainer's device. A row without a reward (None) leaves training: its tokens leave `mask` (every
    loss, the whitening and the denominators); in GRPO so do the groups with fewer than 2 rewarded rows (no baseline).
    gen_mask keeps every model token (mismatch metrics); observation tokens are in neither."""
    cfg, n, dev = run.cfg, run.plan["n"], run.rt.device
    _, sc = scored(task, tok, rows, n, out, engines.play)  # multi-turn: per episode (metrics); rows get its return
    ro = out.rollout if engines.play else out
    if engines.play:
        scores, token_rewards = out.returns[out.episode], out.rewards
        rewarded = torch.ones(len(scores), dtype=torch.bool, device=dev)
    else:
        scores, rewarded = sc.rewards, sc.rewarded.to(dev)
        token_rewards = losses.last_token_rewards(scores, ro.mask)
    tb = ro.to_batch(tok.pad_token_id)
    # Real tokens one trainer pass over the batch computes (a shared prompt once per group): bench/ turns it into FLOPs.
    fed = tb.attention_mask.sum() - (
        tb.attention_mask[:, : tb.response_start].sum() * (run.group - 1) // run.group if run.share else 0
    )

    def on_dev(b):
        return type(b)(*(x.to(dev) if torch.is_tensor(x) else x for x in b))

    tb = on_dev(tb.shared(run.group) if run.share else tb)  # shared: one forward of each prompt for its n samples
    ctb = (
        tb
        if cfg.critic_context == "policy"
        else on_dev(
            critic_batch(
                ro, context_ids(cfg.critic_context, tok, rows, out, n), tok.pad_token_id, run.group if run.share else 1
            )
        )
    )
    gen_mask, keep_rows = ro.mask.to(dev), rewarded
    if cfg.algo == "grpo":
        keep_rows = rewarded & (rewarded.view(-1, n).sum(-1, keepdim=True) >= 2).expand(-1, n).reshape(-1)
    m.add_ratio("rollout/reward_mean", sc.rewards[sc.rewarded].sum(), sc.rewarded.sum())
    m.add_ratio("rollout/no_reward_frac", (~sc.rewarded).sum(), len(sc.rewarded))
    for (
        extra
    ) in sc.extras:  # reward/<key>: each numeric extra key of the reward's dicts, over the samples that return it
        for k, v in extra.items():
            if k != "pred" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                m.add_ratio(f"reward/{k}", v, 1)
    return Batch(
        out,
        ro,
        tb,
        ctb,
        ro.tokens.to(dev),
        gen_mask,
        gen_mask & keep_rows[:, None],
        ro.infer_logp.to(dev),
        scores.to(dev),
        rewarded,
        keep_rows,
        token_rewards.to(dev),
        fed,
        engines.max_len,
        engines.width,
    )


def recompute(run: Run, models: Models, batch: Batch, m: Metrics) -> Old:
    """pi_old, pi_ref and V_old at the rollout weights, micro-batch by micro-batch (called under no_grad)."""
    chunks = micro(torch.arange(len(batch.tokens)), run.cfg, run.group)
    logp = []
    for r in chunks:
        logp.append(response_logprobs(models.policy, batch.tb, r, batch.tokens, run.cfg)[0])
        if batch.tb.routing is not None:  # MoE: how often the trainer's routers pick other experts than the engine's
            m.add(moe.batch_flips(models.policy, batch.tb, r, batch.gen_mask))
    ref_logp = (
        torch.cat([response_logprobs(models.ref, batch.tb, r, batch.tokens, run.cfg)[0] for r in chunks])
        if models.ref is not None
        else None
    )
    values = (
        torch.cat([response_values(models.critic, batch.ctb, r, run.cfg) for r in chunks])
        if models.critic is not None
        else None
    )
    return Old(torch.cat(logp), ref_logp, values)


def advantages(
    run: Run, models: Models, batch: Batch, old: Old, task, index: int, m: Metrics
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(advantages, returns): PPO's token-level GAE (lambda_policy, or length-adaptive) with GAE(lambda_critic) returns as
    the critic's targets; GRPO's group-relative advantages; vine's Monte Carlo value differences; reinforce's reward
    minus its prompt's running mean (value_model.PromptBaseline; rows with the same prompt share it). All but GRPO's are
    whitened over the global batch with --whiten-advantages; only PPO has returns."""
    cfg, mask = run.cfg, batch.mask
    rewards, returns = batch.token_rewards, None
    if cfg.kl == "k1-reward":
        rewards = rewards - cfg.kl_coef * losses.kl_estimate(old.logp, old.ref_logp, "k1") * mask
    if cfg.algo == "grpo":
        return losses.grpo_advantages((rewards * mask).sum(-1), run.plan["n"], cfg.grpo_std, valid=batch.rewarded)[
            :, None
        ] * mask, None
    if cfg.algo == "vine":  # VinePPO: Monte Carlo values at the states, no critic
        adv = losses.vine_advantages(
            batch.vine.values.to(mask.device), batch.vine.states.to(mask.device), rewards, mask
        )
    elif cfg.algo == "reinforce":
        plan, dev = run.plan, mask.device
        sample = torch.tensor(
            batch.out.episode if isinstance(batch.out, Episodes) else range(len(batch.tokens)), device=dev
        )
        prompts = torch.tensor(
            [models.baseline.keys[i] for i in batch_prompts(run, len(task.train), index)], device=dev
        )[sample // plan["n"]]
        adv, had = models.baseline.advantages(
            prompts, sample, batch.scores, batch.rewarded, plan["rows"], run.dp_rank, plan["dp"], run.dp_group
        )
        m.add_ratio(
            "reinforce/history_frac", had[batch.rewarded].sum(), batch.rewarded.sum()
        )  # rows whose prompt had earlier rewards
        adv = adv[:, None] * mask
    else:
        _, returns = losses.gae(rewards, old.values, mask, cfg.gamma, cfg.lam_critic)
        lam = (
            losses.length_adaptive_lambda(batch.gen_mask.sum(-1), cfg.adaptive_lambda)
            if cfg.adaptive_lambda > 0
            else cfg.lam_policy
        )
        adv, _ = losses.gae(rewards, old.values, mask, cfg.gamma, lam)
    if cfg.whiten_advantages:  # the statistics all-reduced over dp ranks (whitening over the global batch)
        adv = losses.whiten(adv, mask, all_reduce(losses.whiten_stats(adv, mask), run.dp_group))
    return adv, returns


def correction(run: Run, batch: Batch, old: Old, m: Metrics) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(importance weights or None, the policy loss's mask): IcePop's M(k) (or TIS / the geometric sequence mask) on
    k = pi_old / pi_infer; DIS acts inside its loss. Dropped tokens stay in the denominator (IcePop paper) unless
    --drop-masked-from-denominator (verl's form)."""
    cfg, mask = run.cfg, batch.mask
    m.add(losses.mismatch_metrics(old.logp, batch.infer_logp, batch.gen_mask, cfg.icepop_low, cfg.icepop_high))
    is_w, cm = None, {}
    if cfg.correction == "icepop":
        is_w, cm = losses.icepop_weights(old.logp, batch.infer_logp, mask, cfg.icepop_low, cfg.icepop_high)
    elif cfg.correction == "tis":
        is_w, cm = losses.tis_weights(old.logp, batch.infer_logp, mask, cap=cfg.tis_cap)
    elif cfg.correction == "geo":
        is_w, cm = losses.geo_seq_mask(old.logp, batch.infer_logp, mask, cfg.icepop_low, cfg.icepop_high)
    m.add(cm)
    return is_w, mask & (is_w > 0) if is_w is not None and cfg.drop_masked_from_denominator else mask


def update_critic(
    run: Run, models: Models, batch: Batch, old: Old, returns, index: int, clip: float | None, where: str, m: Metrics
) -> None:
    """--critic-updates passes of the clipped value loss towards the returns, global token denominator per minibatch;
    logs the explained variance of the values before this update (out of sample for this batch)."""
    cfg, mask = run.cfg, batch.mask
    for k in range(cfg.critic_updates):
        for mb in minibatches(len(batch.tokens), cfg, index, 1000 + k, run.group):
            denom = denominator(mask[mb], batch.keep_rows[mb], cfg, batch.max_len, run.dp_group)
            for r in micro(mb, cfg, run.group):
                loss, vm = losses.value_loss(
                    response_values(models.critic, batch.ctb, r, cfg),
                    old.values[r],
                    returns[r],
                    mask[r],
                    clip=clip,
                    scale=cfg.value_scale,
                    agg=cfg.agg,
                    num_tokens=denom,
                )
                loss.backward()
                m.add(vm)
            norm, ok, weights_ok = optimizer_step(models.critic, models.opts["critic"], cfg, run.dp_group)
            check_finite(ok, weights_ok, models.bad, "critic", where, norm, cfg)
            m.add({"critic/grad_norm": norm, "train/skipped_critic_update": float(not ok)})
    m.add_ev(
        {
            "critic/explained_variance": losses.ev_stats(old.values, returns, mask),
            **losses.ev_stats_by_position(old.values, returns, mask, batch.width),
        }
    )


def update_policy(
    run: Run, models: Models, batch: Batch, old: Old, adv, is_w, loss_mask, index: int, where: str, m: Metrics
) -> None:
    """--ppo-epochs passes of PPO-clip (or DIS) with the correction's weights, global token denominator per minibatch,
    plus the k3 KL loss with --kl k3-loss."""
    cfg = run.cfg
    for epoch in range(cfg.ppo_epochs):
        for mb in minibatches(len(batch.tokens), cfg, index, epoch, run.group):
            denom = denominator(loss_mask[mb], batch.keep_rows[mb], cfg, batch.max_len, run.dp_group)
            for r in micro(mb, cfg, run.group):
                logp, ent = response_logprobs(models.policy, batch.tb, r, batch.tokens, cfg, entropy=True)
                if cfg.correction == "dis":
                    loss, pm = losses.dis_policy_loss(
                        logp,
                        batch.infer_logp[r],
                        adv[r],
                        loss_mask[r],
                        eps_low=cfg.clip_low,
                        eps_high=cfg.clip_high,
                        agg=cfg.agg,
                        num_tokens=denom,
                    )
                else:
                    loss, pm = losses.ppo_policy_loss(
                        logp,
                        old.logp[r],
                        adv[r],
                        loss_mask[r],
                        clip_low=cfg.clip_low,
                        clip_high=cfg.clip_high,
                        dual_clip=cfg.dual_clip or None,
                        is_weights=None if is_w is None else is_w[r],
                        agg=cfg.agg,
                        num_tokens=denom,
                    )
                if cfg.kl == "k3-loss":
                    kl = losses.aggregate(losses.kl_estimate(logp, old.ref_logp[r], "k3"), loss_mask[r], cfg.agg, denom)
                    loss, pm["ppo/kl_ref"] = loss + cfg.kl_coef * kl, kl.detach()
                loss.backward()
                m.add(pm)
                # Token-weighted over the step: a micro-batch without a kept token adds nothing (its own mean is 0/0).
                m.add_ratio("ppo/entropy", (ent.detach() * batch.mask[r]).sum(), batch.mask[r].sum())
            norm, ok, weights_ok = optimizer_step(models.policy, models.opts["policy"], cfg, run.dp_group)
            check_finite(ok, weights_ok, models.bad, "policy", where, norm, cfg)
            m.add({"ppo/grad_norm": norm, "train/skipped_update": float(not ok)})


def step_metrics(run: Run, batch: Batch, m: Metrics, seconds: float) -> dict:
    """The rollout's sizes and speed, the step's time and peak memory; --algo vine's EV statistics go to m.add_ev."""
    dp, lengths, ro = run.plan["dp"], batch.gen_mask.sum(-1), batch.ro
    out = {
        "rollout/response_len_mean": lengths.float().mean(),
        "rollout/response_len_max": lengths.max().float(),
        "rollout/tokens_per_s": lengths.sum() * dp / float(m.values["time/rollout"][0]),  # dp engines run at once
        "rollout/truncated_frac": sum(f in ("length", "turn_length") for f in ro.finish_reasons)
        / len(ro.finish_reasons),
        "train/tokens_per_pass": batch.fed.float() * dp,
        "train/response_tokens": lengths.sum().float() * dp,  # dp ranks' sum: mean x dp
        "time/step": seconds,
        **(episode_metrics(batch.out) if isinstance(batch.out, Episodes) else {}),
    }
    if batch.vine is not None:
        m.add_ev(vine.ev_stats(batch.vine, batch.token_rewards, batch.mask, batch.width))
    if run.cfg.algo == "grpo":  # groups whose n rewards are all equal carry no GRPO signal
        groups = batch.scores.view(-1, run.plan["n"])
        out["grpo/identical_reward_frac"] = (groups.amax(-1) == groups.amin(-1)).float().mean()
    peaks = [
        float(v[0]) for k, v in m.values.items() if k.startswith("mem/")
    ]  # CUDA: the largest phase peak; CPU: peak RSS (KiB)
    out["mem/peak_gib_max"] = max(peaks) if peaks else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return out


if __name__ == "__main__":
    import tyro

    PREEMPTION.install()
    main(tyro.cli(Config))
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(143 if PREEMPTION.stopped else 0)
