"""IcePop PPO with a trained value model (the GLM-5.2 recipe): one torchrun job, engine and trainer colocated.

    make train                                                   # = bash runs/cpu.sh: tiny model, 2 CPU processes
    torchrun --standalone --nproc_per_node 2 train_ppo.py        # the same by hand (dp=2)
    torchrun --standalone --nproc_per_node 2 train_ppo.py --tp 2 # policy and critic sharded over 2 ranks
    bash runs/gpu_qwen3.sh                                       # a real HF model with SGLang on GPUs
    python train_ppo.py --help                                   # every option, from the Config docstrings

Every rank holds a shard of the policy and the critic; the first rank of each TP group also holds a
rollout engine (embedded torch sampler or SGLang) that generates that data-parallel replica's share.
One step, and what occupies each device's memory (colocated: the phases take turns):

    phase                      engine (weights + KV cache)   policy / critic / optimiser states
    1 rollout                  awake, generating             resident, idle
    2-5 reward ... correction  asleep (released)             forward activations (no grad)
    6-7 critic, policy update  asleep                        activations + gradients
    8 weight sync              wake, then full weights pushed bucket by bucket, cache flushed
    9 metrics / eval / ckpt    awake (eval generates)        resident

The order sleep -> train -> wake -> sync is written once, in the loop below.
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import time
from dataclasses import asdict, replace

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tqdm import tqdm
from transformers import AutoModelForCausalLM

import losses as L
import moe
from config import Config, check_model, resolve
from agent import DEFAULT_MAX_TURNS, episode_metrics, load_env, run_episodes
from data.rewards import load_reward
from data.tasks import get_task
from evaluation import evaluate, rollouts, scored
from parallel import all_reduce, all_reduce_grads, clip_grad_norm_, init_runtime, make_mesh, parallelize, print0
from rollout import EmbeddedEngine, Sampling, make_engine, push_weights
from runlog import RunLog, check_resume, latest_checkpoint, load_trainer_state, lock_run_dir, save_checkpoint
from value_model import build_critic, critic_values, load_critic

REPO = os.path.dirname(os.path.abspath(__file__))


@contextlib.contextmanager
def timed(times: dict, name: str):
    """The phase's seconds into times["time/<name>"]; on CUDA also its peak allocated GiB into "mem/<name>_gib_max"."""
    if cuda := torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    yield
    times[f"time/{name}"] = time.perf_counter() - start
    if cuda:
        times[f"mem/{name}_gib_max"] = torch.cuda.max_memory_allocated() / 2**30


def whiten(x: torch.Tensor, mask: torch.Tensor, group) -> torch.Tensor:
    """losses.masked_whiten over the global batch: mean and unbiased variance all-reduced over dp ranks (in
    float64: squares of large advantages overflow float32)."""
    x = x.double()
    stats = all_reduce(torch.stack([(x * mask).sum(), (x * x * mask).sum(), mask.sum()]), group)
    mean = stats[0] / stats[2].clamp_min(1)  # a batch without a rewarded token: 0, not NaN
    var = (stats[1] - stats[2] * mean**2) / (stats[2] - 1).clamp_min(1)
    return ((x - mean) * torch.rsqrt(var + 1e-8)).float() * mask


def denominator(loss_mask: torch.Tensor, keep: torch.Tensor, cfg: Config, max_len: int, group) -> torch.Tensor:
    """losses.loss_denominator of a minibatch over its kept (rewarded) rows only, so a row without a reward leaves
    N_seq as well as N_tok; summed over dp ranks, at least 1 (a minibatch with nothing to learn has loss 0)."""
    return all_reduce(L.loss_denominator(loss_mask[keep], cfg.agg, max_len), group).clamp_min(1)


def reward_metrics(sc, group) -> dict[str, float]:
    """rollout/reward_mean over the rewarded samples of the global batch (NaN if none), rollout/no_reward_frac, and
    reward/<key>: the mean of each numeric extra key of the reward's dicts over the samples that return it.
    Totalled over dp ranks, so every rank logs the same keys with the same values."""
    local = {"rollout/reward_mean": [sc.rewards[sc.rewarded].sum().item(), int(sc.rewarded.sum())],
             "rollout/no_reward_frac": [float((~sc.rewarded).sum()), len(sc.rewarded)]}
    for extra in sc.extras:
        for k, v in extra.items():
            if k != "pred" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                total = local.get(f"reward/{k}", [0.0, 0])
                local[f"reward/{k}"] = [total[0] + v, total[1] + 1]
    parts = [local]
    if dist.is_initialized():
        parts = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, local, group=group)
    sums = {k: [sum(p[k][i] for p in parts if k in p) for i in (0, 1)] for k in {k for p in parts for k in p}}
    return {k: v / c if c else float("nan") for k, (v, c) in sums.items()}


