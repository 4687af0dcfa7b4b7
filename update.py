"""How a phase's loss becomes an optimiser update: the minibatch and micro-batch split, the global loss denominator,
and the optimiser step (the gradient sum over dp, clipping, the non-finite guard).

    for mb in minibatches(len(rows), count=2, seed=0, index=step, epoch=0, n=group):
        denom = denominator(mask[mb], keep_rows[mb], "token-mean", max_len, dp_group)   # before micro-batching
        for r in micro(mb, size=8, n=group):
            loss = ...(num_tokens=denom); loss.backward()                              # gradient accumulation
        norm, ok, weights_ok = optimizer_step(model, opt, max_grad_norm=1.0, dp_group=dp_group)

The denominator is the minibatch's global token (or sequence) count, computed before the micro-batch split and summed
over dp ranks, so gradient accumulation over micro-batches and ranks equals one large batch.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import losses
from parallel import all_reduce, all_reduce_grads, clip_grad_norm_


def minibatches(rows: int, count: int, seed: int, index: int, epoch: int, n: int = 1) -> list[torch.Tensor]:
    """Shuffled row indices of `count` minibatches (--minibatches), whole groups of n consecutive rows kept together
    (shared prefixes); the same on TP peers (the same seed), which see the same rows. index: the batch's step; epoch:
    the pass over it. Always `count` parts: a rank with fewer rows (compaction) still joins every minibatch's
    collectives, with an empty part if need be."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + index * 101 + epoch)
    parts = torch.randperm(rows // n, generator=g).tensor_split(count)
    return [(p[:, None] * n + torch.arange(n)).reshape(-1) for p in parts]


def micro(idx: torch.Tensor, size: int, n: int = 1) -> list[torch.Tensor]:
    """idx in micro-batches of about `size` rows (--micro-batch), whole groups of n."""
    return list(idx.split(max(n, size // n * n)))


def denominator(loss_mask: torch.Tensor, keep_rows: torch.Tensor, agg: str, max_len: int, group) -> torch.Tensor:
    """losses.loss_denominator of a minibatch over its kept (rewarded) rows only, so a row without a reward leaves
    N_seq as well as N_tok; summed over dp ranks, at least 1 (a minibatch with nothing to learn has loss 0)."""
    return all_reduce(losses.loss_denominator(loss_mask[keep_rows], agg, max_len), group).clamp_min(1)


def optimizer_step(model, opt, max_grad_norm: float, dp_group) -> tuple[torch.Tensor, bool, bool]:
    """Sum gradients over dp, clip to max_grad_norm, step unless the gradient is non-finite (then skip). Returns (grad
    norm, stepped, weights finite after it). Same decisions on all ranks: the norm is of the reduced, global gradient."""
    all_reduce_grads(model, dp_group)
    norm = clip_grad_norm_([p for p in model.parameters() if p.requires_grad], max_grad_norm)
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
    ok: bool,
    weights_ok: bool,
    bad: dict[str, int],
    what: str,
    where: str,
    norm: torch.Tensor,
    *,
    max_bad_steps: int,
    find_checkpoint: Callable[[], str | None],
) -> None:
    """Count each model's consecutive skipped (non-finite) updates in bad[what]; stop the run after max_bad_steps
    of them, or at once if an update left non-finite weights (it cannot be undone). No checkpoint is written
    while a streak lasts, so the last one on disk predates the trouble and resumes with a new --lr: the error names it
    (find_checkpoint() finds it, asked only when the run stops)."""
    bad[what] = 0 if ok else bad[what] + 1
    if not ok:
        print(f"{where}: skipped a {what} update with a non-finite loss or gradient (norm {norm.item()})", flush=True)
    if weights_ok and bad[what] < max_bad_steps:
        return
    if not weights_ok:
        why = f"the {what} update made its weights non-finite (grad norm {norm.item()})"
    else:
        why = f"{bad[what]} consecutive {what} updates had a non-finite loss or gradient (last grad norm {norm.item()})"
    flag = "--lr" if what == "policy" else "--critic-lr"
    last = find_checkpoint()
    then = f"resume from {last} (rerun with the same --out-dir)" if last else "start again"
    raise RuntimeError(
        f"{where}: {why}. Nothing was saved after the trouble began: lower {flag} or check the rewards, and {then}"
    )
