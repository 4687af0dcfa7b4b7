"""The trainer's forward passes over a step's batch, how the batch is split into minibatches and micro-batches, and
the optimiser step over them (the global loss denominator, the gradient sum over dp, the non-finite guard).

    logp, entropy = response_logprobs(policy, tb, rows, tokens, cfg, entropy=True)   # [b, T] each, response tokens only
    values = response_values(critic, tb, rows, cfg)                                  # [b, T], V before each response token
    ctb = critic_batch(ro, context_ids("answer", tok, task_rows, out, n), pad_id, n)  # --critic-context: the critic's own batch

The policy's log-probs never materialise [b, L, V] logits: the LM head is swapped for a stand-in inside the model's own
forward (where FSDP gathers the weights) that keeps only the response columns and runs losses.head_logprobs on them.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import losses
import moe
from config import Config
from parallel import all_reduce, all_reduce_grads, clip_grad_norm_
from agent import Episodes
from rollout import Rollout, TrainBatch
from checkpoint import latest_checkpoint
from value_model import critic_values


def minibatches(rows: int, cfg: Config, index: int, epoch: int, n: int = 1) -> list[torch.Tensor]:
    """Shuffled row indices per minibatch, whole groups of n consecutive rows kept together (shared prefixes); the
    same on TP peers (same seed), which see the same rows."""
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + index * 101 + epoch)
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


def sequences(b: TrainBatch, rows):
    """The forward's inputs for rows (whole groups, in order, when the batch shares prefixes: TrainBatch.shared)."""
    n = b.group
    if n > 1 and (
        len(rows) % n or (rows[::n] % n).any() or not torch.equal(rows, (rows[::n, None] + torch.arange(n)).reshape(-1))
    ):
        raise ValueError(f"rows {rows.tolist()} are not whole groups of {n}")
    sel = rows[::n] // n
    return {"input_ids": b.input_ids[sel], "attention_mask": b.attention_mask[sel], "position_ids": b.position_ids[sel]}


def response_logprobs(model, b: TrainBatch, rows, tokens: torch.Tensor, cfg: Config, entropy: bool = False):
    """(log-probs [b, T], entropy [b, T] or None) of the response tokens of rows. The forward keeps only the columns that
    predict response tokens (TrainBatch.keep, logits_to_keep), and the LM head runs on them chunk by chunk
    (losses.head_logprobs): no [b, L, V] or [b, T, V] logits exist. Under --train-dtype bf16 the forward runs in bf16
    autocast over fp32 weights. --routing-replay: an MoE forward uses the engine's experts (TrainBatch.routing)."""
    out = {}

    def logprobs(h):  # [sequences, len(keep), H] -> one row per response
        out["logp"], out["entropy"] = losses.head_logprobs(
            head,
            h.reshape(len(rows), tokens.size(1), h.size(-1)),
            tokens[rows],
            cfg.temperature,
            top_k=cfg.top_k,
            top_p=cfg.top_p,
            entropy=entropy,
        )
        return out["logp"]

    replay = moe.batch_routes(b, rows) if cfg.routing_replay else None
    with (
        head_replaced(model, logprobs) as head,
        moe.routing(model, replay),
        torch.autocast(b.input_ids.device.type, torch.bfloat16, enabled=cfg.train_dtype == "bf16"),
    ):
        model(**sequences(b, rows), logits_to_keep=b.keep)
    return out["logp"], out["entropy"]


def response_values(critic, b: TrainBatch, rows, cfg: Config):
    """Values [b, T] float32: V of the state before each response token (the columns of response_logprobs)."""
    with torch.autocast(b.input_ids.device.type, torch.bfloat16, enabled=cfg.train_dtype == "bf16"):
        return critic_values(critic, **sequences(b, rows))[:, b.keep].reshape(len(rows), -1)


# --critic-context answer: the text before the prompt in the critic's input (bench/value_fit.py uses it too)
ANSWER_CONTEXT = "Reference answer: {}\n"


