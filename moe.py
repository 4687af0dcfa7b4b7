"""Mixture-of-experts support for the trainer: routing record and replay, router-flip metrics, experts over TP ranks.

The Qwen3-MoE family (Hugging Face ``qwen3_moe``): each MoE layer's router is a Linear(hidden, E) whose softmax picks
the top-k experts of every token (``norm_topk_prob``: the k weights renormalised to sum 1); the experts are stored
fused, ``experts.gate_up_proj`` [E, 2I, H] and ``experts.down_proj`` [E, H, I] (checkpoints on disk hold them per
expert; transformers converts on load and save).

    moe.install(policy)                       # once: the routers record their choice and can replay one
    with moe.routing(policy, replay=r):       # r [tokens, layers, k] long, -1 = the router's own choice
        policy(**batch)
    chosen = moe.chosen(policy)               # [tokens, layers, k]: what the trainer's routers picked
    moe.flip_metrics(engine_routing, chosen)   # the share of tokens routed differently, per layer and overall

Routing replay (R3, arXiv 2510.11370): the forward uses the experts the rollout engine chose for each token, while
the gate weights are the trainer's own softmax at those experts (renormalised like the router's), so the router still
gets a gradient. With an fp32 engine and the same weights the replayed forward is the engine's; where the trainer's
router would pick other experts, only its gate weights still differ from the engine's (tests/test_moe.py).

Tensor parallelism (``shard_experts``): experts are placed per rank (rank r of tp holds experts r E / tp ..
(r + 1) E / tp - 1 as a Shard(0) DTensor, so weight sync and checkpoints gather full tensors); the router is
replicated. Every rank routes every token, runs its own experts on the tokens routed to them, and the partial
outputs are summed over the tp ranks (Megatron's f / g pair: identity forward with an all-reduced backward on the
inputs and gate weights, an all-reduce forward with an identity backward on the output).

The auxiliary load-balancing loss is not used: the trainer never asks for router logits (``output_router_logits``
stays False), as RL recipes on MoE models leave the router's balance to pretraining.
"""

from __future__ import annotations

import contextlib
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn


def is_moe(config) -> bool:
    return getattr(config, "num_experts", 0) > 0 and getattr(config, "model_type", "") == "qwen3_moe"


def blocks(model: nn.Module) -> list[nn.Module]:
    """The MoE blocks (modules with a ``gate`` router and ``experts``), in layer order."""
    return [m for m in model.modules() if hasattr(m, "gate") and hasattr(m, "experts") and hasattr(m.gate, "top_k")]


def _route(self, hidden_states: Tensor):
    """Qwen3MoeTopKRouter.forward, plus: record the own top-k in ``_chosen``; replay ``_replay`` where it is >= 0."""
    h = hidden_states.reshape(-1, self.hidden_dim)
    logits = F.linear(h, self.weight)
    probs = torch.softmax(logits, dtype=torch.float, dim=-1)
    top, idx = torch.topk(probs, self.top_k, dim=-1)
    self._chosen = idx.detach()
    if self._replay is not None:
        if self._replay.shape != idx.shape:
            raise ValueError(
                f"routing replay: {tuple(self._replay.shape)} recorded choices for {tuple(idx.shape)} routed tokens"
            )
        idx = torch.where((self._replay >= 0).all(-1, keepdim=True), self._replay, idx)
        top = probs.gather(-1, idx)
    if self.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top.to(logits.dtype), idx


def sparse_block(
    h: Tensor,
    router: Tensor,
    w1: Tensor,
    w2: Tensor,
    k: int,
    norm: bool,
    routes: list | None,
    flip: tuple[float, torch.Generator] | None = None,
) -> Tensor:
    """The embedded engine's Qwen3-MoE block, as HF computes it: fp32 softmax, top-k, renormalised if ``norm``, experts
    in order; appends the experts [..., k] to ``routes`` when given. flip = (q, generator), the lab's heavy-tailed
    mismatch knob (--moe-flip): each token's k-th expert is swapped for the (k+1)-th best with probability q (one
    uniform per token from the generator), its gate weight with it, as a near-tie at the top-k boundary would."""
    flat = h.reshape(-1, h.size(-1))
    probs = torch.softmax(F.linear(flat, router), dtype=torch.float, dim=-1)
    top, idx = torch.topk(probs, k + 1 if flip else k, dim=-1)
    if flip:
        hit = (torch.rand(len(flat), generator=flip[1], device=flat.device) < flip[0])[:, None]
        top, idx = (torch.cat([x[:, : k - 1], torch.where(hit, x[:, k:], x[:, k - 1 : k])], -1) for x in (top, idx))
    if norm:
        top = top / top.sum(-1, keepdim=True)
    top = top.to(flat.dtype)
    out = torch.zeros_like(flat)
    for e in idx.unique().tolist():
        tok, slot = torch.where(idx == e)
        gate, up = F.linear(flat[tok], w1[e]).chunk(2, dim=-1)
        out.index_add_(0, tok, F.linear(F.silu(gate) * up, w2[e]) * top[tok, slot, None])
    if routes is not None:
        routes.append(idx.view(*h.shape[:-1], -1))
    return out.view_as(h)


