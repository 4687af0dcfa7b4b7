"""Fake quantisation of the embedded engine's decoder Linear weights (rollout.EmbeddedEngine dtype "fp8" / "int4"):
round a weight through the low-precision format and back, so bf16 compute sees what a quantised engine computes with."""

import torch
from torch import Tensor

# Largest finite float8_e4m3fn value: the per-channel scale maps each row's absmax onto it.
FP8_E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max
INT4_GROUP_SIZE = 32  # dtype "int4": consecutive input elements per scale


def fake_quant_fp8(w: Tensor) -> Tensor:
    """Round a Linear weight [out, in] through float8_e4m3fn with one scale per output channel, and back."""
    scale = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / FP8_E4M3_MAX
    return (w / scale).to(torch.float8_e4m3fn).to(w.dtype) * scale


def fake_quant_int4(w: Tensor, group_size: int = INT4_GROUP_SIZE) -> Tensor:
    """Round a Linear weight [out, in] through symmetric weight-only int4, one scale per group, and back.

    The FlashRL / GPTQ-style symmetric rule, in float32: each row is cut into groups of `group_size`
    consecutive input elements (dim 1), and per group

        s = absmax(group) / 7,   q = clamp(round(w / s), -8, 7),   w_hat = q * s

    so every w_hat is an integer multiple of its group's scale (at most 16 levels per group; -8 is never
    reached since |w / s| <= 7), the group's absmax element is kept exactly (up to float rounding), and
    |w - w_hat| <= s / 2 for every element. Returns w_hat in w's dtype. `in` must be a multiple of group_size.
    """
    rows, cols = w.shape
    if cols % group_size:
        raise ValueError(f"fake_quant_int4: the input dimension {cols} of a [{rows}, {cols}] weight is not a "
                         f"multiple of group_size={group_size}")
    g = w.float().reshape(rows, cols // group_size, group_size)
    s = g.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / 7  # the clamp only guards all-zero groups
    return ((g / s).round().clamp(-8, 7) * s).reshape(rows, cols).to(w.dtype)


def fake_quant(name: str, w: Tensor, kind: str) -> Tensor:
    """w rounded as engine dtype `kind` stores it ("fp8", "int4"; anything else: w unchanged). name is for the error."""
    if kind == "fp8":
        return fake_quant_fp8(w)
    if kind == "int4":
        if w.size(1) % INT4_GROUP_SIZE:
            raise NotImplementedError(f"EmbeddedEngine: dtype 'int4' quantises groups of {INT4_GROUP_SIZE} input "
                                      f"elements; {name!r} has shape {tuple(w.shape)}, whose input size "
                                      f"{w.size(1)} is not a multiple of {INT4_GROUP_SIZE}")
        return fake_quant_int4(w)
    return w
