"""The embedded rollout engine: a batched torch sampler over copies of the policy's weights (CPU and GPU), the default.

    engine = EmbeddedEngine("path/to/policy", dtype="fp32", device="cpu")
    ro = engine.generate([[5, 7, 9], [5, 8]], Sampling(temperature=1.0, max_new_tokens=32, n=4, stop_token_ids=(2,)))
    engine.sleep()                                   # free the KV cache (on CUDA also the weights)
    engine.wake(); engine.update_weights(policy.named_parameters())

It implements rollout.Engine, and computes log-probs the way the trainer does (decoder.py's forward, losses'
sampling transform): with the same dtype and weights its Rollout.infer_logp equals the trainer's recompute.
"""

from __future__ import annotations

import math
import os
import re
from typing import Iterable, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

import logprobs
from decoder import (
    INT4_GROUP_SIZE,
    LAYER_SLOTS,
    TOP_SLOTS,
    Decoder,
    check_arch,
    fake_quant_fp8,
    fake_quant_int4,
    load_pretrained,
)
from rollout import Rollout, Sampling, check_request


class _Layout(NamedTuple):
    """One generate chunk's padded prompts and masks (EmbeddedEngine._layout). B rows, P prompt slots, N new tokens."""

    ids: Tensor  # [prompts, P] the distinct prompts, left-padded
    n_pad: Tensor  # [B] each row's left padding
    pos: Tensor  # [B, P + N] rope positions, 0 at each row's first real token
    valid: Tensor  # [B, P + N] bool: the slot holds a real token
    decode_mask: Tensor  # [B * KV heads, 1, P + N] additive, sliced per decode step
    prefill_mask: Tensor | None  # [P, 1, P] additive, or None: plain causal (no prompt padded)


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
        self.config = c
        self.dtype_name = dtype
        self.dtype = DTYPES[dtype]
        self.kv_dtype = torch.float8_e4m3fn if kv_cache_dtype == "fp8" else self.dtype
        self.device = torch.device(device)
        self.max_batch_tokens = max_batch_tokens
        self.vocab_size = c.vocab_size
        self.max_positions = c.max_position_embeddings
        self.tied = bool(c.tie_word_embeddings)
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
        self.prefix_cache = prefix_cache
        self.prefill_tokens = 0
        # the last call's rows' ids -> their keys and values [L, 2, K, len, D]
        self._prefixes: dict[tuple[int, ...], Tensor] = {}

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
        self._asleep = False
        self._closed = False
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
            quantise = fake_quant_fp8 if kind == "fp8" else fake_quant_int4
            t = quantise(w).view(t.shape)
        return t.to(self.dtype)

    def _view(self, name: str, caller: str, shape: torch.Size | None = None) -> Tensor:
        """The engine's copy of HF parameter `name`, checked against a full tensor's shape when given."""
        # a tied model's lm_head.weight is its embedding
        held = "model.embed_tokens.weight" if name == "lm_head.weight" and self.tied else name
        key, rows = self._where.get(held, (None, None))
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
        self._kv = None
        self._prefixes = {}
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
        self._store = {}
        self.lm = None
        self._kv = None
        self._prefixes = {}
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
        for n in lengths:
            if n < len(prompt):
                hit = self._prefixes.get(tuple(prompt[:n]))
                if hit is not None:
                    return hit
        return None

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
        prompts = [list(p) for p in prompt_ids]
        n = sampling.n
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
        outs = []
        for i in range(0, len(prompts), per_chunk):
            chunk_u = u[i * n : (i + per_chunk) * n].to(self.device)
            outs.append(self._generate_chunk(prompts[i : i + per_chunk], sampling, chunk_u, P, kept))
        if self.prefix_cache:
            self._prefixes = kept
        ro = Rollout.from_ragged(
            [t for o in outs for t in o[0]],
            [p for p in prompts for _ in range(n)],
            [r for o in outs for r in o[2]],
            infer_logp=[lp for o in outs for lp in o[1]],
        )
        # MoE: a chunk's routing [b, P + its longest response, L, k], right-padded to to_batch's P + T columns
        if self.lm.top_k:
            ro.routing = torch.cat(
                [F.pad(o[3], (0, 0, 0, 0, 0, P + ro.tokens.size(1) - o[3].size(1)), value=-1) for o in outs]
            )
        return ro

    def _generate_chunk(self, prompts: list[list[int]], s: Sampling, uniforms: Tensor, width: int, kept: dict):
        """Rows are the prompts, each repeated s.n times; uniforms [B, N] drive the draws. Returns per row its CPU
        response tokens and log-probs, the finish reasons, and an MoE's routing [B, width + T, L, k] (width: the longest
        prompt of the whole generate call, for to_batch's columns). With the prefix cache, the rows' keys and values
        go into `kept`."""
        n = s.n
        B = len(prompts) * n
        lay = self._layout(prompts, n, s.max_new_tokens)
        P = lay.ids.size(1)
        slots = self._kv_cache(B, P + s.max_new_tokens)
        kv = [(slots[i, 0], slots[i, 1]) for i in range(self.lm.n_layers)]
        routes, steps = ([], []) if self.lm.top_k else (None, None)  # MoE: each layer's experts per input position
        logits = self._prefill(prompts, n, lay, slots, kv, routes)
        tokens, logp, mask, done = self._decode(logits, s, uniforms, lay, kv, steps)
        finish = ["stop" if d else "length" for d in done.tolist()]
        routing = None
        if routes is not None:  # [B, width + T, L, k]: prompt (its pads -1), response tokens 0 .. T-2, -1 for the last
            pre = torch.stack(routes, 2).repeat_interleave(n, dim=0).masked_fill(~lay.valid[:, :P, None, None], -1)
            dec = torch.cat(steps + [torch.full_like(pre[:, :1], -1)], 1).masked_fill(~mask[:, :, None, None], -1)
            routing = F.pad(torch.cat([pre, dec], 1), (0, 0, 0, 0, width - P, 0), value=-1).cpu()
        lens = mask.sum(1).tolist()  # a row's tokens are a prefix: it stops at its stop token
        tokens = tokens.cpu()
        logp = logp.cpu()
        for b, k in enumerate(lens if self.prefix_cache else []):  # the slots written: prompt and response[:-1]
            key = tuple(prompts[b // n] + tokens[b, : k - 1].tolist())
            kept[key] = slots[:, :, b, :, int(lay.n_pad[b]) : P + k - 1].clone()
        return [x[:k] for x, k in zip(tokens, lens)], [x[:k] for x, k in zip(logp, lens)], finish, routing

    def _layout(self, prompts: list[list[int]], n: int, N: int) -> _Layout:
        """The chunk's left-padded prompts and masks. Left padding makes every row write its next token to the same
        cache slot; rope positions start at 0 at each row's first real token, as in the trainer's unpadded (or
        position_ids) forward."""
        dev = self.device
        K = self.lm.n_kv
        B = len(prompts) * n
        lens = torch.tensor([len(p) for p in prompts])
        P = int(lens.max())
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
            prefill_mask = self._additive(attend)
        return _Layout(ids, n_pad, pos, valid, decode_mask, prefill_mask)

    def _additive(self, attend: Tensor) -> Tensor:
        """A boolean attention pattern [q, k] as the additive mask [q, 1, k] the forward takes."""
        return torch.zeros(attend.shape, dtype=self.dtype, device=self.device).masked_fill(~attend, -math.inf)[:, None]

    def _prefill(self, prompts: list[list[int]], n: int, lay: _Layout, slots: Tensor, kv: list, routes) -> Tensor:
        """Prefill each distinct prompt once, into the cache rows of its first sample (rows 0, n, 2n, ...), then copy
        those slots to the prompt's other n - 1 rows. Returns the logits [B, V] of each row's first response token."""
        dev = self.device
        P = lay.ids.size(1)
        prefill_mask = lay.prefill_mask
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
            q_slot = torch.arange(cut, P, device=dev)[:, None]
            key = torch.arange(P, device=dev)
            attend = (key <= q_slot) & lay.valid[::n, None, :P] | (key == q_slot)  # a pad query sees itself, as above
            prefill_mask = self._additive(attend)
        self.prefill_tokens += sum(min(len(p), P - cut) for p in prompts)
        first_rows = [(k[::n], v[::n]) for k, v in kv]  # each prompt's first sample's cache rows
        h = self.lm.forward(lay.ids[:, cut:].to(dev), lay.pos[::n, cut:P], prefill_mask, first_rows, cut, routes)
        if n > 1:
            B = len(prompts) * n
            for cache in (c for pair in kv for c in pair):
                grouped = cache.view(B // n, n, *cache.shape[1:])[:, :, :, :P]
                grouped[:, 1:] = grouped[:, :1]
        return F.linear(h[:, -1], self.lm.lm_head).repeat_interleave(n, dim=0)  # [B, V]

    def _decode(self, logits: Tensor, s: Sampling, uniforms: Tensor, lay: _Layout, kv: list, steps):
        """Draw up to s.max_new_tokens tokens per row from the prefill's logits, one forward per step, until every row
        has stopped. Returns (tokens [B, T], log-probs [B, T], mask [B, T]: the response tokens, the stop token
        included, done [B]: the row stopped); an MoE's routing of each step goes into `steps`."""
        dev = self.device
        N = s.max_new_tokens
        B, P = logits.size(0), lay.ids.size(1)
        stop = torch.tensor(s.stop_token_ids, dtype=torch.long, device=dev)
        tokens = torch.zeros(B, N, dtype=torch.long, device=dev)
        logp = torch.zeros(B, N, dtype=torch.float32, device=dev)
        alive = torch.zeros(B, N, dtype=torch.bool, device=dev)
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        for t in range(N):
            x = logprobs.process_logits(logits, s.temperature, top_k=s.top_k, top_p=s.top_p)  # [B, V] fp32
            lse = torch.logsumexp(x, dim=-1, keepdim=True)
            # Inverse-CDF draw: one uniform per row (torch.multinomial draws V exponentials per row).
            # searchsorted(right=True) returns the first token whose cumulative mass exceeds u, so a token
            # of probability 0 (excluded by top-k / top-p) is never picked; u < total keeps it below V.
            cdf = (x - lse).exp().cumsum(-1)
            total = cdf[:, -1:]
            u = torch.minimum(uniforms[:, t : t + 1] * total, total.nextafter(torch.zeros_like(total)))
            tok = torch.searchsorted(cdf, u, right=True)  # [B, 1]
            # logprobs.token_logprobs' formula, so engine and trainer share one definition.
            logp[:, t] = (x.gather(-1, tok) - lse)[:, 0]
            tokens[:, t] = tok[:, 0]
            alive[:, t] = ~done  # the stop token itself is part of the response
            done |= (tok == stop).any(-1)
            if t == N - 1 or bool(done.all()):
                break
            r = None if steps is None else []
            h = self.lm.forward(tok, lay.pos[:, P + t : P + t + 1], lay.decode_mask[..., : P + t + 1], kv, P + t, r)
            if r is not None:
                steps.append(torch.stack(r, 2))  # [B, 1, L, k]: response token t as input
            logits = F.linear(h[:, -1], self.lm.lm_head)
        T = t + 1
        return tokens[:, :T], logp[:, :T], alive[:, :T], done