def add(metrics: dict[str, list], new: dict[str, torch.Tensor]) -> None:
    """Collect a phase's (or micro-batch's) metrics; reduce_metrics averages the repeats."""
    for k, v in new.items():
        metrics.setdefault(k, []).append(torch.as_tensor(v).detach().float().cpu().reshape(()))


def reduce_metrics(metrics: dict[str, list]) -> dict[str, float]:
    """Mean over repeats and ranks (TP peers hold equal values); max / min for *_max / *_min. One sync."""
    keys = sorted(metrics)
    pick = lambda k, v: v.max() if k.endswith("_max") else v.min() if k.endswith("_min") else v.mean()  # noqa: E731
    vals = torch.stack([pick(k, torch.stack(metrics[k])) for k in keys])
    if dist.is_initialized():
        mx = vals.clone()
        mn = vals.clone()
        for t, op in ((vals, dist.ReduceOp.SUM), (mx, dist.ReduceOp.MAX), (mn, dist.ReduceOp.MIN)):
            dist.all_reduce(t, op=op)
        vals = vals / dist.get_world_size()
        vals = torch.where(torch.tensor([k.endswith("_max") for k in keys]), mx, vals)
        vals = torch.where(torch.tensor([k.endswith("_min") for k in keys]), mn, vals)
    return dict(zip(keys, vals.tolist()))


