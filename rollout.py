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

`EmbeddedEngine` runs its own compact forward pass (gpt-fast style: SDPA, RoPE, GQA, a preallocated KV cache) over
copies of the weights of a Hugging Face Llama / Qwen2 / Qwen3 causal LM: no mask builders or cache objects per step,
q/k/v and gate/up as one matmul each, one prefill per prompt shared by its n samples (bench/bench_rollout.py). Its
precision knobs (`dtype` bf16 / fp8 / int4, `kv_cache_dtype` fp8) reproduce the mismatch of real quantised engines
against an fp32 trainer (bench/bench_mismatch.py).
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
import moe
from parallel import SUPPORTED_MODELS, full_weights


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
    attention_mask: Tensor  # [B, P + T] long: 1 on prompt and response tokens (shared: [B / n, 1, S, S] bool, True = attend)
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
            raise ValueError(f"TrainBatch.shared({n}): the {B} rows are not groups of {n} consecutive rows with one prompt each")
        flat = lambda x: torch.cat([x[:, 0, :P], x[:, :, P:].reshape(G, n * T, *x.shape[3:])], 1)  # noqa: E731
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
    def from_ragged(cls, tokens: list, prompt_ids: list[list[int]], finish_reasons: list[str], *, infer_logp: list | None = None,
                    model: list | None = None) -> Rollout:
        """Per-row lists (or 1-D tensors) of response tokens and their log-probs (None: 0), right-padded to the longest
        row. model: per row and token, True on model tokens (multi-turn rows: `mask`; every real token is `attend`);
        None: every token is a model token."""
        def pad(rows, dtype):
            return torch.nn.utils.rnn.pad_sequence([torch.as_tensor(r, dtype=dtype) for r in rows], batch_first=True)

        toks = pad(tokens, torch.long)
        real = pad([torch.ones(len(t), dtype=torch.bool) for t in tokens], torch.bool)
        logp = torch.zeros(toks.shape) if infer_logp is None else pad(infer_logp, torch.float32)
        mask = real if model is None else pad(model, torch.bool)
        return cls(toks, logp, mask, [list(p) for p in prompt_ids], list(finish_reasons), None if model is None else real)

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
        return TrainBatch(input_ids, attention_mask, position_ids, P, torch.arange(P - 1, P + T - 1), routing=self.routing)


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
            raise ValueError(f"generate: prompt {i} has {len(p)} tokens; with max_new_tokens={sampling.max_new_tokens} "
                             f"the context ({context_len}) allows at most {longest}")
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
# Largest finite float8_e4m3fn value: the per-channel scale maps each row's absmax onto it.
FP8_E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max
INT4_GROUP_SIZE = 32  # dtype "int4": consecutive input elements per scale


def fake_quant_fp8(w: Tensor) -> Tensor:
    """Round a Linear weight [out, in] through float8_e4m3fn with one scale per output channel, and back."""
    scale = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / FP8_E4M3_MAX
    return (w / scale).to(torch.float8_e4m3fn).to(w.dtype) * scale


