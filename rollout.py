"""Rollout engines: one small interface, and the embedded torch engine (the default; CPU and GPU).

    engine = EmbeddedEngine("path/to/policy", dtype="fp32", device="cpu")
    ro = engine.generate([[5, 7, 9], [5, 8]], Sampling(temperature=1.0, max_new_tokens=32, n=4, stop_token_ids=(2,)))
    b = ro.to_batch(pad_id=0)                        # the trainer's sequences (TrainBatch)
    engine.sleep()                                   # free the KV cache (on CUDA also the weights)
    ...                                              # train the policy
    engine.wake(); engine.update_weights(policy.named_parameters())

Alignment, stated once: a `Rollout` holds response tokens as [B, T] right-padded tensors with a bool
`mask` (True on generated tokens, the stop token included), the convention of losses.py. `to_batch`
left-pads the prompts to a common length P and appends the responses, so the response block of every
row starts at column P, and the model's outputs at columns `b.keep` = P - 1 .. P + T - 2 predict the
response tokens: log-probs [B, T] aligned with ro.infer_logp (train_ppo.response_logprobs).

The trainer gets its engine from `make_engine` (embedded, or SGLang: sglang_engine.py) and pushes the policy's weights
with `push_weights`.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Iterable, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

import losses
from decoder import (
    INT4_GROUP_SIZE,
    LAYER_SLOTS,
    TOP_SLOTS,
    Decoder,
    check_arch,
    fake_quant_fp8,
    fake_quant_int4,
    load_pretrained,
)  # noqa: F401
from parallel import full_weights


@dataclass
class Sampling:
    """How to sample. The engine samples from softmax(losses.process_logits(logits, temperature, top_k, top_p))."""

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
    attention_mask: (
        Tensor  # [B, P + T] long: 1 on prompt and response tokens (shared: [B / n, 1, S, S] bool, True = attend)
    )
    position_ids: Tensor  # [B, P + T] long: 0 at each row's first real token (what the engine used)
    response_start: int  # P: column of the first response token in every row
    keep: Tensor  # [T] (shared: [n T]) long: the columns whose hidden states predict the response tokens, row by row
    group: int = 1  # rows per sequence
    routing: Tensor | None = None  # [B, P + T, layers, k] long: an MoE engine's experts per column (Rollout.routing)

    def shared(self, n: int) -> TrainBatch:
        """Each group of n consecutive rows (one prompt's samples) as one sequence: the prompt's P columns, then the n
        responses' T columns each. Response i attends the prompt and its own earlier tokens only (a block mask; SDPA),
        at the positions of its own row, so every output equals the per-row batch's; the prompt is computed once."""
        (B, S), P = self.input_ids.shape, self.response_start
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
        return cls(
            toks, logp, mask, [list(p) for p in prompt_ids], list(finish_reasons), None if model is None else real
        )

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
        return TrainBatch(
            input_ids, attention_mask, position_ids, P, torch.arange(P - 1, P + T - 1), routing=self.routing
        )


def check_request(prompt_ids, sampling: Sampling, vocab_size: int, context_len: int) -> None:
    """What every engine refuses before any work: no prompts, an empty prompt, a prompt that leaves no room
    for max_new_tokens in the context, token ids (prompt or stop) outside the vocabulary."""
    if not isinstance(sampling, Sampling):
        raise TypeError(f"generate: sampling must be a Sampling, got {type(sampling).__name__}")
    if not isinstance(prompt_ids, (list, tuple)) or len(prompt_ids) == 0:
        raise ValueError("generate: prompt_ids must be a non-empty list of token-id lists")
    longest, V = context_len - sampling.max_new_tokens, vocab_size
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


# Compute dtype per engine dtype; fp8 and int4 are bf16 compute over fake-quantised decoder Linear weights.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.bfloat16, "int4": torch.bfloat16}
# KV-cache storage: "auto" = the compute dtype, "fp8" = float8_e4m3fn with a fixed scale of 1.0.
KV_CACHE_DTYPES = ("auto", "fp8")


class EmbeddedEngine:
    """Batched sampler over a Hugging Face Llama / Qwen2 / Qwen3 / Qwen3-MoE causal LM, with its own compact forward pass
    (decoder.py) over copies of the weights and one prefill per prompt shared by its n samples (bench/bench_rollout.py).
    An MoE engine routes like HF and records the experts of every input position (Rollout.routing).

    model_or_path: a loaded HF model (its weights are copied, so later trainer steps do not leak in) or a
        folder written by save_pretrained.
    dtype, kv_cache_dtype: the precision knobs that reproduce a quantised engine's mismatch against an fp32 trainer
        (docs/algorithms.md, section 16): "fp32", "bf16", or bf16 compute over decoder Linear weights and experts
        fake-quantised to "fp8" (per output channel) or "int4" (groups of 32 input elements); a KV cache in the
        compute dtype ("auto") or "fp8", which attention reads at that precision everywhere, the prefill and
        `logits()` included, so `logits()` equals generate's log-probs.
    max_batch_tokens: KV-cache capacity in tokens; a batch of B rows of prompt + response length S runs
        in chunks of max_batch_tokens // S rows (the draws do not depend on the chunking).
    moe_flip: a lab knob (--moe-flip, off at 0): an MoE engine routes each token's k-th expert to the (k+1)-th best
        with this probability per token and layer (moe.sparse_block), drawn from a generator seeded per generate call
        by its first row's sampling seed (per logits() call by 0), so the flips hang on the call's batch and chunking.
    prefix_cache: keep the keys and values of the last generate call's rows (prompt and response) until the next
        call, the weights change or the engine sleeps, so a prompt that extends one of them (the next turn of an
        episode: context + observation) prefills only its new tokens (`prefill_tokens` counts the prefilled ones).
        Log-probs equal a fresh prefill's to float rounding, not bit for bit (tests/test_agent.py); memory grows by
        one batch's keys and values. Not for MoE models (their routing is recorded per input position).
    """

    def __init__(
        self,
        model_or_path,
        *,
        dtype: str = "fp32",
        kv_cache_dtype: str = "auto",
        device: str | torch.device = "cpu",
        max_batch_tokens: int = 65536,
        moe_flip: float = 0.0,
        prefix_cache: bool = False,
    ):
        if dtype not in DTYPES:
            raise ValueError(f"EmbeddedEngine: dtype must be one of {list(DTYPES)}, got {dtype!r}")
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"EmbeddedEngine: kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}"
            )
        if max_batch_tokens < 1:
            raise ValueError(f"EmbeddedEngine: max_batch_tokens must be >= 1, got {max_batch_tokens}")
        if isinstance(model_or_path, (str, os.PathLike)):
            from transformers import AutoModelForCausalLM

            model_or_path = load_pretrained(AutoModelForCausalLM, model_or_path, "EmbeddedEngine", dtype=torch.float32)
        c = model_or_path.config
        check_arch(c)
        self.config, self.dtype_name, self.dtype = c, dtype, DTYPES[dtype]
        self.kv_dtype = torch.float8_e4m3fn if kv_cache_dtype == "fp8" else self.dtype
        self.device, self.max_batch_tokens = torch.device(device), max_batch_tokens
        self.vocab_size, self.max_positions, self.tied = (
            c.vocab_size,
            c.max_position_embeddings,
            bool(c.tie_word_embeddings),
        )
        self.lm = Decoder(c, self.dtype, self.kv_dtype, self.device)
        if not 0 <= moe_flip <= 1 or (moe_flip and not self.lm.top_k):
            raise ValueError(
                f"EmbeddedEngine: moe_flip (--moe-flip) must be in [0, 1] and needs an MoE model, got {moe_flip} "
                f"for a {c.model_type} model"
            )
        self.lm.flip = (moe_flip, torch.Generator(self.device)) if moe_flip else None
        if prefix_cache and self.lm.top_k:
            raise NotImplementedError(
                "EmbeddedEngine: prefix_cache is not implemented for MoE models (a cached prefix "
                "has no recorded routing)"
            )
        self.prefix_cache, self.prefill_tokens = prefix_cache, 0
        self._prefixes: dict[
            tuple[int, ...], Tensor
        ] = {}  # the last call's rows' ids -> their keys and values [L, 2, K, len, D]

        # name -> (store key, row range within it); the store holds the fused, precision-transformed weights.
        parts: dict[str, list[tuple[int, str, Tensor]]] = {}
        self._where: dict[str, tuple[str, slice]] = {}
        for name, t in model_or_path.state_dict().items():
            if name == "lm_head.weight" and self.tied:
                continue  # the embedding itself (state_dict lists it, save_pretrained does not)
            m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
            if m and m.group(2) in LAYER_SLOTS:
                slot, part = LAYER_SLOTS[m.group(2)]
                key = f"{m.group(1)}.{slot}"
            elif name in TOP_SLOTS:
                key, part = TOP_SLOTS[name], 0
            else:
                raise NotImplementedError(f"EmbeddedEngine: unsupported parameter {name!r} in a {c.model_type} model")
            parts.setdefault(key, []).append((part, name, self._transform(name, t)))
        self._store: dict[str, Tensor] = {}
        for key, ps in parts.items():
            ps.sort()
            self._store[key] = torch.cat([t for _, _, t in ps])  # always a copy, never the trainer's storage
            row = 0
            for _, name, t in ps:
                self._where[name] = (key, slice(row, row + t.size(0)))
                row += t.size(0)
        self._kv: Tensor | None = None  # flat KV-cache buffer, allocated on first use, grown on demand
        self._asleep = self._closed = False
        self.lm.bind(self._store, self.tied)

    # ---- weights ---------------------------------------------------------------------------------

    def _transform(self, name: str, t: Tensor) -> Tensor:
        """The engine's copy of a weight: fp8 / int4 round decoder Linear weights and experts (in fp32), then the cast."""
        t = t.detach().to(self.device, torch.float32)
        kind = self.dtype_name
        if (
            kind in ("fp8", "int4")
            and name.startswith("model.layers.")
            and (name.endswith("_proj.weight") or ".experts." in name)
        ):
            w = t.reshape(-1, t.size(-1))  # [out, in]; an expert stack [E, out, in] as E * out rows
            if kind == "int4" and w.size(1) % INT4_GROUP_SIZE:
                raise NotImplementedError(
                    f"EmbeddedEngine: dtype 'int4' quantises groups of {INT4_GROUP_SIZE} input "
                    f"elements; {name!r} has shape {tuple(w.shape)}, whose input size "
                    f"{w.size(1)} is not a multiple of {INT4_GROUP_SIZE}"
                )
            t = (fake_quant_fp8 if kind == "fp8" else fake_quant_int4)(w).view(t.shape)
        return t.to(self.dtype)

    def _view(self, name: str, caller: str, shape: torch.Size | None = None) -> Tensor:
        """The engine's copy of HF parameter `name`, checked against a full tensor's shape when given."""
        key, rows = self._where.get(
            "model.embed_tokens.weight" if name == "lm_head.weight" and self.tied else name, (None, None)
        )
        if key is None:
            raise ValueError(
                f"{caller}: unknown parameter {name!r} (expected Hugging Face state_dict names, "
                f"e.g. 'model.layers.0.mlp.up_proj.weight')"
            )
        have = self._store[key][rows]
        if shape is not None and tuple(shape) != tuple(have.shape):
            raise ValueError(f"{caller}: {name!r} has shape {tuple(shape)}, the engine holds {tuple(have.shape)}")
        return have

    @torch.no_grad()  # not inference_mode: the tensors may come from a generator running collectives (DTensor gathers)
    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Copy full tensors (HF names) into the engine, applying the precision transform again.

        Each tensor is checked before it is written; on an error the tensors before it stay written.
        A tied model's lm_head.weight is the embedding: sending both writes the same weight twice.
        """
        self._check_open("update_weights")
        self._prefixes = {}
        for name, t in named_tensors:
            self._view(name, "update_weights", t.shape).copy_(self._transform(name, t))

    @torch.inference_mode()
    def check_weights(self, named_tensors: Iterable[tuple[str, Tensor]], atol: float = 0.0) -> int:
        """Raise ValueError naming the first parameter whose engine copy differs from precision_transform(t)
        by more than atol (max abs); returns the number of tensors checked."""
        self._check_open("check_weights")
        count = 0
        for name, t in named_tensors:
            have = self._view(name, "check_weights", t.shape)
            diff = (have.float() - self._transform(name, t).float().to(have.device)).abs().max().item()
            if not diff <= atol:
                raise ValueError(
                    f"check_weights: {name!r} differs from the engine's copy (max abs diff {diff:.3g} > {atol})"
                )
            count += 1
        return count

    # ---- memory ----------------------------------------------------------------------------------

    def sleep(self) -> int:
        """Free the KV cache; on CUDA also move the weights to CPU. Returns the bytes released: the change
        in torch.cuda.memory_allocated on CUDA, the size of the freed cache buffer on CPU."""
        self._check_open("sleep")
        if self._asleep:
            return 0
        cuda = self.device.type == "cuda"
        before = torch.cuda.memory_allocated(self.device) if cuda else 0
        released = (0 if self._kv is None else self._kv.nbytes) + sum(t.nbytes for t in self._prefixes.values())
        self._kv, self._prefixes = None, {}
        if cuda:
            self._store = {k: v.to("cpu") for k, v in self._store.items()}
            self.lm.bind(self._store, self.tied)  # drop the hot-loop references to the CUDA tensors too
            torch.cuda.empty_cache()
            released = before - torch.cuda.memory_allocated(self.device)
        self._asleep = True
        return released

    def wake(self) -> None:
        """Bring the weights back to the device; the KV cache is reallocated by the next generate."""
        self._check_open("wake")
        if self._asleep and self.device.type == "cuda":
            self._store = {k: v.to(self.device) for k, v in self._store.items()}
            self.lm.bind(self._store, self.tied)
        self._asleep = False

    def shutdown(self) -> None:
        """Drop weights and cache; every later call raises."""
        self._store, self.lm, self._kv, self._prefixes = {}, None, None, {}
        self._closed = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _check_open(self, caller: str) -> None:
        if self._closed:
            raise RuntimeError(f"EmbeddedEngine.{caller}: the engine was shut down")

    def _kv_cache(self, B: int, S: int) -> Tensor:
        """A view [layers, 2 (keys, values), B, n_kv, S, D] into the preallocated flat buffer (in kv_dtype)."""
        shape = (self.lm.n_layers, 2, B, self.lm.n_kv, S, self.lm.head_dim)
        need = math.prod(shape)
        if self._kv is None or self._kv.numel() < need:
            self._kv = None  # free the old buffer before allocating the larger one
            self._kv = torch.empty(need, dtype=self.kv_dtype, device=self.device)
        return self._kv[:need].view(shape)

    def _cached(self, prompt: list[int], lengths: list[int]) -> Tensor | None:
        """The keys and values of the longest row of the last call (lengths: theirs, longest first) that a prompt
        extends by at least one token."""
        return next(
            (hit for n in lengths if n < len(prompt) and (hit := self._prefixes.get(tuple(prompt[:n]))) is not None),
            None,
        )

    @torch.inference_mode()
    def logits(self, input_ids: Tensor) -> Tensor:
        """Full-sequence logits [B, L, V] float32 of unpadded sequences [B, L] (no cache), for checks. With
        the fp8 KV cache, k and v are rounded as generate's cache holds them, so the two agree."""
        self._check_ready("logits")
        ids = input_ids.to(self.device)
        pos = torch.arange(ids.size(1), device=self.device).expand_as(ids)
        if self.lm.flip:
            self.lm.flip[1].manual_seed(0)
        return F.linear(self.lm.forward(ids, pos, None), self.lm.lm_head).float()

    # ---- sampling --------------------------------------------------------------------------------

    def _check_ready(self, caller: str) -> None:
        self._check_open(caller)
        if self._asleep:
            raise RuntimeError(f"EmbeddedEngine.{caller}: the engine is asleep; call wake() first")

    @torch.inference_mode()
    def generate(self, prompt_ids: list[list[int]], sampling: Sampling) -> Rollout:
        """Sample sampling.n responses per prompt. Returns a Rollout with B = len(prompt_ids) * n rows."""
        self._check_ready("generate")
        check_request(prompt_ids, sampling, self.vocab_size, self.max_positions)
        prompts, n = [list(p) for p in prompt_ids], sampling.n
        P = max(len(p) for p in prompts)
        if self.lm.flip:
            self.lm.flip[1].manual_seed(sampling.row_seed(0))
        # A prompt's n samples stay in one chunk: its prefill runs once and is copied to the n rows.
        per_chunk = self.max_batch_tokens // ((P + sampling.max_new_tokens) * n)
        if per_chunk == 0:
            raise ValueError(
                f"generate: the n={n} rows of one prompt need {(P + sampling.max_new_tokens) * n} KV slots > "
                f"max_batch_tokens={self.max_batch_tokens}; raise max_batch_tokens"
            )
        # One uniform per (row, step), from row r's own generator (seed + r, or seeds[r]): draws do not depend on
        # the batch composition or on how it is chunked (max_batch_tokens).
        u = torch.stack(
            [
                torch.rand(sampling.max_new_tokens, generator=torch.Generator().manual_seed(sampling.row_seed(r)))
                for r in range(len(prompts) * n)
            ]
        )
        kept: dict[tuple[int, ...], Tensor] = {}
        outs = [
            self._generate_chunk(
                prompts[i : i + per_chunk], sampling, u[i * n : (i + per_chunk) * n].to(self.device), P, kept
            )
            for i in range(0, len(prompts), per_chunk)
        ]
        if self.prefix_cache:
            self._prefixes = kept
        ro = Rollout.from_ragged(
            [t for o in outs for t in o[0]],
            [p for p in prompts for _ in range(n)],
            [r for o in outs for r in o[2]],
            infer_logp=[lp for o in outs for lp in o[1]],
        )
        if (
            self.lm.top_k
        ):  # a chunk's routing [b, P + its longest response, L, k], right-padded to to_batch's P + T columns
            ro.routing = torch.cat(
                [F.pad(o[3], (0, 0, 0, 0, 0, P + ro.tokens.size(1) - o[3].size(1)), value=-1) for o in outs]
            )
        return ro

    def _generate_chunk(self, prompts: list[list[int]], s: Sampling, uniforms: Tensor, width: int, kept: dict):
        """Rows are the prompts, each repeated s.n times; uniforms [B, N] drive the draws. Returns per row its CPU
        response tokens and log-probs, the finish reasons, and an MoE's routing [B, width + T, L, k] (width: the longest
        prompt of the whole generate call, for to_batch's columns). With the prefix cache, the rows' keys and values
        go into `kept`."""
        dev, n, N, K = self.device, s.n, s.max_new_tokens, self.lm.n_kv
        B = len(prompts) * n
        lens = torch.tensor([len(p) for p in prompts])
        P = int(lens.max())
        # Left-pad so every row writes its next token to the same cache slot; rope positions start at 0 at
        # each row's first real token, as in the trainer's unpadded (or position_ids) forward.
        ids = torch.zeros(len(prompts), P, dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, P - len(p) :] = torch.tensor(p)
        n_pad = (P - lens).repeat_interleave(n).to(dev)  # [B]
        pos = (torch.arange(P + N, device=dev) - n_pad[:, None]).clamp_min(0)  # [B, P + N]
        valid = torch.arange(P + N, device=dev) >= n_pad[:, None]  # [B, P + N]: the slot holds a real token
        # Additive masks, built once per chunk. Decode rows are (row, KV head) pairs, sliced per step.
        decode_mask = torch.zeros(B, 1, P + N, dtype=self.dtype, device=dev).masked_fill(~valid[:, None], -math.inf)
        decode_mask = decode_mask.repeat_interleave(K, dim=0)  # [B * K, 1, P + N]
        prefill_mask = None  # plain causal when no prompt is padded
        if bool((n_pad > 0).any()):
            attend = torch.ones(P, P, dtype=torch.bool, device=dev).tril() & valid[::n, None, :P]
            # A pad query also sees itself, so no softmax row is empty (an empty row gives NaN, and NaN
            # values would leak through zero attention weights into real rows).
            attend |= torch.eye(P, dtype=torch.bool, device=dev)
            prefill_mask = torch.zeros(attend.shape, dtype=self.dtype, device=dev).masked_fill(~attend, -math.inf)[
                :, None
            ]

        # Prefill each distinct prompt once, into the cache rows of its first sample (rows 0, n, 2n, ...),
        # then copy those slots to the prompt's other n - 1 rows.
        slots = self._kv_cache(B, P + N)
        kv = [(slots[i, 0], slots[i, 1]) for i in range(self.lm.n_layers)]
        routes, steps = ([], []) if self.lm.top_k else (None, None)  # MoE: each layer's experts per input position
        lengths = sorted({len(k) for k in self._prefixes}, reverse=True)
        hits = [self._cached(p, lengths) for p in prompts] if lengths else []
        # Prefix cache: slots below `cut` come from the cache in every row (pads zeroed: never attended, but an
        # uninitialised NaN would leak through a zero attention weight); the prefill runs on slots cut..P only.
        cut = min((P - len(p) + (0 if h is None else h.size(3)) for p, h in zip(prompts, hits)), default=0)
        for r, h in enumerate(hits if cut else []):
            a = min(P - len(prompts[r]), cut)
            slots[:, :, r * n, :, :a] = 0
            if h is not None:
                slots[:, :, r * n, :, a:cut] = h[:, :, :, : cut - a]
        if cut:
            q_slot, key = torch.arange(cut, P, device=dev)[:, None], torch.arange(P, device=dev)
            attend = (key <= q_slot) & valid[::n, None, :P] | (key == q_slot)  # a pad query sees itself, as above
            prefill_mask = torch.zeros(attend.shape, dtype=self.dtype, device=dev).masked_fill(~attend, -math.inf)[
                :, None
            ]
        self.prefill_tokens += sum(min(len(p), P - cut) for p in prompts)
        h = self.lm.forward(
            ids[:, cut:].to(dev), pos[::n, cut:P], prefill_mask, [(k[::n], v[::n]) for k, v in kv], cut, routes
        )
        if n > 1:
            for cache in (c for pair in kv for c in pair):
                grouped = cache.view(B // n, n, *cache.shape[1:])[:, :, :, :P]
                grouped[:, 1:] = grouped[:, :1]
        logits = F.linear(h[:, -1], self.lm.lm_head).repeat_interleave(n, dim=0)  # [B, V]

        stop = torch.tensor(s.stop_token_ids, dtype=torch.long, device=dev)
        tokens = torch.zeros(B, N, dtype=torch.long, device=dev)
        logp = torch.zeros(B, N, dtype=torch.float32, device=dev)
        alive = torch.zeros(B, N, dtype=torch.bool, device=dev)
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        for t in range(N):
            x = losses.process_logits(logits, s.temperature, top_k=s.top_k, top_p=s.top_p)  # [B, V] fp32
            lse = torch.logsumexp(x, dim=-1, keepdim=True)
            # Inverse-CDF draw: one uniform per row (torch.multinomial draws V exponentials per row).
            # searchsorted(right=True) returns the first token whose cumulative mass exceeds u, so a token
            # of probability 0 (excluded by top-k / top-p) is never picked; u < total keeps it below V.
            cdf = (x - lse).exp().cumsum(-1)
            total = cdf[:, -1:]
            u = torch.minimum(uniforms[:, t : t + 1] * total, total.nextafter(torch.zeros_like(total)))
            tok = torch.searchsorted(cdf, u, right=True)  # [B, 1]
            # losses.token_logprobs' formula, so engine and trainer share one definition.
            logp[:, t] = (x.gather(-1, tok) - lse)[:, 0]
            tokens[:, t] = tok[:, 0]
            alive[:, t] = ~done  # the stop token itself is part of the response
            done |= (tok == stop).any(-1)
            if t == N - 1 or bool(done.all()):
                break
            r = None if steps is None else []
            h = self.lm.forward(tok, pos[:, P + t : P + t + 1], decode_mask[..., : P + t + 1], kv, P + t, r)
            if r is not None:
                steps.append(torch.stack(r, 2))  # [B, 1, L, k]: response token t as input
            logits = F.linear(h[:, -1], self.lm.lm_head)
        T = t + 1
        mask = alive[:, :T]
        finish = ["stop" if d else "length" for d in done.tolist()]
        routing = None
        if (
            routes is not None
        ):  # [B, width + T, L, k]: prompt (its pads -1), response tokens 0 .. T-2, -1 for the last one
            pre = torch.stack(routes, 2).repeat_interleave(n, dim=0).masked_fill(~valid[:, :P, None, None], -1)
            dec = torch.cat(steps + [torch.full_like(pre[:, :1], -1)], 1).masked_fill(~mask[:, :, None, None], -1)
            routing = F.pad(torch.cat([pre, dec], 1), (0, 0, 0, 0, width - P, 0), value=-1).cpu()
        lens = mask.sum(1).tolist()  # a row's tokens are a prefix: it stops at its stop token
        tokens, logp = tokens.cpu(), logp.cpu()
        for b, k in enumerate(lens if self.prefix_cache else []):  # the slots written: prompt and response[:-1]
            kept[tuple(prompts[b // n] + tokens[b, : k - 1].tolist())] = slots[
                :, :, b, :, int(n_pad[b]) : P + k - 1
            ].clone()
        return [x[:k] for x, k in zip(tokens, lens)], [x[:k] for x, k in zip(logp, lens)], finish, routing


# ----------------------------------------------------------------------------- the trainer's side: engine and weight sync

# Share of each GPU that SGLang reserves for weights + KV cache when colocated with the trainer.
SGLANG_GPU_MEM_FRACTION = 0.4


def make_engine(cfg, path: str, device: torch.device) -> Engine:
    """The rollout engine of a run (cfg: the run's config.Config; its engine, engine_dtype, kv_cache_dtype, seed)."""
    if cfg.engine == "sglang":
        from sglang_engine import SGLangEngine  # sglang_engine imports this module, and SGLang is optional

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
