"""IcePop PPO with a trained value model (the GLM-5.2 recipe): one torchrun job, engine and trainer colocated.

    make train                                                   # = bash runs/cpu.sh: tiny model, 2 CPU processes
    torchrun --standalone --nproc_per_node 2 train_ppo.py        # the same by hand (dp=2)
    torchrun --standalone --nproc_per_node 2 train_ppo.py --tp 2 # policy and critic sharded over 2 ranks
    bash runs/gpu_qwen3.sh                                       # a real HF model with SGLang on GPUs
    python train_ppo.py --help                                   # every option, from the Config docstrings

Every rank holds a shard of the policy and the critic; the first rank of each TP group also holds a
rollout engine (embedded torch sampler or SGLang) that generates that data-parallel replica's share.
main() reads as the run: set up, load the task, build the models and engines (build.py), start the log, pretrain
the critic, then train_step and finish_step per step. train_step calls the phases in order; only advantages()
names the algorithm (the others read the plan's properties: a critic, grouped rows, Monte Carlo values). What
occupies each device's memory during each phase (colocated: the phases take turns):

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
from dataclasses import replace
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from tqdm import tqdm

import losses
import moe
import vine
from agent import Episodes, episode_metrics
from build import (
    Generation,
    Models,
    Progress,
    Run,
    build_generation,
    build_models,
    evaluate_policy,
    load_task,
    save,
    setup,
    start_log,
)
from checkpoint import latest_checkpoint
from config import Config
from data.tasks import prompt_indices
from evaluation import rollouts, scored
from forward import response_logprobs, response_values
from parallel import PREEMPTION, all_reduce, print0, tp_share
from rollout import Rollout, Sampling, TrainBatch, push_weights, sync_weights
from runlog import Metrics, RunLog, timed, write_token_records
from update import check_finite, denominator, micro, minibatches, optimizer_step
from value_model import (
    PLATEAU_WINDOW,
    PromptBaseline,
    context_ids,
    critic_batch,
    ev_plateaued,
    finite_mean,
    set_head_to_mean,
)


# ----------------------------------------------------------------------------- the loop


def main(cfg: Config) -> list[dict]:
    """Run (or resume) training; returns the metrics history (rank 0; other ranks get an empty list)."""
    run = setup(cfg)
    task, tok, model_path, inputs = load_task(run)
    models, progress = build_models(run, model_path, task)
    gen = build_generation(run, models, task, tok)
    log = start_log(run, progress, gen, model_path, inputs)
    if progress.fresh_head and cfg.critic_pretrain > 0:
        pretrain_critic(run, models, progress, gen, log)
    PREEMPTION.armed = True  # from here a SIGTERM saves at the next step boundary (parallel.Preemption)
    for step in range(progress.start, cfg.steps):
        m = train_step(run, models, progress, gen, index=step, train_policy=True)
        if finish_step(run, models, progress, gen, log, step, m):
            break  # stopped on SIGTERM, after a checkpoint
    return shutdown(run, gen, log)


def train_step(
    run: Run, models: Models, progress: Progress, gen: Generation, *, index: int, train_policy: bool
) -> Metrics:
    """One batch through the phases. index: the batch's place in the data and sampling streams (the step; critic
    pretraining's batches are -1, -2, ...). train_policy=False: only the critic learns (no value clipping, no sync)."""
    m = Metrics()
    start = time.perf_counter()
    where = f"step {index + 1}" if train_policy else f"critic pretraining step {-index}"
    with timed(m, "rollout"):
        rows, generated = rollout_phase(run, gen, index)
    staleness = index - progress.synced if train_policy else 0  # the updates the rollouts' weights lag behind
    m.add({"rollout/staleness": float(staleness)})
    mc = vine_phase(run, gen, rows, generated, index, m) if run.plan.monte_carlo else None
    with timed(m, "reward"):
        batch = score_batch(run, gen, rows, generated, m)
    if progress.fresh_head:
        set_head_to_mean(models.critic, *all_reduce(batch.reward_sum_count(), run.dp_group))
        progress.fresh_head = False
    with timed(m, "recompute"), torch.no_grad():
        old = recompute(run, models, batch, m)
    with timed(m, "advantages"):
        adv, returns = advantages(run, models, gen, batch, old, mc, index, m)
    with timed(m, "correction"):
        is_w = correction(run, batch, old, m)
    if train_policy and run.cfg.token_records and (index + 1) % run.cfg.token_records == 0 and run.engine_rank:
        token_records(run, batch, old, adv, returns, is_w, index)
    if models.critic is not None:
        with timed(m, "critic"):
            clip = (
                (run.cfg.value_clip or None) if train_policy else None
            )  # pretraining: the first values are the head's
            update_critic(run, models, progress, batch, old, returns, index, clip, where, m)
    if train_policy:
        with timed(m, "policy"):
            update_policy(run, models, progress, batch, old, adv, is_w, index, where, m)
    with timed(m, "sync"):
        sync = train_policy and sync_due(run, index)
        if sync:
            progress.synced = index + 1
        sync_weights(models.policy, gen.rollout_engine, changed=sync)
    m.add(step_metrics(run, batch, m, time.perf_counter() - start))
    return m