def fake_quant_int4(w: Tensor, group_size: int = INT4_GROUP_SIZE) -> Tensor:
    """Round a Linear weight [out, in] through symmetric weight-only int4 and back (the FlashRL / GPTQ rule, in float32):
    per group of `group_size` consecutive input elements, s = absmax / 7, w_hat = clamp(round(w / s), -8, 7) * s, so
    |w - w_hat| <= s / 2 and the absmax element is kept (docs/algorithms.md, section 16). Returns w_hat in w's dtype."""
    rows, cols = w.shape
    if cols % group_size:
        raise ValueError(f"fake_quant_int4: the input dimension {cols} of a [{rows}, {cols}] weight is not a "
                         f"multiple of group_size={group_size}")
    g = w.float().reshape(rows, cols // group_size, group_size)
    s = g.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / 7  # the clamp only guards all-zero groups
    return ((g / s).round().clamp(-8, 7) * s).reshape(rows, cols).to(w.dtype)

# HF name inside a decoder layer -> (slot in the engine's per-layer store, part index). Parts of one slot
# are concatenated along dim 0 (output rows) so q/k/v and gate/up each run as a single matmul.
_LAYER_SLOTS = {
    "input_layernorm.weight": ("ln1", 0),
    "self_attn.q_proj.weight": ("qkv", 0),
    "self_attn.k_proj.weight": ("qkv", 1),
    "self_attn.v_proj.weight": ("qkv", 2),
    "self_attn.q_norm.weight": ("qn", 0),
    "self_attn.k_norm.weight": ("kn", 0),
    "self_attn.o_proj.weight": ("o", 0),
    "post_attention_layernorm.weight": ("ln2", 0),
    "mlp.gate_proj.weight": ("gu", 0),
    "mlp.up_proj.weight": ("gu", 1),
    "mlp.down_proj.weight": ("down", 0),
    "mlp.gate.weight": ("router", 0),  # Qwen3-MoE: the router [E, H] and the fused experts [E, 2I, H], [E, H, I]
    "mlp.experts.gate_up_proj": ("egu", 0),
    "mlp.experts.down_proj": ("edown", 0),
}
# Each projection's bias (Qwen2 has q/k/v biases) goes to its weight's slot + "_b", same part.
_LAYER_SLOTS |= {k.replace(".weight", ".bias"): (slot + "_b", part) for k, (slot, part) in _LAYER_SLOTS.items() if slot in ("qkv", "o", "gu", "down")}
_LAYER_KEYS = ("ln1", "qkv", "qkv_b", "qn", "kn", "o", "o_b", "ln2", "gu", "gu_b", "down", "down_b", "router", "egu", "edown")
_TOP_SLOTS = {"model.embed_tokens.weight": "embed", "model.norm.weight": "norm", "lm_head.weight": "lm_head"}


def _check_arch(config) -> None:
    """Refuse what the compact forward pass does not implement, before any work."""
    mt = getattr(config, "model_type", None)
    if mt not in SUPPORTED_MODELS:
        raise NotImplementedError(f"EmbeddedEngine supports model_type {tuple(SUPPORTED_MODELS)}, got {mt!r}")
    if config.hidden_act != "silu":
        raise NotImplementedError(f"EmbeddedEngine: hidden_act {config.hidden_act!r} (only 'silu')")
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default" or "rope_theta" not in rope:
        raise NotImplementedError(f"EmbeddedEngine: only default RoPE (no rope scaling), got rope_parameters={rope}")
    if getattr(config, "partial_rotary_factor", 1.0) != 1.0:
        raise NotImplementedError("EmbeddedEngine: partial_rotary_factor != 1 is not implemented")
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        raise NotImplementedError(f"EmbeddedEngine: only full attention layers, got {sorted(kinds)}")


def _rmsnorm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    # The HF order: normalise in fp32, cast back, then scale (matters in bf16).
    return w * F.rms_norm(x.float(), (x.size(-1),), eps=eps).to(x.dtype)


class EmbeddedEngine:
    """Batched sampler over a Hugging Face Llama / Qwen2 / Qwen3 / Qwen3-MoE causal LM, with its own forward pass.

    model_or_path: a loaded HF model (its weights are copied, so later trainer steps do not leak in) or a
        folder written by save_pretrained.
    dtype: "fp32"; "bf16" (weights and compute in bf16, log-probs in fp32 from bf16 logits); "fp8" (bf16
        compute with the decoder's Linear weights fake-quantised to float8_e4m3fn, one scale per output
        channel, as FP8 rollouts do; embeddings, lm_head and norms stay bf16, as vLLM/SGLang keep them);
        "int4" (the same, with weight-only symmetric int4 in groups of 32 input elements: fake_quant_int4,
        the FlashRL / GPTQ rule; every decoder Linear's input size must be a multiple of 32). MoE experts are
        quantised like Linear weights, each expert on its own; the router stays in the compute dtype.
        An MoE engine routes like HF (softmax in fp32, top-k, optional renormalisation) and records the experts
        of every input position: Rollout.routing.
    kv_cache_dtype: "auto" (the compute dtype) or "fp8": keys and values are stored as float8_e4m3fn with
        a fixed scale of 1.0, what SGLang / vLLM do when the checkpoint has no calibrated k/v scales (the
        buffer really is fp8: half the bytes of bf16). Attention always reads keys and values at the
        cache's precision, the prefill's attention over the prompt and `logits()` included, so every
        position sees the same k/v whichever pass computed it and `logits()` equals generate's log-probs
        (SGLang's prefill differs here: see sglang_engine.py).
    max_batch_tokens: KV-cache capacity in tokens; a batch of B rows of prompt + response length S runs
        in chunks of max_batch_tokens // S rows (the draws do not depend on the chunking).
    """

    def __init__(self, model_or_path, *, dtype: str = "fp32", kv_cache_dtype: str = "auto",
                 device: str | torch.device = "cpu", max_batch_tokens: int = 65536):
        if dtype not in DTYPES:
            raise ValueError(f"EmbeddedEngine: dtype must be one of {list(DTYPES)}, got {dtype!r}")
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"EmbeddedEngine: kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
        if max_batch_tokens < 1:
            raise ValueError(f"EmbeddedEngine: max_batch_tokens must be >= 1, got {max_batch_tokens}")
        if isinstance(model_or_path, (str, os.PathLike)):
            from transformers import AutoModelForCausalLM

            model_or_path = AutoModelForCausalLM.from_pretrained(model_or_path, dtype=torch.float32)
        c = model_or_path.config
        _check_arch(c)
        self.config, self.dtype_name, self.dtype = c, dtype, DTYPES[dtype]
        self.kv_dtype = torch.float8_e4m3fn if kv_cache_dtype == "fp8" else self.dtype
        self.device, self.max_batch_tokens = torch.device(device), max_batch_tokens
        self.n_layers, self.n_heads, self.n_kv = c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.vocab_size, self.max_positions, self.eps = c.vocab_size, c.max_position_embeddings, c.rms_norm_eps
        self.tied = bool(c.tie_word_embeddings)
        self.top_k, self.norm_topk = getattr(c, "num_experts_per_tok", 0), getattr(c, "norm_topk_prob", False)
        self.scale = self.head_dim**-0.5  # what HF and SDPA use

        # name -> (store key, row range within it); the store holds the fused, precision-transformed weights.
        parts: dict[str, list[tuple[int, str, Tensor]]] = {}
        self._where: dict[str, tuple[str, slice]] = {}
        for name, t in model_or_path.state_dict().items():
            if name == "lm_head.weight" and self.tied:
                continue  # the embedding itself (state_dict lists it, save_pretrained does not)
            m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
            if m and m.group(2) in _LAYER_SLOTS:
                slot, part = _LAYER_SLOTS[m.group(2)]
                key = f"{m.group(1)}.{slot}"
            elif name in _TOP_SLOTS:
                key, part = _TOP_SLOTS[name], 0
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

        # RoPE tables for every position, computed like HF (fp32 angles, then cast to the compute dtype).
        D, theta = self.head_dim, c.rope_parameters["rope_theta"]
        inv_freq = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float) / D))
        freqs = torch.arange(self.max_positions).float()[:, None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos = emb.cos().to(self.device, self.dtype)
        self._sin_signed = torch.cat((-emb[:, : D // 2].sin(), emb[:, D // 2 :].sin()), dim=-1).to(self.device, self.dtype)
        self._kv: Tensor | None = None  # flat KV-cache buffer, allocated on first use, grown on demand
        self._asleep = self._closed = False
        self._bind()

    # ---- weights ---------------------------------------------------------------------------------

    def _transform(self, name: str, t: Tensor) -> Tensor:
        """The engine's copy of a weight: fp8 / int4 round decoder Linear weights and experts (in fp32), then the cast."""
        t = t.detach().to(self.device, torch.float32)
        kind = self.dtype_name
        if kind in ("fp8", "int4") and name.startswith("model.layers.") and (name.endswith("_proj.weight") or ".experts." in name):
            w = t.reshape(-1, t.size(-1))  # [out, in]; an expert stack [E, out, in] as E * out rows
            if kind == "int4" and w.size(1) % INT4_GROUP_SIZE:
                raise NotImplementedError(f"EmbeddedEngine: dtype 'int4' quantises groups of {INT4_GROUP_SIZE} input "
                                          f"elements; {name!r} has shape {tuple(w.shape)}, whose input size "
                                          f"{w.size(1)} is not a multiple of {INT4_GROUP_SIZE}")
            t = (fake_quant_fp8 if kind == "fp8" else fake_quant_int4)(w).view(t.shape)
        return t.to(self.dtype)

    def _bind(self) -> None:
        """Per-layer weight tuples for the hot loop (rebuilt when the store moves)."""
        s = self._store
        self._layers = [tuple(s.get(f"{i}.{k}") for k in _LAYER_KEYS) for i in range(self.n_layers)]
        self._embed, self._norm = s["embed"], s["norm"]
        self._lm_head = s["embed"] if self.tied else s["lm_head"]

    def _view(self, name: str, caller: str) -> Tensor:
        if name == "lm_head.weight" and self.tied:
            name = "model.embed_tokens.weight"
        if name not in self._where:
            raise ValueError(f"{caller}: unknown parameter {name!r} (expected Hugging Face state_dict names, "
                             f"e.g. 'model.layers.0.mlp.up_proj.weight')")
        key, rows = self._where[name]
        return self._store[key][rows]

    @torch.no_grad()  # not inference_mode: the tensors may come from a generator running collectives (DTensor gathers)
    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Copy full tensors (HF names) into the engine, applying the precision transform again.

        Each tensor is checked before it is written; on an error the tensors before it stay written.
        A tied model's lm_head.weight is the embedding: sending both writes the same weight twice.
        """
        self._check_open("update_weights")
        for name, t in named_tensors:
            dst = self._view(name, "update_weights")
            if tuple(t.shape) != tuple(dst.shape):
                raise ValueError(f"update_weights: {name!r} has shape {tuple(t.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(self._transform(name, t))

    @torch.inference_mode()
    def check_weights(self, named_tensors: Iterable[tuple[str, Tensor]], atol: float = 0.0) -> int:
        """Raise ValueError naming the first parameter whose engine copy differs from precision_transform(t)
        by more than atol (max abs); returns the number of tensors checked."""
        self._check_open("check_weights")
        count = 0
        for name, t in named_tensors:
            have = self._view(name, "check_weights")
            if tuple(t.shape) != tuple(have.shape):
                raise ValueError(f"check_weights: {name!r} has shape {tuple(t.shape)}, the engine holds {tuple(have.shape)}")
            diff = (have.float() - self._transform(name, t).float().to(have.device)).abs().max().item()
            if not diff <= atol:
                raise ValueError(f"check_weights: {name!r} differs from the engine's copy (max abs diff {diff:.3g} > {atol})")
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
        released = 0 if self._kv is None else self._kv.nbytes
        self._kv = None
        if cuda:
            self._store = {k: v.to("cpu") for k, v in self._store.items()}
            self._bind()  # drop the hot-loop references to the CUDA tensors too
            torch.cuda.empty_cache()
            released = before - torch.cuda.memory_allocated(self.device)
        self._asleep = True
        return released

    def wake(self) -> None:
        """Bring the weights back to the device; the KV cache is reallocated by the next generate."""
        self._check_open("wake")
        if self._asleep and self.device.type == "cuda":
            self._store = {k: v.to(self.device) for k, v in self._store.items()}
            self._bind()
        self._asleep = False

    def shutdown(self) -> None:
        """Drop weights and cache; every later call raises."""
        self._store, self._layers, self._kv = {}, [], None
        self._embed = self._norm = self._lm_head = None
        self._closed = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _check_open(self, caller: str) -> None:
        if self._closed:
            raise RuntimeError(f"EmbeddedEngine.{caller}: the engine was shut down")

    def _kv_cache(self, B: int, S: int) -> list[tuple[Tensor, Tensor]]:
        """Views [B, n_kv, S, D] (keys, values) per layer into the preallocated flat buffer (in kv_dtype)."""
        shape = (self.n_layers, 2, B, self.n_kv, S, self.head_dim)
        need = math.prod(shape)
        if self._kv is None or self._kv.numel() < need:
            self._kv = None  # free the old buffer before allocating the larger one
            self._kv = torch.empty(need, dtype=self.kv_dtype, device=self.device)
        kv = self._kv[:need].view(shape)
        return [(kv[i, 0], kv[i, 1]) for i in range(self.n_layers)]

    # ---- forward ---------------------------------------------------------------------------------

    def _forward(self, ids: Tensor, pos: Tensor, attn_mask: Tensor | None, kv=None, start: int = 0, routes: list | None = None) -> Tensor:
        """Final hidden states [B, S, hidden] for ids [B, S] at rope positions pos [B, S]; an MoE model appends each
        layer's experts [B, S, k] to ``routes`` when given.

        start == 0 (a whole sequence, prefill): attention over these S tokens; attn_mask is None (plain
            causal) or additive float [B, 1, S, S] (0 = attend, -inf = masked). With kv the keys and
            values are also written to cache slots 0..S.
        start > 0 (one decode step, S == 1): the new key/value go to cache slot `start`, attention reads
            slots 0..start; attn_mask is additive float [B * n_kv, 1, start + 1].
        """
        B, S = ids.shape
        H, K, D = self.n_heads, self.n_kv, self.head_dim
        cos, sin = self._cos[pos].unsqueeze(2), self._sin_signed[pos].unsqueeze(2)  # [B, S, 1, D]
        x = F.embedding(ids, self._embed)
        for i, (ln1, qkv_w, qkv_b, qn, kn, o_w, o_b, ln2, gu_w, gu_b, down_w, down_b, router, egu, edown) in enumerate(self._layers):
            qkv = F.linear(_rmsnorm(x, ln1, self.eps), qkv_w, qkv_b).view(B, S, H + 2 * K, D)
            qk, v = qkv[:, :, : H + K], qkv[:, :, H + K :]
            if qn is not None:  # Qwen3: RMSNorm over head_dim of each q and k head, before RoPE
                qk = torch.cat((_rmsnorm(qk[:, :, :H], qn, self.eps), _rmsnorm(qk[:, :, H:], kn, self.eps)), dim=2)
            # RoPE on q and k heads at once: HF's x * cos + rotate_half(x) * sin, where rotate_half(x) =
            # cat(-x2, x1) = roll(x, D/2) * (-1 on the first half), the sign folded into _sin_signed.
            qk = torch.addcmul(qk * cos, qk.roll(D // 2, dims=-1), sin)
            q, k = qk.transpose(1, 2).split((H, K), dim=1)  # [B, H | K, S, D]
            v = v.transpose(1, 2)
            if self.kv_dtype != self.dtype:
                # fp8 KV cache, scale 1.0 (dividing / multiplying by it is exact, so it is left out): round
                # k and v through float8_e4m3fn here, so the prefill's attention (and logits(), which has no
                # cache) sees what decode steps read back from the cache; the cache writes below are exact.
                k, v = k.to(self.kv_dtype).to(self.dtype), v.to(self.kv_dtype).to(self.dtype)
            if kv is not None:
                k_cache, v_cache = kv[i]
                k_cache[:, :, start : start + S] = k
                v_cache[:, :, start : start + S] = v
            if start == 0:
                a = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=attn_mask is None,
                                                   enable_gqa=K != H)
                a = a.transpose(1, 2).reshape(B, S, H * D)
            else:
                # Decode: the H // K query heads sharing a KV head are that head's query rows, so one
                # batched matmul per side and no KV repeat; [B, K, slots, D] -> [B * K, slots, D] is a view.
                # An fp8 cache is read back in the compute dtype (.to is a no-op for the "auto" cache).
                keys = k_cache[:, :, : start + 1].reshape(B * K, start + 1, D).to(self.dtype)
                values = v_cache[:, :, : start + 1].reshape(B * K, start + 1, D).to(self.dtype)
                scores = torch.baddbmm(attn_mask, q.reshape(B * K, H // K, D), keys.transpose(1, 2), alpha=self.scale)
                a = torch.bmm(scores.softmax(-1), values).view(B, 1, H * D)
            x = x + F.linear(a, o_w, o_b)
            h = _rmsnorm(x, ln2, self.eps)
            if router is None:
                gate, up = F.linear(h, gu_w, gu_b).chunk(2, dim=-1)
                x = x + F.linear(F.silu(gate) * up, down_w, down_b)
            else:
                x = x + moe.sparse_block(h, router, egu, edown, self.top_k, self.norm_topk, routes)
        return _rmsnorm(x, self._norm, self.eps)

    @torch.inference_mode()
    def logits(self, input_ids: Tensor) -> Tensor:
        """Full-sequence logits [B, L, V] float32 of unpadded sequences [B, L] (no cache), for checks. With
        the fp8 KV cache, k and v are rounded as generate's cache holds them, so the two agree."""
        self._check_ready("logits")
        ids = input_ids.to(self.device)
        pos = torch.arange(ids.size(1), device=self.device).expand_as(ids)
        return F.linear(self._forward(ids, pos, None), self._lm_head).float()

    # ---- sampling --------------------------------------------------------------------------------

    def _check_ready(self, caller: str) -> None:
        self._check_open(caller)
        if self._asleep:
            raise RuntimeError(f"EmbeddedEngine.{caller}: the engine is asleep; call wake() first")

    def _check_prompts(self, prompt_ids, sampling: Sampling) -> None:
        check_request(prompt_ids, sampling, self.vocab_size, self.max_positions)
        need = (max(len(p) for p in prompt_ids) + sampling.max_new_tokens) * sampling.n
        if need > self.max_batch_tokens:
            raise ValueError(f"generate: the n={sampling.n} rows of one prompt need {need} KV slots > max_batch_tokens="
                             f"{self.max_batch_tokens}; raise max_batch_tokens")

    @torch.inference_mode()
    def generate(self, prompt_ids: list[list[int]], sampling: Sampling) -> Rollout:
        """Sample sampling.n responses per prompt. Returns a Rollout with B = len(prompt_ids) * n rows."""
        self._check_ready("generate")
        self._check_prompts(prompt_ids, sampling)
        prompts = [list(p) for p in prompt_ids]
        # One uniform per (row, step), from row r's own generator (seed + r, or seeds[r]): draws do not depend on
        # the batch composition or on how it is chunked (max_batch_tokens).
        rows = len(prompts) * sampling.n
        u = torch.stack([torch.rand(sampling.max_new_tokens, generator=torch.Generator().manual_seed(sampling.row_seed(r))) for r in range(rows)])
        # A prompt's n samples stay in one chunk: its prefill runs once and is copied to the n rows.
        row_tokens = max(len(p) for p in prompts) + sampling.max_new_tokens
        per_chunk = self.max_batch_tokens // (row_tokens * sampling.n)
        P = max(len(p) for p in prompts)
        outs = [self._generate_chunk(prompts[i : i + per_chunk], sampling, u[i * sampling.n : (i + per_chunk) * sampling.n].to(self.device), P)
                for i in range(0, len(prompts), per_chunk)]
        ro = Rollout.from_ragged([t for o in outs for t in o[0]], [p for p in prompts for _ in range(sampling.n)],
                                 [r for o in outs for r in o[2]], infer_logp=[lp for o in outs for lp in o[1]])
        if self.top_k:  # a chunk's routing [b, P + its longest response, L, k], right-padded to to_batch's P + T columns
            ro.routing = torch.cat([F.pad(o[3], (0, 0, 0, 0, 0, P + ro.tokens.size(1) - o[3].size(1)), value=-1) for o in outs])
        return ro

    def _generate_chunk(self, prompts: list[list[int]], s: Sampling, uniforms: Tensor, width: int):
        """Rows are the prompts, each repeated s.n times; uniforms [B, N] drive the draws. Returns per row its CPU
        response tokens and log-probs, the finish reasons, and an MoE's routing [B, width + T, L, k] (width: the longest
        prompt of the whole generate call, for to_batch's columns)."""
        dev, n, N, K = self.device, s.n, s.max_new_tokens, self.n_kv
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
            prefill_mask = torch.zeros(attend.shape, dtype=self.dtype, device=dev).masked_fill(~attend, -math.inf)[:, None]

        # Prefill each distinct prompt once, into the cache rows of its first sample (rows 0, n, 2n, ...),
        # then copy those slots to the prompt's other n - 1 rows.
        kv = self._kv_cache(B, P + N)
        routes, steps = ([], []) if self.top_k else (None, None)  # MoE: each layer's experts per input position
        h = self._forward(ids.to(dev), pos[::n, :P], prefill_mask, [(k[::n], v[::n]) for k, v in kv], 0, routes)
        if n > 1:
            for cache in (c for pair in kv for c in pair):
                grouped = cache.view(B // n, n, *cache.shape[1:])[:, :, :, :P]
                grouped[:, 1:] = grouped[:, :1]
        logits = F.linear(h[:, -1], self._lm_head).repeat_interleave(n, dim=0)  # [B, V]

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
            h = self._forward(tok, pos[:, P + t : P + t + 1], decode_mask[..., : P + t + 1], kv, P + t, r)
            if r is not None:
                steps.append(torch.stack(r, 2))  # [B, 1, L, k]: response token t as input
            logits = F.linear(h[:, -1], self._lm_head)
        T = t + 1
        mask = alive[:, :T]
        finish = ["stop" if d else "length" for d in done.tolist()]
        routing = None
        if routes is not None:  # [B, width + T, L, k]: prompt (its pads -1), response tokens 0 .. T-2, -1 for the last one
            pre = torch.stack(routes, 2).repeat_interleave(n, dim=0).masked_fill(~valid[:, :P, None, None], -1)
            dec = torch.cat(steps + [torch.full_like(pre[:, :1], -1)], 1).masked_fill(~mask[:, :, None, None], -1)
            routing = F.pad(torch.cat([pre, dec], 1), (0, 0, 0, 0, width - P, 0), value=-1).cpu()
        lens = mask.sum(1).tolist()  # a row's tokens are a prefix: it stops at its stop token
        tokens, logp = tokens.cpu(), logp.cpu()
        return [x[:k] for x, k in zip(tokens, lens)], [x[:k] for x, k in zip(logp, lens)], finish, routing


# ----------------------------------------------------------------------------- the trainer's side: engine and weight sync

# Share of each GPU that SGLang reserves for weights + KV cache when colocated with the trainer.
SGLANG_GPU_MEM_FRACTION = 0.4


def make_engine(cfg, path: str, device: torch.device) -> Engine:
    """The rollout engine of a run (cfg: the run's config.Config; its engine, engine_dtype, kv_cache_dtype, seed)."""
    if cfg.engine == "sglang":
        from sglang_engine import SGLangEngine  # sglang_engine imports this module, and SGLang is optional

        # --seed seeds SGLang's sampling stream (on CPU the only seed it honours; see sglang_engine's docstring).
        if device.type != "cuda":
            return SGLangEngine(path, dtype=cfg.engine_dtype, kv_cache_dtype=cfg.kv_cache_dtype, random_seed=cfg.seed)
        # Colocated on this rank's GPU: the engine gets a fixed share, the trainer the rest (the engine's
        # memory is released in sleep() during training, but its reservation is sized at start).
        return SGLangEngine(path, dtype=cfg.engine_dtype, kv_cache_dtype=cfg.kv_cache_dtype, random_seed=cfg.seed,
                            base_gpu_id=device.index, mem_fraction_static=SGLANG_GPU_MEM_FRACTION)
    return EmbeddedEngine(path, dtype=cfg.engine_dtype, kv_cache_dtype=cfg.kv_cache_dtype, device=device)


def push_weights(policy, engine: Engine | None) -> None:
    """One stream of (hf_name, full tensor), gathered bucket by bucket; the engine re-buckets and flushes its cache
    once at the end. TP peers without an engine (None) still run the all-gathers."""
    weights = (pair for bucket in full_weights(policy) for pair in bucket)
    if engine is not None:
        engine.update_weights(weights)
    else:
        for _ in weights:
            pass