def minibatches(rows: int, cfg: Config, step: int, epoch: int, n: int = 1) -> list[torch.Tensor]:
    """Shuffled row indices per minibatch, whole groups of n consecutive rows kept together (shared prefixes); the
    same on TP peers (same seed), which see the same rows."""
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 101 + epoch)
    parts = torch.randperm(rows // n, generator=g).tensor_split(cfg.minibatches)  # always cfg.minibatches parts: a rank
    # with fewer rows (compaction) still joins every minibatch's collectives, with an empty part if need be
    return [(p[:, None] * n + torch.arange(n)).reshape(-1) for p in parts]


def micro(idx: torch.Tensor, cfg: Config, n: int = 1) -> list[torch.Tensor]:
    return list(idx.split(max(n, cfg.micro_batch // n * n)))  # whole groups


class HeadStandIn(torch.nn.Module):
    """Takes the LM head's place for one forward (``fn`` gets the kept hidden states [b, T, H] and returns what the
    forward returns as its logits), so the work stays inside the model's own forward, where FSDP gathers the weights."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, h):
        return self.fn(h)


@contextlib.contextmanager
def head_replaced(model, fn):
    head = model.get_output_embeddings()
    model.set_output_embeddings(HeadStandIn(fn))
    try:
        yield head
    finally:
        model.set_output_embeddings(head)  # the same module (and a tied weight's Parameter) as before


def sequences(b, rows):
    """The forward's inputs for rows (whole groups, in order, when the batch shares prefixes: TrainBatch.shared)."""
    n = b.group
    if n > 1 and (len(rows) % n or (rows[::n] % n).any() or not torch.equal(rows, (rows[::n, None] + torch.arange(n)).reshape(-1))):
        raise ValueError(f"rows {rows.tolist()} are not whole groups of {n}")
    sel = rows[::n] // n
    return {"input_ids": b.input_ids[sel], "attention_mask": b.attention_mask[sel], "position_ids": b.position_ids[sel]}


def response_logprobs(model, b, rows, tokens, cfg: Config, entropy: bool = False):
    """(log-probs [b, T], entropy [b, T] or None) of the response tokens of rows. The forward keeps only the columns that
    predict response tokens (b.keep, logits_to_keep), and the LM head runs on them chunk by chunk (losses.head_logprobs):
    no [b, L, V] or [b, T, V] logits exist. Under --train-dtype bf16 the forward runs in bf16 autocast over fp32 weights.
    --routing-replay: an MoE forward uses the engine's experts (b.routing)."""
    out = {}

    def logprobs(h):  # [sequences, len(keep), H] -> one row per response
        out["logp"], out["entropy"] = L.head_logprobs(head, h.reshape(len(rows), tokens.size(1), h.size(-1)), tokens[rows], cfg.temperature,
                                                      top_k=cfg.top_k, top_p=cfg.top_p, entropy=entropy)
        return out["logp"]
    replay = moe.batch_routes(b, rows) if cfg.routing_replay else None
    with (head_replaced(model, logprobs) as head, moe.routing(model, replay),
          torch.autocast(b.input_ids.device.type, torch.bfloat16, enabled=cfg.train_dtype == "bf16")):
        model(**sequences(b, rows), logits_to_keep=b.keep)
    return out["logp"], out["entropy"]


def response_values(critic, b, rows, cfg: Config):
    """Values [b, T] float32: V of the state before each response token (the columns of response_logprobs)."""
    with torch.autocast(b.input_ids.device.type, torch.bfloat16, enabled=cfg.train_dtype == "bf16"):
        return critic_values(critic, **sequences(b, rows))[:, b.keep].reshape(len(rows), -1)


def check_head(model) -> None:
    """response_logprobs replaces the LM head's output: refuse a model whose forward changes what the head returns
    (a logit softcap or scale would be silently dropped)."""
    sentinel = torch.zeros(1, 1, 1, device=model.device)
    with torch.no_grad(), head_replaced(model, lambda h: sentinel):
        returned = model(input_ids=torch.zeros(1, 2, dtype=torch.long, device=model.device)).logits
    if returned is not sentinel:
        raise ValueError(f"--model: {type(model).__name__}'s forward post-processes the LM head's output (a logit softcap or "
                         "scale?), which the trainer's response-only log-probs would drop")


def optimizer_step(model, opt, cfg: Config, dp_group) -> tuple[torch.Tensor, bool, bool]:
    """Sum gradients over dp, clip, step unless the gradient is non-finite (then skip). Returns (grad norm,
    stepped, weights finite after it). Same decisions on all ranks: the norm is of the reduced, global gradient."""
    all_reduce_grads(model, dp_group)
    norm = clip_grad_norm_([p for p in model.parameters() if p.requires_grad], cfg.max_grad_norm)
    ok = bool(torch.isfinite(norm))
    weights_ok = True
    if ok:
        opt.step()
        local = torch.stack([torch.isfinite(p.to_local() if isinstance(p, DTensor) else p).all() for p in model.parameters()]).all()
        weights_ok = bool(all_reduce(local.float(), op=dist.ReduceOp.MIN))  # TP ranks hold different shards
    opt.zero_grad(set_to_none=True)
    return norm.detach(), ok, weights_ok


def check_finite(ok: bool, weights_ok: bool, bad: dict[str, int], what: str, where: str, norm: torch.Tensor, cfg: Config) -> None:
    """Count each model's consecutive skipped (non-finite) updates in bad[what]; stop the run after max_bad_steps
    of them, or at once if an update left non-finite weights (it cannot be undone). No checkpoint is written
    while a streak lasts, so the last one on disk predates the trouble and resumes with a new --lr."""
    bad[what] = 0 if ok else bad[what] + 1
    if not ok:
        print(f"{where}: skipped a {what} update with a non-finite loss or gradient (norm {norm.item()})", flush=True)
    if weights_ok and bad[what] < cfg.max_bad_steps:
        return
    why = (f"the {what} update made its weights non-finite (grad norm {norm.item()})" if not weights_ok else
           f"{bad[what]} consecutive {what} updates had a non-finite loss or gradient (last grad norm {norm.item()})")
    last = latest_checkpoint(cfg.out_dir)
    raise RuntimeError(f"{where}: {why}. Nothing was saved after the trouble began: lower --{'lr' if what == 'policy' else 'critic-lr'} "
                       f"or check the rewards, and {'resume from ' + last + ' (rerun with the same --out-dir)' if last else 'start again'}")


# Critic pretraining stops once the mean explained variance of the last PLATEAU_WINDOW steps is less than
# PLATEAU_MIN_GAIN above that of the window before (windows smooth the per-batch noise of 64-row EVs).
PLATEAU_WINDOW, PLATEAU_MIN_GAIN = 10, 0.01


def _finite_mean(xs: list[float]) -> float:
    xs = [x for x in xs if math.isfinite(x)]  # EV is NaN on a batch whose returns are all equal
    return sum(xs) / len(xs) if xs else float("nan")


def ev_plateaued(evs: list[float]) -> bool:
    """The plateau rule of critic pretraining, on the per-step explained variances so far."""
    W = PLATEAU_WINDOW
    return len(evs) >= 2 * W and not _finite_mean(evs[-W:]) >= _finite_mean(evs[-2 * W : -W]) + PLATEAU_MIN_GAIN


# ----------------------------------------------------------------------------- the loop


def main(cfg: Config) -> list[dict]:
    """Run (or resume) training; returns the metrics history (rank 0; other ranks get an empty list)."""
    rt = init_runtime()
    if cfg.train_dtype == "auto":  # resolved before anything records or compares the config
        cfg = replace(cfg, train_dtype="bf16" if rt.device.type == "cuda" else "fp32")
    plan = resolve(cfg, rt.world_size)
    lock = lock_run_dir(cfg.out_dir) if rt.rank == 0 else None  # noqa: F841  (held until the process ends)
    # A bad task, data file or row fails here, before any model is built.
    task = get_task(cfg.task, split=cfg.split, prompt_key=cfg.prompt_key, answer_key=cfg.answer_key,
                    reward_fn=load_reward(cfg.reward), eval_task=cfg.eval_task, eval_split=cfg.eval_split)
    if cfg.env:
        task.env, task.max_turns = load_env(cfg.env), DEFAULT_MAX_TURNS
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True)
    mesh = make_mesh(rt, cfg.tp)
    dp_group, tp_mesh = (mesh["dp"].get_group(), mesh["tp"]) if mesh else (None, None)
    dp_rank = mesh["dp"].get_local_rank() if mesh else 0
    fsdp = mesh["dp"] if mesh and cfg.fsdp else None
    is_engine_rank = tp_mesh is None or tp_mesh.get_local_rank() == 0
    ckpt = latest_checkpoint(cfg.out_dir)
    changes = check_resume(cfg, ckpt, rt.world_size) if ckpt else {}
    model_path = cfg.model
    if not model_path:
        from data.tiny import default_model

        kind = cfg.task if cfg.task in ("addition", "sort", "guess") else "addition"  # the built-in tasks have their own warm-up
        if rt.rank == 0:
            default_model(os.path.join(REPO, ".cache"), task=kind, arch=cfg.tiny)  # built once, by rank 0; the others find it cached
        if dist.is_initialized():
            dist.barrier()
        model_path = default_model(os.path.join(REPO, ".cache"), task=kind, arch=cfg.tiny)

    policy_path = os.path.join(ckpt, "policy") if ckpt else model_path
    tok = check_model(cfg, model_path, task)
    torch.manual_seed(cfg.seed)
    policy = moe.install(AutoModelForCausalLM.from_pretrained(policy_path, dtype=torch.float32).to(rt.device))  # MoE: record / replay routing
    check_head(policy)  # on the plain model: a forward under FSDP would leave the root's weights gathered as the optimiser's
    policy = parallelize(policy, tp_mesh, fsdp)
    opts = {"policy": torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=0.0)}
    critic = ref = None
    if cfg.algo == "ppo":
        critic = load_critic(os.path.join(ckpt, "critic"), torch.float32) if ckpt else build_critic(model_path, dtype=torch.float32)
        if cfg.freeze_critic_attention:
            for name, p in critic.named_parameters():
                p.requires_grad_(".self_attn." not in name)
        critic = parallelize(critic.to(rt.device), tp_mesh, fsdp)
        opts["critic"] = torch.optim.AdamW([p for p in critic.parameters() if p.requires_grad], lr=plan["critic_lr_used"], weight_decay=0.0)
    if cfg.kl != "none":  # the frozen initial policy, also on resume
        ref = moe.install(AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(rt.device).requires_grad_(False))
        ref = parallelize(ref, tp_mesh, fsdp).eval()
    start, bad = 0, {k: 0 for k in opts}  # consecutive skipped updates, per model
    if ckpt:
        state = load_trainer_state(ckpt, rt.rank, rt.world_size, opts)
        start, bad = state["step"], state["bad_steps"]
        bad = bad if isinstance(bad, dict) else {k: bad for k in opts}  # checkpoints before per-model counts
        for k, lr in (("policy", cfg.lr), ("critic", plan["critic_lr_used"])):  # a changed --lr / --critic-lr applies
            for group in opts[k].param_groups if k in opts else []:
                group["lr"] = lr
    engine = make_engine(cfg, policy_path, rt.device) if is_engine_rank else None
    eval_engine = engine
    if cfg.eval_dtype == "fp32":
        eval_engine = EmbeddedEngine(policy_path, dtype="fp32", device=rt.device) if is_engine_rank else None
    grp = 1 if cfg.compact_at else plan["n"]  # rows per group: kept together in minibatches, sharing their prompt's forward
    share = cfg.shared_prefix and grp > 1
    if share and policy.config._attn_implementation != "sdpa":
        raise ValueError(f"--shared-prefix needs SDPA attention (a boolean block mask); the model uses "
                         f"{policy.config._attn_implementation!r}: pass --no-shared-prefix")
    sampling = Sampling(cfg.temperature, cfg.top_k, cfg.top_p, cfg.max_new_tokens or task.max_new_tokens, (tok.eos_token_id,), plan["n"], cfg.seed)
    # A multi-turn task's rows hold up to a context of turns and observations (agent.py); max_len is the model-token
    # budget of a row (the Dr. GRPO denominator), width the response block's (the per-position metrics' keys).
    max_len = width = sampling.max_new_tokens
    play = None
    if task.env is not None:
        turns, context = cfg.max_turns or task.max_turns, policy.config.max_position_embeddings
        max_len, width = (turns + 1) * sampling.max_new_tokens, context
        play = lambda eng, rows, s: run_episodes(eng, tok, task.env, rows, s, max_turns=turns, context_len=context, compact_at=cfg.compact_at)  # noqa: E731
    # A fresh run (no checkpoint) drops whatever an earlier, killed attempt logged.
    log = RunLog(cfg.out_dir, rt.rank, {**asdict(cfg), **plan, "model_path": model_path}, start if ckpt else -1, cfg.wandb, cfg.tensorboard, changes)
    print0(f"{'resuming at step ' + str(start) if ckpt else 'starting'}: {cfg.algo} + {cfg.correction}, model {model_path}, "
           f"world {rt.world_size} (dp {plan['dp']} x tp {cfg.tp}), {cfg.rollout_batch} completions/step, run folder {cfg.out_dir}")
    if ckpt is None:
        before, records = evaluate(eval_engine, tok, task, cfg, sampling, dp_rank, plan["dp"], play)
        log.log({"step": 0, **before})
        log.samples(0, records)
        print0(f"before RL: greedy accuracy {before['eval/greedy_acc']:.1%}, sampled {before['eval/sampled_acc']:.1%} "
               f"on {min(cfg.eval_size, len(task.test))} held-out problems")
    order = {}  # epoch -> permutation of the train set, the same on every rank
    n_train = len(task.train)
    # Critic pretraining (VC-PPO, VAPO): critic-only steps on the frozen start policy before step 1, until the
    # explained variance plateaus (ev_plateaued) or --critic-pretrain steps. A kill before it ends redoes it.
    pre = 0 if critic is not None and ckpt is None and cfg.critic_pretrain > 0 else None
    init_head = critic is not None and ckpt is None  # a fresh value head starts at the mean reward
    evs: list[float] = []
    save = lambda at: save_checkpoint(cfg.out_dir, at, rt.rank, rt.world_size, cfg.keep_checkpoints, policy=policy, critic=critic,  # noqa: E731
                                      tokenizer=tok, optimizers=opts, extra={"bad_steps": dict(bad), "tp": cfg.tp})
    save_due = False
    bar = tqdm(total=cfg.steps, initial=start, disable=rt.rank != 0, dynamic_ncols=True)
    step = start
    while step < cfg.steps:
        m: dict[str, list] = {}
        times: dict[str, float] = {}
        t_step = time.perf_counter()
        pretraining = pre is not None
        # Index of this batch in the data and sampling streams: pretraining batches are -1, -2, ..., so they
        # draw their own prompts and seeds and the RL steps see the same data with or without pretraining.
        g = -(pre + 1) if pretraining else step
        where = f"critic pretraining step {pre + 1}" if pretraining else f"step {step + 1}"

        # 1 rollout: this replica's prompts, generated by its engine rank, shared with its TP peers
        with timed(times, "rollout"):
            first = g * plan["prompts"] * plan["dp"] + dp_rank * plan["prompts"]
            idx = []
            for i in range(first, first + plan["prompts"]):
                epoch = i // n_train
                if epoch not in order:
                    order[epoch] = torch.randperm(n_train, generator=torch.Generator().manual_seed(cfg.seed + epoch)).tolist()
                idx.append(order[epoch][i % n_train])
            rows = task.train.select(idx)
            out = None
            if engine is not None:
                # Row (episode) r of this call is sampled with seed + r (engine contract; agent.run_episodes), so the
                # global batch does not depend on how it is split over data-parallel ranks.
                seed = (cfg.seed * 1_000_003 + g * cfg.rollout_batch + dp_rank * plan["rows"]) % 2**31
                s = Sampling(**{**asdict(sampling), "seed": seed})
                out = rollouts(engine, tok, rows, s, play)
                engine.sleep()
            if tp_mesh is not None and tp_mesh.size() > 1:
                box = [out]
                dist.broadcast_object_list(box, group_src=0, group=tp_mesh.get_group())
                out = box[0]
            ro = out.rollout if play else out

        # 2 reward: the outcome reward on the last model token (multi-turn: each turn's reward on the turn's last model
        # token). A row without a reward (None) leaves training: its tokens leave `mask` (every loss, the whitening and
        # the denominators); in GRPO so do the groups with fewer than 2 rewarded rows (no baseline). gen_mask keeps
        # every model token (mismatch metrics); observation tokens are in neither.
        with timed(times, "reward"):
            _, sc = scored(task, tok, rows, plan["n"], out, play)  # multi-turn: per episode (metrics); rows get its return
            if play:
                scores, token_rewards = out.returns[out.episode], out.rewards
                rewarded = torch.ones(len(scores), dtype=torch.bool, device=rt.device)
            else:
                scores, rewarded = sc.rewards, sc.rewarded.to(rt.device)
                token_rewards = L.last_token_rewards(scores, ro.mask)
            b = ro.to_batch(tok.pad_token_id)
            # Real tokens one trainer pass over the batch computes (a shared prompt once per group): bench/ turns it into FLOPs.
            fed = b.attention_mask.sum() - (b.attention_mask[:, : b.response_start].sum() * (grp - 1) // grp if share else 0)
            b = b.shared(grp) if share else b  # one forward of each prompt for its n samples
            b = type(b)(*(x.to(rt.device) if torch.is_tensor(x) else x for x in b))
            tokens, gen_mask, infer_logp = ro.tokens.to(rt.device), ro.mask.to(rt.device), ro.infer_logp.to(rt.device)
            lengths = gen_mask.sum(-1)
            keep = rewarded
            if cfg.algo == "grpo":
                keep = rewarded & (rewarded.view(-1, plan["n"]).sum(-1, keepdim=True) >= 2).expand(-1, plan["n"]).reshape(-1)
            mask = gen_mask & keep[:, None]

        if init_head:  # the head starts as the constant mean reward of this first batch: EV 0, not the negative
            with torch.no_grad():  # EV of a random head's noise (N(0, 0.02) rows give values of std ~0.2 here)
                stats = all_reduce(torch.stack([scores.to(rt.device)[rewarded].sum(), rewarded.sum().float()]), dp_group)
                critic.score.weight.zero_()
                critic.score.bias.fill_((stats[0] / stats[1].clamp_min(1)).item())
            init_head = False

        # 3 recompute at the rollout weights: pi_old, V_old, pi_ref
        with timed(times, "recompute"), torch.no_grad():
            all_rows = torch.arange(len(tokens))
            lp = lambda model, r: response_logprobs(model, b, r, tokens, cfg)[0]  # noqa: E731
            old_logp = []
            for r in micro(all_rows, cfg, grp):
                old_logp.append(lp(policy, r))
                if b.routing is not None:  # MoE: how often the trainer's routers pick other experts than the engine's
                    add(m, moe.batch_flips(policy, b, r, gen_mask))
            old_logp = torch.cat(old_logp)
            ref_logp = torch.cat([lp(ref, r) for r in micro(all_rows, cfg, grp)]) if ref is not None else None
            old_values = torch.cat([response_values(critic, b, r, cfg) for r in micro(all_rows, cfg, grp)]) if critic is not None else None

        # 4 advantages
        with timed(times, "advantages"):
            rewards = token_rewards.to(rt.device)
            if cfg.kl == "k1-reward":
                rewards = rewards - cfg.kl_coef * L.kl_estimate(old_logp, ref_logp, "k1") * mask
            if cfg.algo == "ppo":
                _, returns = L.gae(rewards, old_values, mask, cfg.gamma, cfg.lam_critic)
                lam = L.length_adaptive_lambda(lengths, cfg.adaptive_lambda) if cfg.adaptive_lambda > 0 else cfg.lam_policy
                adv, _ = L.gae(rewards, old_values, mask, cfg.gamma, lam)
                if cfg.whiten_advantages:
                    adv = whiten(adv, mask, dp_group)
            else:
                adv = L.grpo_advantages((rewards * mask).sum(-1), plan["n"], cfg.grpo_std, valid=rewarded)[:, None] * mask

        # 5 mismatch correction: IcePop weights M(k) (or TIS / geo mask); DIS acts inside its loss
        with timed(times, "correction"):
            add(m, L.mismatch_metrics(old_logp, infer_logp, gen_mask, cfg.icepop_low, cfg.icepop_high))
            is_w, cm = None, {}
            if cfg.correction == "icepop":
                is_w, cm = L.icepop_weights(old_logp, infer_logp, mask, cfg.icepop_low, cfg.icepop_high)
            elif cfg.correction == "tis":
                is_w, cm = L.tis_weights(old_logp, infer_logp, mask, cap=cfg.tis_cap)
            elif cfg.correction == "geo":
                is_w, cm = L.geo_seq_mask(old_logp, infer_logp, mask, cfg.icepop_low, cfg.icepop_high)
            add(m, cm)
            # Dropped tokens stay in the denominator (IcePop paper) unless asked otherwise (verl's form).
            loss_mask = mask & (is_w > 0) if is_w is not None and cfg.drop_masked_from_denominator else mask

        # 6 critic updates (K passes), GAE(lambda_critic) returns as targets
        with timed(times, "critic"):
            for k in range(cfg.critic_updates if critic is not None else 0):
                for mb in minibatches(len(tokens), cfg, g, 1000 + k, grp):
                    denom = denominator(mask[mb], keep[mb], cfg, max_len, dp_group)
                    for r in micro(mb, cfg, grp):
                        # No value clipping while pretraining: the first values are the untrained head's.
                        clip = None if pretraining else cfg.value_clip or None
                        loss, vm = L.value_loss(response_values(critic, b, r, cfg), old_values[r], returns[r], mask[r], clip=clip,
                                                scale=cfg.value_scale, agg=cfg.agg, num_tokens=denom)
                        loss.backward()
                        add(m, vm)
                    norm, ok, weights_ok = optimizer_step(critic, opts["critic"], cfg, dp_group)
                    check_finite(ok, weights_ok, bad, "critic", where, norm, cfg)
                    add(m, {"critic/grad_norm": norm, "train/skipped_critic_update": float(not ok)})
            if critic is not None:  # of the values before this step's update: out of sample for this batch
                add(m, {"critic/explained_variance": L.explained_variance(old_values, returns, mask),
                        **L.explained_variance_by_position(old_values, returns, mask, width)})

        # 7 policy updates: PPO-clip (or DIS) with the correction's weights, global token denominator
        update_policy = not pretraining
        with timed(times, "policy"):
            for epoch in range(cfg.ppo_epochs if update_policy else 0):
                for mb in minibatches(len(tokens), cfg, g, epoch, grp):
                    denom = denominator(loss_mask[mb], keep[mb], cfg, max_len, dp_group)
                    for r in micro(mb, cfg, grp):
                        logp, ent = response_logprobs(policy, b, r, tokens, cfg, entropy=True)
                        if cfg.correction == "dis":
                            loss, pm = L.dis_policy_loss(logp, infer_logp[r], adv[r], loss_mask[r], eps_low=cfg.clip_low,
                                                         eps_high=cfg.clip_high, agg=cfg.agg, num_tokens=denom)
                        else:
                            loss, pm = L.ppo_policy_loss(logp, old_logp[r], adv[r], loss_mask[r], clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                                                         dual_clip=cfg.dual_clip or None, is_weights=None if is_w is None else is_w[r],
                                                         agg=cfg.agg, num_tokens=denom)
                        if cfg.kl == "k3-loss":
                            kl = L.aggregate(L.kl_estimate(logp, ref_logp[r], "k3"), loss_mask[r], cfg.agg, denom)
                            loss = loss + cfg.kl_coef * kl
                            pm["ppo/kl_ref"] = kl.detach()
                        loss.backward()
                        pm["ppo/entropy"] = L.masked_mean(ent, mask[r])
                        add(m, pm)
                    norm, ok, weights_ok = optimizer_step(policy, opts["policy"], cfg, dp_group)
                    check_finite(ok, weights_ok, bad, "policy", where, norm, cfg)
                    add(m, {"ppo/grad_norm": norm, "train/skipped_update": float(not ok)})

        # 8 weight sync: wake the engine, push the new full weights bucket by bucket (every TP rank gathers)
        with timed(times, "sync"):
            if engine is not None:
                engine.wake()
            if update_policy:
                push_weights(policy, engine)

        # 9 metrics, evaluation, checkpoint
        n_tok = lengths.sum()
        add(m, reward_metrics(sc, dp_group))
        add(m, {
            "rollout/response_len_mean": lengths.float().mean(),
            "rollout/response_len_max": lengths.max().float(), "rollout/tokens_per_s": n_tok * plan["dp"] / times["time/rollout"],  # dp engines run at once
            "rollout/truncated_frac": sum(f in ("length", "turn_length") for f in ro.finish_reasons) / len(ro.finish_reasons),
            # summed over dp ranks: reduce_metrics takes the mean over ranks, times dp is the sum (no extra collective)
            "train/tokens_per_pass": fed.float() * plan["dp"], "train/response_tokens": n_tok.float() * plan["dp"],
            **(episode_metrics(out) if play else {}),
        })
        if cfg.algo == "grpo":  # groups whose n rewards are all equal carry no GRPO signal
            groups = scores.view(-1, plan["n"])
            add(m, {"grpo/identical_reward_frac": (groups.amax(-1) == groups.amin(-1)).float().mean()})
        times["time/step"] = time.perf_counter() - t_step
        add(m, times)
        # On CUDA the largest phase peak (timed); on CPU the process's peak resident set (Linux ru_maxrss is in KiB).
        peaks = [v for k, v in times.items() if k.startswith("mem/")]
        add(m, {"mem/peak_gib_max": max(peaks) if peaks else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20})
        if pretraining:
            row = {"step": 0, "pretrain/step": pre + 1, **reduce_metrics(m)}
            evs.append(row["critic/explained_variance"])
            pre += 1
            plateau = ev_plateaued(evs)
            row["pretrain/done"] = float(plateau or pre == cfg.critic_pretrain)
            log.log(row)
            ev_window = _finite_mean(evs[-PLATEAU_WINDOW:])
            if rt.rank == 0 and (pre % 10 == 0 or row["pretrain/done"]):
                tqdm.write(f"critic pretraining {pre:3d} | vloss {row['critic/value_loss']:.4f} | ev {evs[-1]:.2f} | ev last {PLATEAU_WINDOW} {ev_window:.3f}")
            if row["pretrain/done"]:
                print0(f"critic pretraining stopped after {pre} steps ({'plateau' if plateau else 'step cap --critic-pretrain'}): "
                       f"mean explained variance of the last {PLATEAU_WINDOW} steps {ev_window:.3f}")
                save(0)
                pre = None
            continue
        row = {"step": step + 1, **reduce_metrics(m)}
        last = step + 1 == cfg.steps
        if (step + 1) % cfg.eval_every == 0 or last:
            if cfg.eval_dtype == "fp32":  # the fp32 copy gets the new weights only when it is used
                push_weights(policy, eval_engine)
            metrics, records = evaluate(eval_engine, tok, task, cfg, sampling, dp_rank, plan["dp"], play)
            row.update(metrics)
        log.log(row)
        if "eval/greedy_acc" in row:
            log.samples(step + 1, records)
        bar.update(1)
        bar.set_postfix(reward=f"{row['rollout/reward_mean']:.2f}", acc=f"{row.get('eval/greedy_acc', float('nan')):.2f}",
                        masked=f"{row['mismatch/masked_frac']:.2%}")
        if rt.rank == 0:
            tqdm.write(f"step {step + 1:4d} | reward {row['rollout/reward_mean']:.3f} | len {row['rollout/response_len_mean']:.1f}"
                       f" | masked {row['mismatch/masked_frac']:.3%} | k3 {row['mismatch/k3']:.2e}"
                       + (f" | vloss {row['critic/value_loss']:.4f} | ev {row['critic/explained_variance']:.2f}" if critic is not None else "")
                       + (f" | greedy acc {row['eval/greedy_acc']:.1%}" if "eval/greedy_acc" in row else "")
                       + f" | {row['time/step']:.2f}s")
        if "eval/greedy_acc" in row or last:
            log.plot()
        save_due = save_due or (step + 1) % cfg.save_every == 0
        if last or (save_due and not any(bad.values())):  # never mid-streak of skipped updates: see check_finite
            save(step + 1)
            save_due = False
        step += 1
    bar.close()
    if rt.rank == 0 and log.history:
        first, final = log.history[0], log.history[-1]
        if "eval/greedy_acc" in first and "eval/greedy_acc" in final:
            print(f"after RL ({cfg.steps} steps): greedy accuracy {first['eval/greedy_acc']:.1%} -> {final['eval/greedy_acc']:.1%}, "
                  f"sampled {first['eval/sampled_acc']:.1%} -> {final['eval/sampled_acc']:.1%}")
    for e in {id(x): x for x in (engine, eval_engine) if x is not None}.values():
        e.shutdown()
    return log.history


if __name__ == "__main__":
    import tyro

    main(tyro.cli(Config))
    if dist.is_initialized():
        dist.destroy_process_group()