def sync_due(run: Run, index: int) -> bool:
    """The engine gets the policy's weights after every --sync-every-th update, and after the last."""
    return (index + 1) % run.cfg.sync_every == 0 or index + 1 == run.cfg.steps


def pretrain_critic(run: Run, models: Models, progress: Progress, gen: Generation, log: RunLog) -> None:
    """Critic pretraining (VC-PPO, VAPO): critic-only steps on the frozen start policy before step 1 until the explained
    variance plateaus (ev_plateaued) or --critic-pretrain steps, then the step-0 checkpoint. Its batches draw their own
    prompts and seeds (the RL steps see the same data either way); a kill before it ends redoes it."""
    cap = run.cfg.critic_pretrain
    evs = []
    for pre in range(1, cap + 1):
        m = train_step(run, models, progress, gen, index=-pre, train_policy=False)
        row = {"step": 0, "pretrain/step": pre, **m.reduce()}
        evs.append(row["critic/explained_variance"])
        plateau = ev_plateaued(evs)
        row["pretrain/done"] = float(plateau or pre == cap)
        log.log(row)
        ev_window = finite_mean(evs[-PLATEAU_WINDOW:])
        if run.rt.rank == 0 and (pre % 10 == 0 or row["pretrain/done"]):
            tqdm.write(
                f"critic pretraining {pre:3d} | vloss {row['critic/value_loss']:.4f} | ev {evs[-1]:.2f} "
                f"| ev last {PLATEAU_WINDOW} {ev_window:.3f}"
            )
        if plateau:
            break
    why = "plateau" if plateau else "step cap --critic-pretrain"
    print0(
        f"critic pretraining stopped after {pre} steps ({why}): mean explained variance of the last "
        f"{PLATEAU_WINDOW} steps {ev_window:.3f}"
    )
    save(run, models, progress, gen.tok, 0)


