"""The rollout engines' interface: sampling settings, the rollout records, the engine protocol, and the weight push.

    engine = EmbeddedEngine("path/to/policy", dtype="fp32", device="cpu")   # embedded_engine.py (or sglang_engine.py)
    ro = engine.generate([[5, 7, 9], [5, 8]], Sampling(temperature=1.0, max_new_tokens=32, n=4, stop_token_ids=(2,)))
    b = ro.to_batch(pad_id=0)                        # the trainer's sequences (TrainBatch)
    engine.sleep()                                   # free the KV cache (on CUDA also the weights)
    ...                                              # train the policy
    engine.wake(); engine.update_weights(policy.named_parameters())

Alignment, stated once: a `Rollout` holds response tokens as [B, T] right-padded tensors with a bool
`mask` (True on generated tokens, the stop token included), the convention of losses.py. `to_batch`
left-pads the prompts to a common length P and appends the responses, so the response block of every
row starts at column P, and the model's outputs at columns `b.keep` = P - 1 .. P + T - 2 predict the
response tokens: log-probs [B, T] aligned with ro.infer_logp (forward.response_logprobs).

The engines are embedded_engine.EmbeddedEngine (the default) and sglang_engine.SGLangEngine; the trainer gets its
engine from build.make_engine and pushes the policy's weights with `push_weights`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, NamedTuple, Protocol

import torch
from torch import Tensor

from parallel import full_weights


@dataclass
class Sampling:
    """How to sample. The engine samples from softmax(logprobs.process_logits(logits, temperature, top_k, top_p))."""

    temperature: float = 1.0
    """Softmax temperature, > 0."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 = off."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1.0 = off."""
    max_new_tokens: int = 32
    """Response budget per row; a row that hits it finishes with "length"."""
    stop_token_ids: tuple[int, ...] = ()
    """A row stops at any of these; the stop token is part of the response (finish "stop")."""
    n: int = 1
    """Samples per prompt; the n rows of a prompt are contiguous in the output."""
    seed: int = 0
    """Row r of a generate call (prompt r // n, sample r % n) draws from seed + r, whatever the rest of the
    batch: same seed, same weights, same output, and a batch split over several calls (data-parallel ranks)
    gives the same rows when each call's seed is offset by its first row's index."""
    seeds: tuple[int, ...] = ()
    """Per-row seeds, one per output row, used instead of seed + r (the multi-turn driver gives each episode's turn its
    own seed, whichever episodes share the call); () = seed + r."""

    def __post_init__(self):
        self.stop_token_ids = tuple(self.stop_token_ids)
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(f"Sampling.temperature must be a finite number > 0, got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"Sampling.top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"Sampling.top_p must be in (0, 1] (1.0 = off), got {self.top_p}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"Sampling.max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"Sampling.n must be an int >= 1, got {self.n!r}")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"Sampling.stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        if not isinstance(self.seed, int):
            raise ValueError(f"Sampling.seed must be an int, got {self.seed!r}")
        self.seeds = tuple(self.seeds)
        if not all(isinstance(x, int) for x in self.seeds):
            raise ValueError(f"Sampling.seeds must be ints, got {self.seeds!r}")

    def row_seed(self, r: int) -> int:
        """The seed of output row r."""
        return self.seeds[r] if self.seeds else self.seed + r


class TrainBatch(NamedTuple):
    """Full sequences for the trainer's forwards; see the module docstring for the alignment. One sequence per row,
    or after ``shared(n)`` one per group of n rows: the group's prompt once, then its n responses one after another."""

    input_ids: Tensor  # [B, P + T] long: left-padded prompt, response, right padding (shared: [B / n, P + n T])
    # [B, P + T] long: 1 on prompt and response tokens (shared: [B / n, 1, S, S] bool, True = attend)
    attention_mask: Tensor
    position_ids: Tensor  # [B, P + T] long: 0 at each row's first real token (what the engine used)
    response_start: int  # P: column of the first response token in every row
    keep: Tensor  # [T] (shared: [n T]) long: the columns whose hidden states predict the response tokens, row by row
    group: int = 1  # rows per sequence
    routing: Tensor | None = None  # [B, P + T, layers, k] long: an MoE engine's experts per column (Rollout.routing)

    def shared(self, n: int) -> TrainBatch:
        """Each group of n consecutive rows (one prompt's samples) as one sequence: the prompt's P columns, then the n
        responses' T columns each. Response i attends the prompt and its own earlier tokens only (a block mask; SDPA),
        at the positions of its own row, so every output equals the per-row batch's; the prompt is computed once."""
        B, S = self.input_ids.shape
        P = self.response_start
        T, G = S - P, B // n
        ids, am, pos = (x[: G * n].view(G, n, S) for x in (self.input_ids, self.attention_mask, self.position_ids))
        if B % n or not ((ids[:, :, :P] == ids[:, :1, :P]) & (am[:, :, :P] == am[:, :1, :P])).all():
            raise ValueError(
                f"TrainBatch.shared({n}): the {B} rows are not groups of {n} consecutive rows with one prompt each"
            )

        def flat(x):
            return torch.cat([x[:, 0, :P], x[:, :, P:].reshape(G, n * T, *x.shape[3:])], 1)

        input_ids, position_ids, real = map(flat, (ids, pos, am))
        routing = None if self.routing is None else flat(self.routing[: G * n].view(G, n, S, *self.routing.shape[2:]))
        col = torch.arange(P + n * T, device=ids.device)
        seg = (col - P).div(T, rounding_mode="floor").clamp_min(-1)  # -1 = prompt, i = response i
        # Causal, keys in the prompt or the query's own response; padding attends itself (no empty row: SDPA NaNs).
        block = (col[None, :] <= col[:, None]) & ((seg[None, :] < 0) | (seg[None, :] == seg[:, None]))  # [query, key]
        mask = (block[None] & real.bool()[:, None, :]) | torch.eye(len(col), dtype=torch.bool, device=ids.device)
        keep = P - 1 + torch.arange(n * T, device=ids.device)  # response token j <- the column before it
        keep[::T] = P - 1  # every response's first token is predicted by the last prompt column
        return TrainBatch(input_ids, mask[:, None], position_ids, P, keep, n, routing)


@dataclass
class Rollout:
    """The output of `generate`: B = len(prompts) * n rows, T = the longest response; tensors on CPU."""

    tokens: Tensor
    """[B, T] long response tokens, right-padded with 0 (mask tells which are real)."""
    infer_logp: Tensor
    """[B, T] float32 log-prob of each sampled token under the distribution it was drawn from; 0 on padding."""
    mask: Tensor
    """[B, T] bool, True on generated tokens (the stop token included)."""
    prompt_ids: list[list[int]]
    """One prompt per row (a prompt repeats n times)."""
    finish_reasons: list[str]
    """Per row: "stop" (emitted a stop token) or "length" (hit max_new_tokens); the multi-turn driver (agent.py)
    gives the episode's reason instead."""
    attend: Tensor | None = None
    """[B, T] bool, True on every real response token: model tokens and, in multi-turn rows (agent.py), the
    observation tokens between them, which the trainer attends to but never trains (mask is False there,
    infer_logp 0). None = mask (single-turn: every real token is a model token)."""
    routing: Tensor | None = None
    """MoE engines: [B, P + T, layers, k] long, the experts each layer chose for the token at each column of
    to_batch's layout (P = the longest prompt), -1 where no token was routed (padding, the last response token,
    which is never fed back). None for dense models and multi-turn rows."""

    @classmethod
    def from_ragged(
        cls,
        tokens: list,
        prompt_ids: list[list[int]],
        finish_reasons: list[str],
        *,
        infer_logp: list | None = None,
        model: list | None = None,
    ) -> Rollout:
        """Per-row lists (or 1-D tensors) of response tokens and their log-probs (None: 0), right-padded to the longest
        row. model: per row and token, True on model tokens (multi-turn rows: `mask`; every real token is `attend`);
        None: every token is a model token."""

        def pad(rows, dtype):
            return torch.nn.utils.rnn.pad_sequence([torch.as_tensor(r, dtype=dtype) for r in rows], batch_first=True)

        toks = pad(tokens, torch.long)
        real = pad([torch.ones(len(t), dtype=torch.bool) for t in tokens], torch.bool)
        logp = torch.zeros(toks.shape) if infer_logp is None else pad(infer_logp, torch.float32)
        mask = real if model is None else pad(model, torch.bool)
        attend = None if model is None else real
        return cls(toks, logp, mask, [list(p) for p in prompt_ids], list(finish_reasons), attend)

    def to_batch(self, pad_id: int = 0) -> TrainBatch:
        """Left-padded prompt + response per row, pad_id elsewhere. Returns TrainBatch (tensors on CPU). The
        attention mask (and the positions) cover `attend`, observation tokens included."""
        B, T = self.tokens.shape
        P = max(len(p) for p in self.prompt_ids)
        input_ids = torch.full((B, P + T), pad_id, dtype=torch.long)
        attention_mask = torch.zeros(B, P + T, dtype=torch.long)
        for r, p in enumerate(self.prompt_ids):
            input_ids[r, P - len(p) : P] = torch.tensor(p)
            attention_mask[r, P - len(p) : P] = 1
        real = (self.mask if self.attend is None else self.attend).cpu()
        input_ids[:, P:] = torch.where(real, self.tokens.cpu(), pad_id)
        attention_mask[:, P:] = real.long()
        position_ids = (attention_mask.cumsum(-1) - 1).clamp_min(0)
        keep = torch.arange(P - 1, P + T - 1)  # response token t <- the column before it
        return TrainBatch(input_ids, attention_mask, position_ids, P, keep, routing=self.routing)


def check_request(prompt_ids, sampling: Sampling, vocab_size: int, context_len: int) -> None:
    """What every engine refuses before any work: no prompts, an empty prompt, a prompt that leaves no room
    for max_new_tokens in the context, token ids (prompt or stop) outside the vocabulary."""
    if not isinstance(sampling, Sampling):
        raise TypeError(f"generate: sampling must be a Sampling, got {type(sampling).__name__}")
    if not isinstance(prompt_ids, (list, tuple)) or len(prompt_ids) == 0:
        raise ValueError("generate: prompt_ids must be a non-empty list of token-id lists")
    longest = context_len - sampling.max_new_tokens
    V = vocab_size
    for i, p in enumerate(prompt_ids):
        if not isinstance(p, (list, tuple)) or len(p) == 0:
            raise ValueError(f"generate: prompt {i} is empty (or not a list of token ids): {p!r}")
        if len(p) > longest:
            raise ValueError(
                f"generate: prompt {i} has {len(p)} tokens; with max_new_tokens={sampling.max_new_tokens} "
                f"the context ({context_len}) allows at most {longest}"
            )
        if not all(isinstance(t, int) and 0 <= t < V for t in p):
            raise ValueError(f"generate: prompt {i} has token ids outside [0, {V}) or non-int ids: {list(p)[:8]}...")
    if sampling.seeds and len(sampling.seeds) != len(prompt_ids) * sampling.n:
        raise ValueError(f"generate: {len(sampling.seeds)} seeds for {len(prompt_ids)} prompts x n={sampling.n} rows")
    bad = [t for t in sampling.stop_token_ids if t >= V]
    if bad:
        raise ValueError(f"generate: stop_token_ids {bad} are outside the vocabulary [0, {V})")


class Engine(Protocol):
    """What the trainer needs from a rollout engine (the embedded one here, SGLang on GPUs)."""

    def generate(self, prompt_ids: list[list[int]], sampling: Sampling) -> Rollout:
        """Sample sampling.n responses per prompt (token ids, no chat template applied here)."""

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Load full tensors under their HF state_dict names: one stream over all weights (parallel.full_weights'
        buckets, flattened); the engine may re-bucket, and flushes caches of the old weights once the stream ends."""

    def sleep(self) -> int:
        """Release memory for training; returns the bytes released (the platform's own count)."""

    def wake(self) -> None:
        """Undo sleep; generate works again."""

    def shutdown(self) -> None:
        """Release everything; the engine cannot be used afterwards."""


# ----------------------------------------------------------------------------- the trainer's side: weight sync


def push_weights(policy, engine: Engine | None) -> None:
    """One stream of (hf_name, full tensor), gathered bucket by bucket; the engine re-buckets and flushes its cache
    once at the end. TP peers without an engine (None) still run the all-gathers."""
    weights = (pair for bucket in full_weights(policy) for pair in bucket)
    if engine is not None:
        engine.update_weights(weights)
    else:
        for _ in weights:
            pass


def sync_weights(policy, engine, changed: bool) -> None:
    """Wake the engine; push the new full weights bucket by bucket when they changed (every TP rank gathers)."""
    if engine is not None:
        engine.wake()
    if changed:
        push_weights(policy, engine)