def batch_routes(b, rows) -> Tensor:
    """The engine's experts [positions, layers, k] of a TrainBatch's forward over rows (train_ppo.sequences order)."""
    return b.routing[rows[:: b.group] // b.group].flatten(0, 1)


def batch_flips(model: nn.Module, b, rows, gen_mask: Tensor) -> dict[str, Tensor]:
    """flip_metrics of the last forward over rows' sampled tokens, each at the column that predicts it."""

    def at_keep(r):
        return r.view(-1, b.input_ids.size(1), *r.shape[1:])[:, b.keep].reshape(len(rows), -1, *r.shape[1:])

    engine, own = at_keep(batch_routes(b, rows)), at_keep(chosen(model))
    valid = gen_mask[rows] & (engine >= 0).all(-1).all(-1)
    return flip_metrics(engine[valid], own[valid])


def install(model: nn.Module) -> nn.Module:
    """Give every router of ``model`` the recording / replaying forward (numerically the HF one without replay)."""
    for b in blocks(model):
        b.gate.forward = types.MethodType(_route, b.gate)
        b.gate._chosen = None
        b.gate._replay = None
    return model


@contextlib.contextmanager
def routing(model: nn.Module, replay: Tensor | None = None):
    """Run forwards of ``model`` (installed) replaying ``replay`` [tokens, layers, k] (None: the routers' own choice).
    Tokens are the forward's positions in order (rows x columns, flattened)."""
    bs = blocks(model)
    if replay is not None and replay.size(1) != len(bs):
        raise ValueError(f"routing replay: choices for {replay.size(1)} layers, the model has {len(bs)} MoE layers")
    for i, b in enumerate(bs):
        b.gate._replay = None if replay is None else replay[:, i].to(b.gate.weight.device)
    try:
        yield
    finally:
        for b in bs:
            b.gate._replay = None


def chosen(model: nn.Module) -> Tensor:
    """[tokens, layers, k]: the experts each router picked in the last forward (before any replay)."""
    return torch.stack([b.gate._chosen for b in blocks(model)], 1)


def flip_metrics(engine: Tensor, trainer: Tensor) -> dict[str, Tensor]:
    """Router flips between engine and trainer choices [tokens, layers, k]: moe/flip_frac (token-layer pairs whose
    top-k *sets* differ), moe/flip_any_layer_frac (tokens with a differing set in at least one layer),
    moe/flip_frac_layer{i}. Empty for no tokens."""
    differ = (engine.sort(-1).values != trainer.sort(-1).values).any(-1).float()  # [tokens, layers]
    if differ.numel() == 0:
        return {}
    return {
        "moe/flip_frac": differ.mean(),
        "moe/flip_any_layer_frac": differ.amax(-1).mean(),
        **{f"moe/flip_frac_layer{i}": d for i, d in enumerate(differ.mean(0))},
    }


def checkpoint_tensors(name: str, t: Tensor) -> list[tuple[str, Tensor]]:
    """A trainer tensor under the names of the checkpoint on disk (what SGLang loads): fused experts split per expert
    (``experts.gate_up_proj`` [E, 2I, H] -> ``experts.{e}.gate_proj.weight`` [I, H] and ``up_proj``; ``down_proj`` ->
    ``experts.{e}.down_proj.weight``); any other tensor as it is."""
    prefix, _, leaf = name.rpartition(".experts.")
    if leaf == "gate_up_proj":
        i = t.size(1) // 2
        return [
            (f"{prefix}.experts.{e}.{part}.weight", w)
            for e in range(t.size(0))
            for part, w in (("gate_proj", t[e, :i]), ("up_proj", t[e, i:]))
        ]
    if leaf == "down_proj":
        return [(f"{prefix}.experts.{e}.down_proj.weight", t[e]) for e in range(t.size(0))]
    return [(name, t)]


# ----------------------------------------------------------------------------- experts over tensor-parallel ranks


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


def _local_experts(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    """Qwen3MoeExperts.forward over this rank's experts, summed over the tp ranks (the HF loop: experts in order)."""
    w1, w2 = self.gate_up_proj.to_local(), self.down_proj.to_local()
    group = self._tp_group
    first = self._first_expert
    x, w = _CopyToTP.apply(hidden_states, group), _CopyToTP.apply(top_k_weights, group)
    out = torch.zeros_like(x)
    for e in range(w1.size(0)):
        tok, slot = torch.where(top_k_index == first + e)
        if len(tok):
            gate, up = F.linear(x[tok], w1[e]).chunk(2, dim=-1)
            y = F.linear(self.act_fn(gate) * up, w2[e]) * w[tok, slot, None]
            out = out.index_add(0, tok, y.to(out.dtype))
    return _ReduceFromTP.apply(out, group)


def shard_experts(model: nn.Module, tp_mesh) -> None:
    """Place each MoE layer's experts over the ranks of ``tp_mesh`` (Shard(0) over the expert dimension)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    tp = tp_mesh.size()
    for b in blocks(model):
        ex = b.experts
        if ex.num_experts % tp:
            raise ValueError(f"tensor parallelism: num_experts={ex.num_experts} is not divisible by tp={tp}")
        for name in ("gate_up_proj", "down_proj"):
            p = getattr(ex, name)
            sharded = distribute_tensor(p.data, tp_mesh, [Shard(0)])
            setattr(ex, name, nn.Parameter(sharded, requires_grad=p.requires_grad))
        ex._tp_group = tp_mesh.get_group()
        ex._first_expert = tp_mesh.get_local_rank() * (ex.num_experts // tp)
        ex.forward = types.MethodType(_local_experts, ex)
