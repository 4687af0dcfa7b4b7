"""The trainer's forward passes over a step's batch, and how the batch is split into minibatches and micro-batches.

    logp, entropy = response_logprobs(policy, tb, rows, tokens, cfg, entropy=True)   # [b, T] each, response tokens only
    values = response_values(critic, tb, rows, cfg)                                  # [b, T], V before each response token

The policy's log-probs never materialise [b, L, V] logits: the LM head is swapped for a stand-in inside the model's own
forward (where FSDP gathers the weights) that keeps only the response columns and runs losses.head_logprobs on them.
"""

from __future__ import annotations

import contextlib

import torch

import losses
import moe
from config import Config
from rollout import TrainBatch
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
    if n > 1 and (len(rows) % n or (rows[::n] % n).any() or not torch.equal(rows, (rows[::n, None] + torch.arange(n)).reshape(-1))):
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
        out["logp"], out["entropy"] = losses.head_logprobs(head, h.reshape(len(rows), tokens.size(1), h.size(-1)), tokens[rows], cfg.temperature,
                                                           top_k=cfg.top_k, top_p=cfg.top_p, entropy=entropy)
        return out["logp"]
    replay = moe.batch_routes(b, rows) if cfg.routing_replay else None
    with (head_replaced(model, logprobs) as head, moe.routing(model, replay),
          torch.autocast(b.input_ids.device.type, torch.bfloat16, enabled=cfg.train_dtype == "bf16")):
        model(**sequences(b, rows), logits_to_keep=b.keep)
    return out["logp"], out["entropy"]


def response_values(critic, b: TrainBatch, rows, cfg: Config):
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