def finish_step(
    run: Run, models: Models, progress: Progress, gen: Generation, log: RunLog, step: int, m: Metrics
) -> bool:
    """Reduce the step's metrics, evaluate when due, log, plot, checkpoint; on a SIGTERM (any rank's) checkpoint and
    return True: the run stops."""
    cfg = run.cfg
    last = step + 1 == cfg.steps
    row = {"step": step + 1, **m.reduce()}
    records = None
    if (step + 1) % cfg.eval_every == 0 or last:
        if cfg.eval_dtype == "fp32":  # the fp32 copy gets the new weights only when it is used
            push_weights(models.policy, gen.eval_engine)
        metrics, records = evaluate_policy(run, gen)
        row.update(metrics)
    log.log(row)
    if records is not None:
        log.samples(step + 1, records)
    log.progress(row)
    if run.rt.rank == 0:
        tqdm.write(step_line(row, critic=models.critic is not None, evaluated=records is not None))
    if records is not None or last:
        log.plot()
    due = (step + 1) // cfg.save_every > progress.saved_at // cfg.save_every  # a multiple of --save-every passed
    stop = PREEMPTION.agreed(run.rt.device) and not last
    streak = any(progress.bad.values())  # never save mid-streak of skipped updates: see update.check_finite
    if last or ((due or stop) and not streak):
        save(run, models, progress, gen.tok, step + 1)
    if stop:
        PREEMPTION.stopped = True
        folder = os.path.join(cfg.out_dir, "checkpoints", f"step_{progress.saved_at:06d}")
        print0(
            f"SIGTERM: stopping after step {step + 1}, checkpoint {folder} (exit code 143); rerun the same command to "
            "resume"
        )
    return stop


def step_line(row: dict, critic: bool, evaluated: bool) -> str:
    """Rank 0's one line per step."""
    line = (
        f"step {row['step']:4d} | reward {row['rollout/reward_mean']:.3f} | len {row['rollout/response_len_mean']:.1f}"
        f" | masked {row['mismatch/masked_frac']:.3%} | k3 {row['mismatch/k3']:.2e}"
    )
    if critic:
        line += f" | vloss {row['critic/value_loss']:.4f} | ev {row['critic/explained_variance']:.2f}"
    if evaluated:
        line += f" | greedy acc {row['eval/greedy_acc']:.1%}"
    return line + f" | {row['time/step']:.2f}s"


def shutdown(run: Run, gen: Generation, log: RunLog) -> list[dict]:
    log.close()
    if run.rt.rank == 0 and log.history:
        first = log.history[0]
        final = log.history[-1]
        if "eval/greedy_acc" in first and "eval/greedy_acc" in final:
            print(
                f"after RL ({run.cfg.steps} steps): greedy accuracy {first['eval/greedy_acc']:.1%} -> "
                f"{final['eval/greedy_acc']:.1%}, sampled {first['eval/sampled_acc']:.1%} -> "
                f"{final['eval/sampled_acc']:.1%}"
            )
    for engine in {id(e): e for e in (gen.rollout_engine, gen.eval_engine) if e is not None}.values():
        engine.shutdown()
    return log.history


# ----------------------------------------------------------------------------- the step's records


class Batch(NamedTuple):
    """One step's scored rollouts on the trainer's device. B rows, T response columns."""

    generated: Any  # what the engine returned: a Rollout, or agent.Episodes
    rollout: Rollout  # the training rows (generated.rollout for episodes)
    inputs: TrainBatch  # the policy's forward inputs
    critic_inputs: TrainBatch  # the critic's: `inputs`, or with --critic-context its prefix before each prompt
    tokens: torch.Tensor  # [B, T] response tokens
    model_mask: torch.Tensor  # [B, T] every model token (mismatch metrics); observations excluded
    mask: torch.Tensor  # [B, T] the model tokens of rows kept for training (every loss, whitening, denominator)
    infer_logp: torch.Tensor  # [B, T] the engine's log-probs
    scores: torch.Tensor  # [B] each row's reward (multi-turn: its episode's return)
    rewarded: torch.Tensor  # [B] bool: the row has a reward
    keep_rows: torch.Tensor  # [B] bool: rewarded, and for grouped rows (GRPO) in a group with >= 2 rewarded rows
    token_rewards: torch.Tensor  # [B, T] the reward on the last model token (of each turn)
    fed_tokens: torch.Tensor  # real tokens one trainer pass computes (a shared prompt once per group)
    max_len: int  # Generation.max_len
    width: int  # Generation.width

    def reward_sum_count(self) -> torch.Tensor:
        return torch.stack([self.scores[self.rewarded].sum(), self.rewarded.sum().float()])