def context_ids(kind: str, tok, task_rows, out, n: int) -> list[list[int]]:
    """The critic-only prefix of each training row, token ids (add_special_tokens=False). kind "answer":
    ANSWER_CONTEXT with the reference answer of the row's task row (rows are task row b // n; with episodes, the row's
    episode // n); "env": the string its episode's environment returned from critic_context() (agent.Episodes), the
    same on every row of a compacted episode."""
    episode = out.episode if isinstance(out, Episodes) else range(len(out.tokens))
    if kind == "answer":
        texts = [ANSWER_CONTEXT.format(task_rows[e // n]["answer"]) for e in episode]
    elif kind == "env":
        if not isinstance(out, Episodes) or any(out.critic_context[e] is None for e in episode):
            raise ValueError(
                "--critic-context env: the environment gave no critic_context() string (it needs the method)"
            )
        texts = [out.critic_context[e] for e in episode]
    else:
        raise ValueError(f"context_ids: unknown kind {kind!r} (answer or env)")
    return [tok(t, add_special_tokens=False).input_ids for t in texts]


def critic_batch(ro: Rollout, prefixes: list[list[int]], pad_id: int, n: int = 1) -> TrainBatch:
    """The critic's TrainBatch under --critic-context: row b's prompt is prefixes[b] + its prompt, the response block
    as in ro.to_batch (the same T columns, so response_values reads V before each response token exactly as on the
    policy's batch; only P grows). n > 1: each group of n rows shares one sequence (TrainBatch.shared) when the group's
    prefixes agree (answer: one prompt, one answer); otherwise (env: each episode its own string) per-row sequences,
    which give the same values. MoE routing is dropped (the critic never replays it)."""
    if len(prefixes) != len(ro.prompt_ids):
        raise ValueError(f"critic_batch: {len(prefixes)} prefixes for {len(ro.prompt_ids)} rows")
    tb = dataclasses.replace(
        ro, prompt_ids=[list(c) + list(p) for c, p in zip(prefixes, ro.prompt_ids)], routing=None
    ).to_batch(pad_id)
    same = all(prefixes[b] == prefixes[b - b % n] for b in range(len(prefixes)))
    return tb.shared(n) if n > 1 and same else tb


def check_head(model) -> None:
    """response_logprobs replaces the LM head's output: refuse a model whose forward changes what the head returns
    (a logit softcap or scale would be silently dropped)."""
    sentinel = torch.zeros(1, 1, 1, device=model.device)
    with torch.no_grad(), head_replaced(model, lambda h: sentinel):
        returned = model(input_ids=torch.zeros(1, 2, dtype=torch.long, device=model.device)).logits
    if returned is not sentinel:
        raise ValueError(
            f"--model: {type(model).__name__}'s forward post-processes the LM head's output (a logit softcap or "
            "scale?), which the trainer's response-only log-probs would drop"
        )


# ----------------------------------------------------------------------------- denominators and optimiser steps


def denominator(loss_mask: torch.Tensor, keep_rows: torch.Tensor, cfg: Config, max_len: int, group) -> torch.Tensor:
    """losses.loss_denominator of a minibatch over its kept (rewarded) rows only, so a row without a reward leaves
    N_seq as well as N_tok; summed over dp ranks, at least 1 (a minibatch with nothing to learn has loss 0)."""
    return all_reduce(losses.loss_denominator(loss_mask[keep_rows], cfg.agg, max_len), group).clamp_min(1)


def optimizer_step(model, opt, cfg: Config, dp_group) -> tuple[torch.Tensor, bool, bool]:
    """Sum gradients over dp, clip, step unless the gradient is non-finite (then skip). Returns (grad norm,
    stepped, weights finite after it). Same decisions on all ranks: the norm is of the reduced, global gradient."""
    all_reduce_grads(model, dp_group)
    norm = clip_grad_norm_([p for p in model.parameters() if p.requires_grad], cfg.max_grad_norm)
    ok = bool(torch.isfinite(norm))
    weights_ok = True
    if ok:
        opt.step()
        local = torch.stack(
            [torch.isfinite(p.to_local() if isinstance(p, DTensor) else p).all() for p in model.parameters()]
        ).all()
        weights_ok = bool(all_reduce(local.float(), op=dist.ReduceOp.MIN))  # TP ranks hold different shards
    opt.zero_grad(set_to_none=True)
    return norm.detach(), ok, weights_ok


def check_finite(
    ok: bool, weights_ok: bool, bad: dict[str, int], what: str, where: str, norm: torch.Tensor, cfg: Config
) -> None:
    """Count each model's consecutive skipped (non-finite) updates in bad[what]; stop the run after max_bad_steps
    of them, or at once if an update left non-finite weights (it cannot be undone). No checkpoint is written
    while a streak lasts, so the last one on disk predates the trouble and resumes with a new --lr."""
    bad[what] = 0 if ok else bad[what] + 1
    if not ok:
        print(f"{where}: skipped a {what} update with a non-finite loss or gradient (norm {norm.item()})", flush=True)
    if weights_ok and bad[what] < cfg.max_bad_steps:
        return
    why = (
        f"the {what} update made its weights non-finite (grad norm {norm.item()})"
        if not weights_ok
        else f"{bad[what]} consecutive {what} updates had a non-finite loss or gradient (last grad norm {norm.item()})"
    )
    last = latest_checkpoint(cfg.out_dir, cfg.algo)
    raise RuntimeError(
        f"{where}: {why}. Nothing was saved after the trouble began: lower --{'lr' if what == 'policy' else 'critic-lr'} "
        f"or check the rewards, and {'resume from ' + last + ' (rerun with the same --out-dir)' if last else 'start again'}"
    )
