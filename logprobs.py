"""Token log-probs and the sampling transform, shared by the rollout engines and the trainer: pure tensor functions,
torch-only.

    x = process_logits(logits, temperature, top_k=k, top_p=p)       # the distribution both sides sample / score
    logp = token_logprobs(logits, tokens, temperature)              # [B, T] float32, log softmax(x) at tokens
    logp, entropy = head_logprobs(lm_head, hidden, tokens, temperature, entropy=True)   # no [B, T, V] logits

One definition on both sides is what makes the embedded engine's log-probs equal the trainer's recompute at the same
weights and dtype (docs/algorithms.md, "Embedded engine sampling").
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint
from torch import Tensor

# Log-prob reported for a token that top-k / top-p excluded from the distribution (-inf would poison
# ratios and gradients; -1e4 has probability 0 in fp32 yet subtracts cleanly).
EXCLUDED_LOGP = -1e4
# Rows of [N, V] logits handled at once by token_logprobs / entropy_from_logits: bounds the float32
# temporaries of log-softmax to CHUNK_ROWS x V instead of B x T x V.
CHUNK_ROWS = 1024
# Logits computed at once by head_logprobs (positions x vocabulary): 2**25 float32 = 128 MiB, 220 positions of Qwen's
# 151,936-token vocabulary, so a step's logits memory stays flat in both prompt and response length.
HEAD_CHUNK_ELEMENTS = 2**25


def process_logits(logits: Tensor, temperature: float = 1.0, *, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """The sampling distribution's logits: float32, temperature-scaled, then top-k, then top-p.

        x = float32(logits) / temperature                  (temperature <= 0: ValueError)
        top_k == 1:       keep only argmax(x)              (greedy; ties to the lowest token id)
        1 < top_k < V:    keep x_i >= the k-th largest x   (every token tied with the k-th value is kept)
        top_p < 1:        p = softmax(x) sorted descending; drop token j when p_0 + ... + p_{j-1} >= top_p

    Excluded entries are -inf. top_k = 0 and top_p = 1.0 mean off, and a top_k >= V is a no-op. Top-p keeps the
    smallest set of tokens whose cumulative probability (after temperature and top-k, renormalised) reaches top_p,
    always including the most likely token. The rollout engine samples from softmax of exactly this, and the trainer
    recomputes log-probs through it, so engine and trainer share one definition.

    logits: [..., V] any float dtype; temperature: > 0; top_k: int >= 0; top_p: in (0, 1]. Returns [..., V] float32
    (a new tensor unless it is already float32 with temperature 1 and no truncation). Sources: top-p sampling,
    Holtzman et al. 2019, arXiv 1904.09751; the order temperature, top-k, top-p is Hugging Face's logits warpers'
    (SGLang's nucleus uses the mass before the top-k renormalisation: see sglang_engine.py).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    if top_k == 1:
        # Greedy: exactly one token, the argmax with ties broken towards the lowest token id (torch.argmax
        # returns the first maximum). The kth-value rule below would keep every token tied with the max,
        # and bf16 or int4 logits tie often, so greedy evaluation would depend on the sampling seed.
        keep = torch.zeros_like(x, dtype=torch.bool).scatter_(-1, x.argmax(-1, keepdim=True), True)
        x = x.masked_fill(~keep, float("-inf"))
    elif top_k > 0 and top_k < x.size(-1):
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = sorted_x.softmax(-1)
        # Drop a token when the mass strictly before it already reaches top_p (keeps the top token).
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


def token_logprobs(
    logits: Tensor, tokens: Tensor, temperature: float = 1.0, *, top_k: int = 0, top_p: float = 1.0
) -> Tensor:
    """Log-prob of each token under softmax(process_logits(logits, temperature, top_k, top_p)):

        logp[b, t] = max(x[b, t, y] - logsumexp(x[b, t]), EXCLUDED_LOGP),   x = process_logits(logits), y = tokens[b, t]

    logits: [B, T, V] (any float dtype), aligned so logits[:, t] predicts tokens[:, t].
    tokens: [B, T] long; temperature, top_k, top_p: as ``process_logits``. Returns [B, T] float32, differentiable
    w.r.t. logits. Works on CHUNK_ROWS rows at a time, so at most one [B, T, V] float32 copy is held (the one autograd
    keeps for backward; none for float32 logits at temperature 1). Tokens that top-k / top-p excluded
    get EXCLUDED_LOGP with zero gradient. The log-softmax gathered at the token of verl's logprobs_from_logits and
    TRL's selective_log_softmax, on the processed logits.
    """
    assert logits.dim() == 3 and tokens.shape == logits.shape[:2], (
        f"logits {tuple(logits.shape)} vs tokens {tuple(tokens.shape)}"
    )
    flat_logits = logits.reshape(-1, logits.size(-1))
    flat_tokens = tokens.reshape(-1, 1)
    out = []
    for start in range(0, flat_logits.size(0), CHUNK_ROWS):
        x = process_logits(flat_logits[start : start + CHUNK_ROWS], temperature, top_k=top_k, top_p=top_p)
        picked = x.gather(-1, flat_tokens[start : start + CHUNK_ROWS]).squeeze(-1)
        out.append((picked - torch.logsumexp(x, dim=-1)).clamp_min(EXCLUDED_LOGP))
    return torch.cat(out).view(tokens.shape) if out else flat_logits.new_zeros(tokens.shape, dtype=torch.float32)


def head_logprobs(
    head,
    hidden: Tensor,
    tokens: Tensor,
    temperature: float = 1.0,
    *,
    top_k: int = 0,
    top_p: float = 1.0,
    entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """token_logprobs(head(hidden), tokens) without a [B, T, V] logits tensor: the LM head runs on
    HEAD_CHUNK_ELEMENTS // V positions at a time and each chunk's logits are freed at once; under autograd a chunk is
    checkpointed, so its backward recomputes head(chunk) instead of keeping every chunk's logits. Peak extra memory is
    a few copies of one chunk's logits, whatever B and T.

    head: the LM head (an nn.Linear [N, H] -> [N, V], possibly tensor-parallel); hidden: [B, T, H] hidden states
    aligned so hidden[:, t] predicts tokens[:, t] (long [B, T]); temperature, top_k, top_p: as ``process_logits``.
    Returns (log-probs [B, T] float32, differentiable w.r.t. hidden and the head's weights; entropy [B, T] float32 of
    softmax(logits / temperature), detached, or None unless ``entropy``). The formulas are token_logprobs' and
    entropy_from_logits'; the chunking is the project's own (docs/algorithms.md, section 1).
    """
    assert hidden.dim() == 3 and tokens.shape == hidden.shape[:2], (
        f"hidden {tuple(hidden.shape)} vs tokens {tuple(tokens.shape)}"
    )
    flat_h = hidden.reshape(-1, hidden.size(-1))
    flat_t = tokens.reshape(-1, 1)

    def chunk(h: Tensor, t: Tensor) -> tuple[Tensor, Tensor | None]:
        logits = head(h)[None]
        lp = token_logprobs(logits, t.view(1, -1), temperature, top_k=top_k, top_p=top_p)[0]
        return lp, entropy_from_logits(logits.detach(), temperature)[0] if entropy else None

    grad = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in head.parameters()))
    # Positions per chunk; a DTensor weight reports its global shape, so V is the whole vocabulary under TP too.
    step = max(1, HEAD_CHUNK_ELEMENTS // head.weight.shape[0])
    logp, ent = [], []
    for start in range(0, flat_h.size(0), step):
        h = flat_h[start : start + step]
        t = flat_t[start : start + step]
        lp, e = torch.utils.checkpoint.checkpoint(chunk, h, t, use_reentrant=False) if grad else chunk(h, t)
        logp.append(lp)
        if entropy:
            ent.append(e.detach())
    if not logp:
        empty = hidden.new_zeros(tokens.shape, dtype=torch.float32)
        return empty, empty if entropy else None
    return torch.cat(logp).view(tokens.shape), torch.cat(ent).view(tokens.shape) if entropy else None


def entropy_from_logits(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy of softmax(logits / temperature) per position:

        H = -sum_v p_v log p_v,   p = softmax(float32(logits) / temperature)

    logits: [B, T, V] (or [..., V]) any float dtype; temperature: > 0. Returns [B, T] float32, differentiable w.r.t.
    logits (head_logprobs detaches it), computed CHUNK_ROWS rows at a time. Temperature only: top-k / top-p are not
    applied. Logged as ppo/entropy. The quantity of verl's entropy_from_logits, on logits / temperature.
    """
    flat = logits.reshape(-1, logits.size(-1))
    out = []
    for start in range(0, flat.size(0), CHUNK_ROWS):
        logp = torch.log_softmax(process_logits(flat[start : start + CHUNK_ROWS], temperature), dim=-1)
        out.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(out).view(logits.shape[:-1]) if out else flat.new_zeros(logits.shape[:-1], dtype=torch.float32)