class Old(NamedTuple):
    """The recompute at the rollout weights, [B, T] each."""

    logp: torch.Tensor  # pi_old
    ref_logp: torch.Tensor | None  # pi_ref (with --kl)
    values: torch.Tensor | None  # V_old (with a critic)


# ----------------------------------------------------------------------------- the phases of a step


def batch_prompts(run: Run, n_train: int, index: int) -> list[int]:
    """This replica's train rows of batch `index` (its share of the data stream, data.tasks.prompt_indices)."""
    start = (index * run.plan.dp + run.dp_rank) * run.plan.prompts
    return prompt_indices(run.cfg.seed, n_train, start, run.plan.prompts)


def rollout_sampling(run: Run, gen: Generation, index: int) -> Sampling:
    """This replica's sampling of batch `index`: row (episode) r draws from seed + r, so no dp split changes the batch."""
    seed = run.cfg.seed * 1_000_003 + index * run.cfg.rollout_batch + run.dp_rank * run.plan.rows
    return replace(gen.sampling, seed=seed % 2**31)


def rollout_phase(run: Run, gen: Generation, index: int):
    """This replica's prompts of batch `index`, generated by its engine rank and shared with its TP peers; the engine
    sleeps after (with Monte Carlo continuations to come, after vine_phase). Returns (task rows, Rollout or
    agent.Episodes)."""
    rows = gen.task.train.select(batch_prompts(run, len(gen.task.train), index))
    generated = None
    if gen.rollout_engine is not None:
        play = gen.play
        if play is not None and run.plan.monte_carlo:  # the episodes keep the engine's snapshots for vine_phase
            play = functools.partial(play, snapshots=True)
        generated = rollouts(gen.rollout_engine, gen.tok, rows, rollout_sampling(run, gen, index), play)
        if not run.plan.monte_carlo:
            gen.rollout_engine.sleep()
    if isinstance(generated, Episodes):
        shared = tp_share(replace(generated, starts=[]), run.tp_mesh)  # the snapshots stay on the engine rank
    else:
        shared = tp_share(generated, run.tp_mesh)
    return rows, shared if generated is None else generated


def vine_phase(run: Run, gen: Generation, rows, generated, index: int, m: Metrics) -> vine.Values:
    """--algo vine (time/vine): the Monte Carlo values of this replica's rows (vine.mc_values) from the engine, still
    awake after the rollout; then it sleeps. Logs the continuations' tokens, summed over dp ranks and per rollout token."""
    mc = None
    with timed(m, "vine"):
        if gen.rollout_engine is not None:
            mc = vine.mc_values(
                gen.rollout_engine,
                gen.tok,
                gen.task,
                rows,
                generated,
                rollout_sampling(run, gen, index),
                k=run.cfg.vine_k,
                every=run.cfg.vine_every,
                play=gen.play,
            )
            gen.rollout_engine.sleep()
        mc = tp_share(mc, run.tp_mesh)
    rollout = generated.rollout if gen.play else generated
    m.add({"vine/extra_tokens": mc.extra_tokens * run.plan.dp})  # the mean over ranks, times dp: the sum over dp
    m.add_ratio("vine/extra_token_ratio", mc.extra_tokens, rollout.mask.sum())
    return mc


