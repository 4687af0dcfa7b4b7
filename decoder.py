"""The embedded engine's model (embedded_engine.EmbeddedEngine): the forward pass of a Hugging Face Llama / Qwen2 / Qwen3 /
Qwen3-MoE causal LM over its weights fused into a per-layer store (q/k/v and gate/up as one matrix each), gpt-fast
style: SDPA, RoPE, GQA and the engine's preallocated KV cache, no mask builders or cache objects per step. Every
operation follows Hugging Face's order and dtypes, so an fp32 engine's log-probs equal the trainer's
(tests/test_rollout.py). The engine owns the weights (precision, sync, memory) and sampling; this module the math,
and `load_pretrained`, the one way the project loads a model folder's weights.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor

import moe
from parallel import SUPPORTED_MODELS


def load_pretrained(cls, path: str, what: str, *, new: tuple[str, ...] = (), unused: tuple[str, ...] = (), **kw):
    """cls.from_pretrained(path, **kw) that refuses weights which do not fill the architecture: a tensor the model has
    and the files lack (transformers would initialise it at random, and the run would train on it), one the files
    have and the model does not use, or one of another shape. `what` names the source in the message ("--model
    path"); `new` and `unused` are name prefixes that may be missing (a fresh head) or left over (a dropped head).
    Transformers' own loading report decides, so tied embeddings, unsaved buffers and its checkpoint key renames
    count as it loads them, at no cost beyond the load itself."""
    model, info = cls.from_pretrained(path, output_loading_info=True, ignore_mismatched_sizes=True, **kw)
    name = type(model).__name__

    def shape(k):
        return f"{k[0]} ({tuple(k[1])} in the files, {tuple(k[2])} in the model)" if isinstance(k, tuple) else str(k)

    missing = sorted(k for k in info["missing_keys"] if not k.startswith(new))
    unexpected = sorted(k for k in info["unexpected_keys"] if not k.startswith(unused))
    problems = {
        f"lacks {{}} tensor(s) that {name} needs": missing,
        f"has {{}} tensor(s) that {name} does not use": unexpected,
        "has {} tensor(s) of another shape than the model's": sorted(map(shape, info["mismatched_keys"])),
    }
    if any(problems.values()):
        files = sorted(f for f in os.listdir(path) if f.endswith((".safetensors", ".bin", ".index.json")))
        why = "; it ".join(
            f"{how.format(len(ks))}: {', '.join(ks[:5])}{', ...' if len(ks) > 5 else ''}"
            for how, ks in problems.items()
            if ks
        )
        raise ValueError(
            f"{what}: the weights in {path} ({', '.join(files) or 'no weight files'}) do not match its "
            f"config.json: the folder {why}. Fix the folder (model.save_pretrained writes a complete one) "
            "or its config.json"
        )
    return model


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
        raise ValueError(
            f"fake_quant_int4: the input dimension {cols} of a [{rows}, {cols}] weight is not a "
            f"multiple of group_size={group_size}"
        )
    g = w.float().reshape(rows, cols // group_size, group_size)
    s = g.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / 7  # the clamp only guards all-zero groups
    return ((g / s).round().clamp(-8, 7) * s).reshape(rows, cols).to(w.dtype)


# HF name inside a decoder layer -> (slot in the fused per-layer store, part index). Parts of one slot
# are concatenated along dim 0 (output rows) so q/k/v and gate/up each run as a single matmul.
LAYER_SLOTS = {
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
LAYER_SLOTS |= {
    k.replace(".weight", ".bias"): (slot + "_b", part)
    for k, (slot, part) in LAYER_SLOTS.items()
    if slot in ("qkv", "o", "gu", "down")
}
LAYER_KEYS = (
    "ln1",
    "qkv",
    "qkv_b",
    "qn",
    "kn",
    "o",
    "o_b",
    "ln2",
    "gu",
    "gu_b",
    "down",
    "down_b",
    "router",
    "egu",
    "edown",
)
TOP_SLOTS = {"model.embed_tokens.weight": "embed", "model.norm.weight": "norm", "lm_head.weight": "lm_head"}


def check_arch(config) -> None:
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


class Decoder:
    """The forward pass of one model (check_arch(config) first) in compute dtype `dtype`; keys and values are rounded
    through `kv_dtype` when it differs (the fp8 KV cache). `bind` gives it the engine's fused weights."""

    def __init__(self, config, dtype: torch.dtype, kv_dtype: torch.dtype, device: torch.device):
        c = config
        self.dtype = dtype
        self.kv_dtype = kv_dtype
        self.n_layers = c.num_hidden_layers
        self.n_heads = c.num_attention_heads
        self.n_kv = c.num_key_value_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.eps = c.rms_norm_eps
        self.scale = self.head_dim**-0.5  # the scale HF and SDPA use
        self.top_k = getattr(c, "num_experts_per_tok", 0)
        self.norm_topk = getattr(c, "norm_topk_prob", False)
        # moe.sparse_block's expert flips (EmbeddedEngine moe_flip)
        self.flip: tuple[float, torch.Generator] | None = None
        # RoPE tables for every position, computed like HF (fp32 angles, then cast to the compute dtype).
        D = self.head_dim
        theta = c.rope_parameters["rope_theta"]
        inv_freq = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float) / D))
        freqs = torch.arange(c.max_position_embeddings).float()[:, None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device, dtype)
        self.sin_signed = torch.cat((-emb[:, : D // 2].sin(), emb[:, D // 2 :].sin()), dim=-1).to(device, dtype)

    def bind(self, store: dict[str, Tensor], tied: bool) -> None:
        """Per-layer weight tuples for the hot loop, from the store (rebound whenever the store moves)."""
        self.layers = [tuple(store.get(f"{i}.{k}") for k in LAYER_KEYS) for i in range(self.n_layers)]
        self.embed = store["embed"]
        self.norm = store["norm"]
        self.lm_head = store["embed"] if tied else store["lm_head"]

    def forward(
        self, ids: Tensor, pos: Tensor, attn_mask: Tensor | None, kv=None, start: int = 0, routes: list | None = None
    ) -> Tensor:
        """Final hidden states [B, S, hidden] for ids [B, S] at rope positions pos [B, S]; an MoE model appends each
        layer's experts [B, S, k] to ``routes`` when given.

        start == 0 (a whole sequence, prefill): attention over these S tokens; attn_mask is None (plain
            causal) or additive float [B, 1, S, S] (0 = attend, -inf = masked). With kv the keys and
            values are also written to cache slots 0..S.
        start > 0, S == 1 (one decode step): the new key/value go to cache slot `start`, attention reads
            slots 0..start; attn_mask is additive float [B * n_kv, 1, start + 1].
        start > 0, S > 1 (a window prefill after cached slots 0..start, EmbeddedEngine's prefix cache): keys and values go
            to slots start..start + S, attention reads slots 0..start + S; attn_mask is additive float [B, 1, S, start + S].
        """
        B, S = ids.shape
        H, K, D = self.n_heads, self.n_kv, self.head_dim
        cos, sin = self.cos[pos].unsqueeze(2), self.sin_signed[pos].unsqueeze(2)  # [B, S, 1, D]
        x = F.embedding(ids, self.embed)
        for i, layer in enumerate(self.layers):
            ln1, qkv_w, qkv_b, qn, kn, o_w, o_b, ln2, gu_w, gu_b, down_w, down_b, router, egu, edown = layer
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
                # k and v through float8_e4m3fn here, so the prefill's attention (and EmbeddedEngine.logits(), which
                # has no cache) sees what decode steps read back from the cache; the cache writes below are exact.
                k, v = k.to(self.kv_dtype).to(self.dtype), v.to(self.kv_dtype).to(self.dtype)
            if kv is not None:
                k_cache, v_cache = kv[i]
                k_cache[:, :, start : start + S] = k
                v_cache[:, :, start : start + S] = v
            if start == 0 or S > 1:  # a window after cached slots reads the keys and values of slots 0..start + S
                if start:
                    k, v = k_cache[:, :, : start + S].to(self.dtype), v_cache[:, :, : start + S].to(self.dtype)
                a = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=attn_mask, is_causal=attn_mask is None, enable_gqa=K != H
                )
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
                x = x + moe.sparse_block(h, router, egu, edown, self.top_k, self.norm_topk, routes, self.flip)
        return _rmsnorm(x, self.norm, self.eps)
