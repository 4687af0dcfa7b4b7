"""The trainer's forward passes over a step's batch: the policy's response-only log-probs and the critic's values.

    fwd = Forward(temperature=1.0, top_k=0, top_p=1.0, bf16=False)
    logp, entropy = response_logprobs(policy, tb, rows, tokens, fwd, entropy=True)  # [b, T] each, response tokens only
    values = response_values(critic, tb, rows, bf16=False)                         # [b, T], V before each response token

The policy's log-probs never materialise [b, L, V] logits: the LM head is swapped for a stand-in inside the model's own
forward (where FSDP gathers the weights) that keeps only the response columns and runs logprobs.head_logprobs on them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

import logprobs
import moe
from rollout import TrainBatch
from value_model import critic_values


@dataclass(frozen=True)
class Forward:
    """How the trainer's forwards run: the sampling transform its log-probs apply (the engine's --temperature, --top-k,
    --top-p), bf16 autocast over fp32 weights (--train-dtype bf16), and MoE routing replay (--routing-replay)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    bf16: bool = False
    routing_replay: bool = False


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
    if n > 1:
        groups = (rows[::n, None] + torch.arange(n)).reshape(-1)  # each group start with its n - 1 followers
        if len(rows) % n or (rows[::n] % n).any() or not torch.equal(rows, groups):
            raise ValueError(f"rows {rows.tolist()} are not whole groups of {n}")
    sel = rows[::n] // n
    return {"input_ids": b.input_ids[sel], "attention_mask": b.attention_mask[sel], "position_ids": b.position_ids[sel]}


def response_logprobs(model, b: TrainBatch, rows, tokens: torch.Tensor, fwd: Forward, entropy: bool = False):
    """(log-probs [b, T], entropy [b, T] or None) of the response tokens of rows. The forward keeps only the columns that
    predict response tokens (TrainBatch.keep, logits_to_keep), and the LM head runs on them chunk by chunk
    (logprobs.head_logprobs): no [b, L, V] or [b, T, V] logits exist. Under --train-dtype bf16 the forward runs in bf16
    autocast over fp32 weights. --routing-replay: an MoE forward uses the engine's experts (TrainBatch.routing)."""
    out = {}

    def response_head(h):  # [sequences, len(keep), H] -> one row per response
        out["logp"], out["entropy"] = logprobs.head_logprobs(
            head,
            h.reshape(len(rows), tokens.size(1), h.size(-1)),
            tokens[rows],
            fwd.temperature,
            top_k=fwd.top_k,
            top_p=fwd.top_p,
            entropy=entropy,
        )
        return out["logp"]

    replay = moe.batch_routes(b, rows) if fwd.routing_replay else None
    with (
        head_replaced(model, response_head) as head,
        moe.routing(model, replay),
        torch.autocast(b.input_ids.device.type, torch.bfloat16, enabled=fwd.bf16),
    ):
        model(**sequences(b, rows), logits_to_keep=b.keep)
    return out["logp"], out["entropy"]


def response_values(critic, b: TrainBatch, rows, bf16: bool = False):
    """Values [b, T] float32: V of the state before each response token (the columns of response_logprobs); bf16:
    under bf16 autocast."""
    with torch.autocast(b.input_ids.device.type, torch.bfloat16, enabled=bf16):
        return critic_values(critic, **sequences(b, rows))[:, b.keep].reshape(len(rows), -1)


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