def score_batch(run: Run, gen: Generation, rows, generated, m: Metrics) -> Batch:
    """The outcome reward on the last model token (multi-turn: each turn's reward on the turn's last model token), and
    the batch on the trainer's device. A row without a reward (None) leaves training: its tokens leave `mask` (every
    loss, the whitening and the denominators); with grouped rows (GRPO) so do the groups with fewer than 2 rewarded
    rows (no baseline). model_mask keeps every model token (mismatch metrics); observation tokens are in neither."""
    cfg, tok, dev = run.cfg, gen.tok, run.rt.device
    n = run.plan.n
    _, sc = scored(gen.task, tok, rows, n, generated, gen.play)  # multi-turn: per episode (metrics)
    rollout = generated.rollout if gen.play else generated
    if gen.play:  # every row of an episode gets its return
        scores = generated.returns[generated.episode]
        token_rewards = generated.rewards
        rewarded = torch.ones(len(scores), dtype=torch.bool, device=dev)
    else:
        scores = sc.rewards
        rewarded = sc.rewarded.to(dev)
        token_rewards = losses.last_token_rewards(scores, rollout.mask)
    inputs = rollout.to_batch(tok.pad_token_id)
    # Real tokens one trainer pass over the batch computes (a shared prompt once per group): bench/ turns it into FLOPs.
    fed_tokens = inputs.attention_mask.sum()
    if run.share:
        fed_tokens -= inputs.attention_mask[:, : inputs.response_start].sum() * (run.group - 1) // run.group
    inputs = to_device(inputs.shared(run.group) if run.share else inputs, dev)  # one forward of a prompt for its n
    critic_inputs = inputs
    if cfg.critic_context != "policy":
        prefixes = context_ids(cfg.critic_context, tok, rows, generated, n)
        critic_inputs = to_device(critic_batch(rollout, prefixes, tok.pad_token_id, run.group if run.share else 1), dev)
    model_mask = rollout.mask.to(dev)
    keep_rows = rewarded
    if run.plan.grouped:
        keep_rows = rewarded & (rewarded.view(-1, n).sum(-1, keepdim=True) >= 2).expand(-1, n).reshape(-1)
    m.add_ratio("rollout/reward_mean", sc.rewards[sc.rewarded].sum(), sc.rewarded.sum())
    m.add_ratio("rollout/no_reward_frac", (~sc.rewarded).sum(), len(sc.rewarded))
    for extra in sc.extras:  # reward/<key>: each numeric extra key of the reward's dicts, over the samples with it
        for k, v in extra.items():
            if k != "pred" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                m.add_ratio(f"reward/{k}", v, 1)
    return Batch(
        generated=generated,
        rollout=rollout,
        inputs=inputs,
        critic_inputs=critic_inputs,
        tokens=rollout.tokens.to(dev),
        model_mask=model_mask,
        mask=model_mask & keep_rows[:, None],
        infer_logp=rollout.infer_logp.to(dev),
        scores=scores.to(dev),
        rewarded=rewarded,
        keep_rows=keep_rows,
        token_rewards=token_rewards.to(dev),
        fed_tokens=fed_tokens,
        max_len=gen.max_len,
        width=gen.width,
    )


def to_device(b: TrainBatch, device) -> TrainBatch:
    return type(b)(*(x.to(device) if torch.is_tensor(x) else x for x in b))


def recompute(run: Run, models: Models, batch: Batch, m: Metrics) -> Old:
    """pi_old, pi_ref and V_old at the rollout weights, micro-batch by micro-batch (called under no_grad)."""
    chunks = micro(torch.arange(len(batch.tokens)), run.cfg.micro_batch, run.group)
    logp = []
    for r in chunks:
        logp.append(response_logprobs(models.policy, batch.inputs, r, batch.tokens, run.fwd)[0])
        if (
            batch.inputs.routing is not None
        ):  # MoE: how often the trainer's routers pick other experts than the engine's
            m.add(moe.batch_flips(models.policy, batch.inputs, r, batch.model_mask))
    ref_logp = values = None
    if models.ref is not None:
        ref_logp = torch.cat([response_logprobs(models.ref, batch.inputs, r, batch.tokens, run.fwd)[0] for r in chunks])
    if models.critic is not None:
        values = torch.cat([response_values(models.critic, batch.critic_inputs, r, run.fwd.bf16) for r in chunks])
    return Old(torch.cat(logp), ref_logp, values)


def advantages(
    run: Run, models: Models, gen: Generation, batch: Batch, old: Old, mc: vine.Values | None, index: int, m: Metrics
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(advantages, returns), the one place that names the algorithm. PPO: token-level GAE (lambda_policy, or
    length-adaptive) with GAE(1) returns as the critic's targets (VC-PPO's decoupled lambdas); GRPO: group-relative
    advantages; vine: the Monte Carlo values' differences (mc, from vine_phase); reinforce: the reward minus its
    prompt's running mean (value_model.PromptBaseline; rows with the same prompt share it). All but GRPO's are whitened
    over the global batch with --whiten-advantages; only PPO has returns."""
    cfg, mask = run.cfg, batch.mask
    rewards = batch.token_rewards
    returns = None
    if cfg.kl == "k1-reward":
        rewards = rewards - cfg.kl_coef * losses.kl_estimate(old.logp, old.ref_logp, "k1") * mask
    if cfg.algo == "grpo":
        adv = losses.grpo_advantages((rewards * mask).sum(-1), run.plan.n, cfg.grpo_std, valid=batch.rewarded)
        return adv[:, None] * mask, None
    if cfg.algo == "vine":  # VinePPO: Monte Carlo values at the states, no critic
        adv = losses.vine_advantages(mc.values.to(mask.device), mc.states.to(mask.device), rewards, mask)
        m.add_ev(vine.ev_stats(mc, batch.token_rewards, mask, batch.width))
    elif cfg.algo == "reinforce":
        adv = reinforce_advantages(run, models.baseline, gen, batch, index, m)[:, None] * mask
    else:
        _, returns = losses.gae(rewards, old.values, mask, cfg.gamma, 1.0)
        if cfg.adaptive_lambda > 0:
            lam = losses.length_adaptive_lambda(batch.model_mask.sum(-1), cfg.adaptive_lambda)
        else:
            lam = cfg.lam_policy
        adv, _ = losses.gae(rewards, old.values, mask, cfg.gamma, lam)
    if cfg.whiten_advantages:  # the statistics all-reduced over dp ranks (whitening over the global batch)
        adv = losses.whiten(adv, mask, all_reduce(losses.whiten_stats(adv, mask), run.dp_group))
    return adv, returns


def reinforce_advantages(
    run: Run, baseline: PromptBaseline, gen: Generation, batch: Batch, index: int, m: Metrics
) -> torch.Tensor:
    """[B] each row's reward minus the running mean of its prompt's earlier rewards (the step's mean for a prompt
    without any); the table then takes this step's rewards, gathered over dp ranks."""
    dev = batch.mask.device
    episodes = batch.generated.episode if isinstance(batch.generated, Episodes) else range(len(batch.tokens))
    sample = torch.tensor(episodes, device=dev)
    keys = [baseline.keys[i] for i in batch_prompts(run, len(gen.task.train), index)]
    prompts = torch.tensor(keys, device=dev)[sample // run.plan.n]
    adv, had = baseline.advantages(
        prompts, sample, batch.scores, batch.rewarded, run.plan.rows, run.dp_rank, run.plan.dp, run.dp_group
    )
    m.add_ratio("reinforce/history_frac", had[batch.rewarded].sum(), batch.rewarded.sum())  # prompts seen before
    return adv


def correction(run: Run, batch: Batch, old: Old, m: Metrics) -> torch.Tensor | None:
    """The importance weights of the policy loss, or None: IcePop's M(k) (or TIS's min(k, C), or the geometric sequence
    mask) on k = pi_old / pi_infer, C = the band's upper bound; DIS acts inside its loss. Masked tokens stay in the
    denominator (the IcePop paper's form)."""
    cfg, mask = run.cfg, batch.mask
    low, high = cfg.icepop_low, cfg.icepop_high
    m.add(losses.mismatch_metrics(old.logp, batch.infer_logp, batch.model_mask, low, high))
    is_w = None
    if cfg.correction == "icepop":
        is_w, cm = losses.icepop_weights(old.logp, batch.infer_logp, mask, low, high)
        m.add(cm)
    elif cfg.correction == "tis":
        is_w, cm = losses.tis_weights(old.logp, batch.infer_logp, mask, cap=high)
        m.add(cm)
    elif cfg.correction == "geo":
        is_w, cm = losses.geo_seq_mask(old.logp, batch.infer_logp, mask, low, high)
        m.add(cm)
    return is_w


def token_records(run: Run, batch: Batch, old: Old, adv, returns, is_w, index: int) -> None:
    """--token-records: this replica's model tokens of the step, one row each, as out_dir/tokens/step_N-dpR.parquet
    (runlog.TOKEN_COLUMNS says what each column holds). Rows are numbered over the global batch."""
    rows, pos = batch.model_mask.nonzero(as_tuple=True)
    ratio = torch.exp(old.logp - batch.infer_logp)
    band = (ratio > run.cfg.icepop_high).long() - (ratio < run.cfg.icepop_low).long()  # -1 below, 0 in, 1 above

    def at(t):
        if t is None:
            return None
        t = t[rows, pos].cpu()
        return t.float() if t.is_floating_point() else t

    columns = {
        "step": torch.full_like(rows, index + 1).cpu(),
        "row": (rows + run.dp_rank * run.plan.rows).cpu(),
        "position": pos.cpu(),
        "token": at(batch.tokens),
        "engine_logp": at(batch.infer_logp),
        "trainer_logp": at(old.logp),
        "ratio": at(ratio),
        "side": [("below", "in", "above")[b + 1] for b in at(band).tolist()],
        "weight": at(is_w),
        "trained": at(batch.mask),
        "advantage": at(adv),
        "value": at(old.values),
        "return": at(returns),
        "reward": batch.scores[rows].cpu(),
    }
    write_token_records(run.cfg.out_dir, index + 1, run.dp_rank, columns)


def update_critic(
    run: Run,
    models: Models,
    progress: Progress,
    batch: Batch,
    old: Old,
    returns,
    index: int,
    clip: float | None,
    where: str,
    m: Metrics,
) -> None:
    """--critic-updates passes of the clipped value loss towards the returns, global token denominator per minibatch;
    logs the explained variance of the values before this update (out of sample for this batch)."""
    cfg, mask = run.cfg, batch.mask
    for k in range(cfg.critic_updates):
        for mb in minibatches(len(batch.tokens), cfg.minibatches, cfg.seed, index, 1000 + k, run.group):
            denom = denominator(mask[mb], batch.keep_rows[mb], cfg.agg, batch.max_len, run.dp_group)
            for r in micro(mb, cfg.micro_batch, run.group):
                loss, vm = losses.value_loss(
                    response_values(models.critic, batch.critic_inputs, r, run.fwd.bf16),
                    old.values[r],
                    returns[r],
                    mask[r],
                    clip=clip,
                    agg=cfg.agg,
                    num_tokens=denom,
                )
                loss.backward()
                m.add(vm)
            norm, ok, weights_ok = optimizer_step(models.critic, models.opts["critic"], cfg.max_grad_norm, run.dp_group)
            guard(run, progress, ok, weights_ok, "critic", where, norm)
            m.add({"critic/grad_norm": norm, "train/skipped_critic_update": float(not ok)})
    m.add_ev(
        {
            "critic/explained_variance": losses.ev_stats(old.values, returns, mask),
            **losses.ev_stats_by_position(old.values, returns, mask, batch.width),
        }
    )


def update_policy(
    run: Run, models: Models, progress: Progress, batch: Batch, old: Old, adv, is_w, index: int, where: str, m: Metrics
) -> None:
    """--ppo-epochs passes of PPO-clip (or DIS) with the correction's weights, global token denominator per minibatch,
    plus the k3 KL loss with --kl k3-loss."""
    cfg, mask = run.cfg, batch.mask
    for epoch in range(cfg.ppo_epochs):
        for mb in minibatches(len(batch.tokens), cfg.minibatches, cfg.seed, index, epoch, run.group):
            denom = denominator(mask[mb], batch.keep_rows[mb], cfg.agg, batch.max_len, run.dp_group)
            for r in micro(mb, cfg.micro_batch, run.group):
                logp, ent = response_logprobs(models.policy, batch.inputs, r, batch.tokens, run.fwd, entropy=True)
                if cfg.correction == "dis":
                    loss, pm = losses.dis_policy_loss(
                        logp,
                        batch.infer_logp[r],
                        adv[r],
                        mask[r],
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
                        mask[r],
                        clip_low=cfg.clip_low,
                        clip_high=cfg.clip_high,
                        dual_clip=cfg.dual_clip or None,
                        is_weights=None if is_w is None else is_w[r],
                        agg=cfg.agg,
                        num_tokens=denom,
                    )
                if cfg.kl == "k3-loss":
                    kl = losses.aggregate(losses.kl_estimate(logp, old.ref_logp[r], "k3"), mask[r], cfg.agg, denom)
                    loss = loss + cfg.kl_coef * kl
                    pm["ppo/kl_ref"] = kl.detach()
                loss.backward()
                m.add(pm)
                # Token-weighted over the step: a micro-batch without a kept token adds nothing (its own mean is 0/0).
                m.add_ratio("ppo/entropy", (ent.detach() * mask[r]).sum(), mask[r].sum())
            norm, ok, weights_ok = optimizer_step(models.policy, models.opts["policy"], cfg.max_grad_norm, run.dp_group)
            guard(run, progress, ok, weights_ok, "policy", where, norm)
            m.add({"ppo/grad_norm": norm, "train/skipped_update": float(not ok)})


def guard(run: Run, progress: Progress, ok: bool, weights_ok: bool, what: str, where: str, norm) -> None:
    """update.check_finite with the run's --max-bad-steps; its error names the newest checkpoint."""
    cfg = run.cfg
    check_finite(
        ok,
        weights_ok,
        progress.bad,
        what,
        where,
        norm,
        max_bad_steps=cfg.max_bad_steps,
        find_checkpoint=lambda: latest_checkpoint(cfg.out_dir, cfg.algo),
    )


def step_metrics(run: Run, batch: Batch, m: Metrics, seconds: float) -> dict:
    """The rollout's sizes and speed, the step's time and peak memory."""
    dp = run.plan.dp
    lengths = batch.model_mask.sum(-1)
    finish = batch.rollout.finish_reasons
    out = {
        "rollout/response_len_mean": lengths.float().mean(),
        "rollout/response_len_max": lengths.max().float(),
        "rollout/tokens_per_s": lengths.sum() * dp / float(m.values["time/rollout"][0]),  # dp engines run at once
        "rollout/truncated_frac": sum(f in ("length", "turn_length") for f in finish) / len(finish),
        "train/tokens_per_pass": batch.fed_tokens.float() * dp,
        "train/response_tokens": lengths.sum().float() * dp,  # dp ranks' sum: mean x dp
        "time/step": seconds,
    }
    if isinstance(batch.generated, Episodes):
        out.update(episode_metrics(batch.generated))
    if run.plan.grouped:  # groups whose n rewards are all equal carry no GRPO signal
        groups = batch.scores.view(-1, run.plan.n)
        out["grpo/identical_reward_frac"] = (groups.amax(-1) == groups.amin(-1)).float().mean()
    # CUDA: the largest phase peak; CPU: peak RSS (KiB)
    peaks = [float(v[0]) for k, v in m.values.items() if k.startswith("mem/")]
    out["mem/peak_gib_max"] = max(peaks) if peaks else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return out


if __name__ == "__main__":
    import tyro

    PREEMPTION.install()
    main(tyro.cli(Config))
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(143 if PREEMPTION.stopped else 0)
