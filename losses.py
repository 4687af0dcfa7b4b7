"""Losses and estimators of the recipe: pure tensor functions, torch-only.

One alignment convention for everything below: per-token tensors are ``[B, T]`` over response tokens,
right-padded, with a bool ``mask`` of the same shape that is True on real response tokens. Policies:

    logp        pi_theta, the policy being optimised (trainer, with grad)
    old_logp    pi_old, the trainer's own recompute at the rollout weights, before any update (no grad)
    infer_logp  pi_infer, what the rollout engine reported for the token it sampled
    ref_logp    pi_ref, a frozen initial policy (only when a KL term is on)

Functions that produce diagnostics return ``(value, metrics)``; metrics are detached 0-d tensors under
namespaced keys, local to the tensors passed in (the trainer reduces them across ranks once per step).
Each function's docstring states its formula, shapes, denominator and source.

    >>> from losses import ppo_policy_loss, icepop_weights   # in a notebook, with only torch installed
"""

from __future__ import annotations

import torch
from torch import Tensor

# exp() of a log-ratio beyond +-20 (a factor of 5e8) is never a useful ratio; clamping keeps exp finite
# so a single wild token cannot turn the loss into inf/NaN. The IcePop band lies far inside it.
LOG_RATIO_CLAMP = 20.0
# A per-token KL estimate is capped at +-10, as verl (kl_penalty) and OpenRLHF (compute_approx_kl) do: with the
# log-ratio alone clamped at +-20, one token could put exp(20) ~ 4.85e8 into the k3 loss, and a gradient as large.
KL_ESTIMATE_CAP = 10.0

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _check(mask: Tensor, **tensors: Tensor) -> None:
    """Assert the alignment convention: bool [B, T] mask, every tensor the same [B, T] shape."""
    assert mask.dtype == torch.bool and mask.dim() == 2, (
        f"mask must be bool [B, T], got {mask.dtype} {tuple(mask.shape)}"
    )
    for name, t in tensors.items():
        assert t.shape == mask.shape, f"{name} has shape {tuple(t.shape)}, mask has {tuple(mask.shape)}"


def _mean0(x: Tensor, mask: Tensor) -> Tensor:
    """Masked mean as a detached metric; 0 (not NaN) when nothing is masked in."""
    return (x * mask).sum().detach() / mask.sum().clamp_min(1)


# ----------------------------------------------------------------------------- masked statistics


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """sum(x * mask) / sum(mask), over all elements or along ``dim``."""
    if dim is None:
        return (x * mask).sum() / mask.sum()
    return (x * mask).sum(dim) / mask.sum(dim)


def whiten_stats(x: Tensor, mask: Tensor) -> Tensor:
    """[sum x, sum x^2, count] over the masked elements, in float64 (squares of large values overflow float32): sum
    them over data-parallel ranks, then ``whiten``, to whiten over the global batch."""
    x = x.double()
    return torch.stack([(x * mask).sum(), (x * x * mask).sum(), mask.sum()])


def whiten(x: Tensor, mask: Tensor, stats: Tensor, eps: float = 1e-8) -> Tensor:
    """(x - mean) / sqrt(var + eps) with the mean and unbiased variance of ``whiten_stats``; masked-out entries become 0.
    float32 out. No element: mean 0 (not NaN); one element: variance over 1, not 0."""
    mean = stats[0] / stats[2].clamp_min(1)
    var = (stats[1] - stats[2] * mean**2) / (stats[2] - 1).clamp_min(1)
    return ((x.double() - mean) * torch.rsqrt(var + eps)).float() * mask


# ----------------------------------------------------------------------------- advantages


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float | Tensor) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over response tokens (Schulman et al. 2016).

    delta_t = r_t + gamma V_{t+1} - V_t;  A_t = delta_t + gamma lam A_{t+1};  R_t = A_t + V_t,
    with V = A = 0 after the last valid token. Masked positions are transparent ("skip observation",
    verl / SAO): the recursion runs over valid tokens only, so an observation span inside a multi-turn
    response neither breaks nor discounts the chain. With gamma = lam = 1 and a terminal reward R,
    A_t = R - V_t; with lam = 0, A_t is the one-step TD error.

    rewards, values: [B, T] float (reward on the last valid token for outcome rewards; rewards on masked
    positions are ignored). lam: a float or a [B] tensor (per-sequence lambda, e.g. length-adaptive).
    Returns (advantages, returns), [B, T] float32, 0 on masked positions, no grad.
    """
    _check(mask, rewards=rewards, values=values)
    with torch.no_grad():
        B, T = mask.shape
        rewards, values, m = rewards.float(), values.float(), mask.float()
        lam = torch.as_tensor(lam, dtype=torch.float32, device=mask.device).expand(B)
        next_value = rewards.new_zeros(B)
        next_adv = rewards.new_zeros(B)
        adv = torch.zeros_like(rewards)
        for t in reversed(range(T)):
            delta = rewards[:, t] + gamma * next_value - values[:, t]
            a = delta + gamma * lam * next_adv
            adv[:, t] = a * m[:, t]
            # A masked position passes the next valid token's value and advantage through unchanged.
            next_value = torch.where(mask[:, t], values[:, t], next_value)
            next_adv = torch.where(mask[:, t], a, next_adv)
        return adv, (adv + values) * m


def vine_advantages(values: Tensor, states: Tensor, rewards: Tensor, mask: Tensor) -> Tensor:
    """Monte Carlo advantages over chunks (VinePPO, Kazemnejad et al. 2024, arXiv 2410.01679), gamma = 1. The states
    t_0 < t_1 < ... of a row (``states`` True) cut it into chunks [t_j, t_{j+1}), the last one ending at the row's end
    (terminal, V = 0). Every token of chunk j gets A = r(chunk j) + V(s_{t_{j+1}}) - V(s_{t_j}), r(chunk) = the sum of
    ``rewards`` on its valid tokens: with a state at every token, GAE with lambda 0; with one at the first, R - V(s_0).
    Tokens before a row's first state (no baseline) get 0. values: [B, T] V(s_t), the expected rewards from token t on
    (read where ``states``); states: [B, T] bool, on valid tokens only; rewards: [B, T]. Returns [B, T] float32, 0 on
    masked positions, no grad."""
    _check(mask, values=values, states=states, rewards=rewards)
    assert not (states & ~mask).any(), "vine_advantages: a state must sit on a valid token"
    with torch.no_grad():
        B, T = mask.shape
        cols = torch.arange(T, device=mask.device).expand(B, T)
        togo = (rewards.float() * mask).flip(-1).cumsum(-1).flip(-1)  # G_t: the rewards of columns t .. T-1
        # D_t = G_t - V_t at the states, 0 at the end: A over chunk [a, b) = (G_a - G_b) + V_b - V_a = D_a - D_b.
        d = torch.cat([torch.where(states, togo - values.float(), 0.0), torch.zeros(B, 1, device=mask.device)], -1)
        cur = torch.where(states, cols, -1).cummax(-1).values  # the state at or before t (-1: none)
        nxt = torch.where(states, cols, T).flip(-1).cummin(-1).values.flip(-1)  # the state at or after t
        nxt = torch.cat([nxt[:, 1:], torch.full((B, 1), T, device=mask.device)], -1)  # strictly after t (T: the end)
        adv = d.gather(-1, cur.clamp_min(0)) - d.gather(-1, nxt)
        return torch.where(mask & (cur >= 0), adv, 0.0)


def last_token_rewards(scores: Tensor, mask: Tensor) -> Tensor:
    """Outcome rewards [B] placed on each row's last valid token of mask [B, T]: [B, T] float32, 0 elsewhere (a row
    without a valid token gets nothing). The last valid token, not column lengths - 1: a multi-turn row has holes
    (observation tokens, mask False) and may end in one."""
    _check(mask, scores=scores[:, None].expand_as(mask))
    cols = torch.arange(mask.size(1), device=mask.device)
    last = torch.where(mask, cols, -1).amax(-1)  # [B], -1 if the row has no valid token
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    rows = (last >= 0).nonzero()[:, 0]
    out[rows, last[rows]] = scores[rows].float()
    return out


def length_adaptive_lambda(lengths: Tensor, alpha: float) -> Tensor:
    """VAPO's length-adaptive GAE lambda = 1 - 1 / (alpha * L), per sequence; [B] -> [B] float32.

    VAPO (arXiv 2504.05118) uses alpha = 0.05; SAO re-implementations alpha = 1.5. Clamped to [0, 1]
    so very short responses get lambda 0 (pure TD) rather than a negative lambda."""
    return (1.0 - 1.0 / (alpha * lengths.float().clamp_min(1))).clamp(0.0, 1.0)


def grpo_advantages(
    scores: Tensor, group_size: int, norm_std: bool = True, eps: float = 1e-6, valid: Tensor | None = None
) -> Tensor:
    """Group-relative advantages (GRPO, arXiv 2402.03300; Dr. GRPO arXiv 2503.20783 drops the std). scores: [N] one
    scalar per response; groups of ``group_size`` are contiguous. A_i = (R_i - mean_group) / (std_group + eps) with the
    unbiased std (or without the division when norm_std=False). A group of size 1 has no baseline: its advantage is 0.
    ``valid`` ([N] bool, default all True) marks the rewarded responses: the mean and std are over a group's valid
    members only, an invalid response gets 0, and so does every member of a group with fewer than 2 valid ones (no
    baseline). Returns [N] float32."""
    if scores.dim() != 1 or scores.numel() % group_size:
        raise ValueError(f"grpo_advantages: {scores.numel()} scores do not split into groups of {group_size}")
    if group_size == 1:
        return torch.zeros_like(scores, dtype=torch.float32)
    g = scores.float().view(-1, group_size)
    if valid is None:
        adv = g - g.mean(-1, keepdim=True)
        if norm_std:
            adv = adv / (g.std(-1, keepdim=True) + eps)
        return adv.view(-1)
    v = valid.view(-1, group_size).to(g.dtype)
    n = v.sum(-1, keepdim=True)
    mean = (g * v).sum(-1, keepdim=True) / n.clamp_min(1)
    adv = (g - mean) * v
    if norm_std:
        std = ((adv**2).sum(-1, keepdim=True) / (n - 1).clamp_min(1)).sqrt()
        adv = adv / (std + eps)
    return (adv * (n >= 2)).view(-1)


def running_mean_advantages(rewards: Tensor, past: Tensor, past_count: Tensor, batch_mean: Tensor) -> Tensor:
    """REINFORCE with a running-mean per-prompt baseline (SAO's control): A_i = R_i - b_i, b_i the mean of the earlier
    rewards of row i's prompt, or batch_mean (0-d: the step's mean over the global batch) where it has none. rewards: [N]
    (episode returns); past: [N, W] its last W earlier rewards, right-padded, entries at or after past_count [N] (long,
    in [0, W]) ignored. Returns [N] float32."""
    if past.shape != (rewards.numel(), past.size(-1)) or past_count.shape != rewards.shape:
        raise ValueError(
            f"running_mean_advantages: past {tuple(past.shape)}, past_count {tuple(past_count.shape)} do not "
            f"match rewards {tuple(rewards.shape)}"
        )
    used = torch.arange(past.size(1), device=past.device) < past_count[:, None]
    baseline = torch.where(
        past_count > 0, (past.double() * used).sum(-1) / past_count.clamp_min(1), batch_mean.double()
    )
    return (rewards.double() - baseline).float()


def kl_estimate(logp: Tensor, ref_logp: Tensor, kind: str) -> Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from samples of pi_theta (Schulman 2020).

    log r = ref_logp - logp (clamped at +-LOG_RATIO_CLAMP before exp); k1 = -log r; k3 = r - 1 - log r
    (unbiased, >= 0). The estimate is capped at +-KL_ESTIMATE_CAP (10, verl's and OpenRLHF's cap): a token past
    the cap adds exactly the cap to the loss and gets zero gradient. Returns [B, T] (same dtype as the inputs);
    aggregate it with ``aggregate``.
    """
    log_r = (ref_logp - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if kind == "k1":
        est = -log_r
    elif kind == "k3":
        est = torch.exp(log_r) - 1 - log_r
    else:
        raise ValueError(f"kl_estimate: unknown kind {kind!r}, expected 'k1' or 'k3'")
    return est.clamp(-KL_ESTIMATE_CAP, KL_ESTIMATE_CAP)


# ----------------------------------------------------------------------------- mismatch corrections


def _train_infer_ratio(old_logp: Tensor, infer_logp: Tensor) -> Tensor:
    """k = pi_old / pi_infer in fp32, log-ratio clamped before exp."""
    return torch.exp((old_logp.float() - infer_logp.float()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def _band_metrics(k: Tensor, mask: Tensor, alpha: float, beta: float, prefix: str) -> dict[str, Tensor]:
    low, high = (k < alpha) & mask, (k > beta) & mask
    return {
        f"{prefix}/masked_frac": _mean0((low | high).float(), mask),
        f"{prefix}/masked_frac_low": _mean0(low.float(), mask),
        f"{prefix}/masked_frac_high": _mean0(high.float(), mask),
        f"{prefix}/seq_masked_frac": (low | high).any(-1).float().mean().detach(),
    }


def icepop_weights(
    old_logp: Tensor, infer_logp: Tensor, mask: Tensor, alpha: float = 0.5, beta: float = 2.0
) -> tuple[Tensor, dict[str, Tensor]]:
    """IcePop token weights M(k) (Ring-1T arXiv 2510.18855; GLM-5 arXiv 2602.15763).

    k_t = pi_old(y_t) / pi_infer(y_t); M(k) = k if alpha <= k <= beta (inclusive) else 0. Out-of-band
    tokens are dropped (zero gradient once multiplied into the loss), not clipped; padding gets 0.
    Project default band [0.5, 2] (GLM-5, beta = 2); Ring-1T used [0.5, 5].
    Returns (weights [B, T] float32, detached; metrics icepop/masked_frac, _low, _high, seq_masked_frac).
    """
    _check(mask, old_logp=old_logp, infer_logp=infer_logp)
    with torch.no_grad():
        k = _train_infer_ratio(old_logp, infer_logp)
        keep = (k >= alpha) & (k <= beta) & mask
        return k * keep, _band_metrics(k, mask, alpha, beta, "icepop")


def tis_weights(
    old_logp: Tensor, infer_logp: Tensor, mask: Tensor, cap: float = 2.0
) -> tuple[Tensor, dict[str, Tensor]]:
    """Truncated importance sampling (Yao et al. 2025): weight min(k, cap).

    k = pi_old / pi_infer. Returns (weights [B, T] float32 detached, 0 on padding; metrics tis/clip_frac,
    tis/weight_mean).
    """
    _check(mask, old_logp=old_logp, infer_logp=infer_logp)
    with torch.no_grad():
        k = _train_infer_ratio(old_logp, infer_logp)
        w = k.clamp(max=cap) * mask
        return w, {"tis/clip_frac": _mean0(((k > cap) & mask).float(), mask), "tis/weight_mean": _mean0(w, mask)}


def geo_seq_mask(
    old_logp: Tensor, infer_logp: Tensor, mask: Tensor, alpha: float = 0.5, beta: float = 2.0
) -> tuple[Tensor, dict[str, Tensor]]:
    """Sequence-level masking by the geometric-mean ratio (length-invariant).

    g = (prod_t k_t)^(1/|y|) = exp(mean_t log k_t) over a sequence's valid tokens; the whole sequence is
    dropped when g is outside [alpha, beta]. Returns (weights [B, T] float32 detached: 1 on the valid
    tokens of kept sequences, 0 elsewhere; metrics geo/seq_masked_frac, geo/ratio_mean).
    """
    _check(mask, old_logp=old_logp, infer_logp=infer_logp)
    with torch.no_grad():
        log_k = (old_logp.float() - infer_logp.float()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        g = torch.exp((log_k * mask).sum(-1) / mask.sum(-1).clamp_min(1))
        keep = (g >= alpha) & (g <= beta)
        return (keep[:, None] & mask).float(), {
            "geo/seq_masked_frac": (~keep).float().mean(),
            "geo/ratio_mean": g.mean(),
        }


def mismatch_metrics(
    old_logp: Tensor, infer_logp: Tensor, mask: Tensor, alpha: float = 0.5, beta: float = 2.0
) -> dict[str, Tensor]:
    """Train-inference mismatch diagnostics (logged by every run, whatever the correction).

    k = pi_old / pi_infer on tokens sampled from pi_infer: mismatch/k1 = mean(infer_logp - old_logp)
    and mismatch/k3 = mean(k - 1 - log k) both estimate KL(pi_infer || pi_old); mean and max
    |old_logp - infer_logp| (the max is max |log k|); k min/mean/max and its 0.1% / 99.9% quantiles; the fractions the
    IcePop band [alpha, beta] would mask; and the effective sample size of the importance weights, normalised to (0, 1]:
    ess = (sum k)^2 / (n sum k^2) over the n valid tokens, seq_ess the same over the rows' weights prod_t k_t (VCPO's
    collapse predictor), 1 without tokens. All under mismatch/, whatever correction is active.
    """
    _check(mask, old_logp=old_logp, infer_logp=infer_logp)
    with torch.no_grad():
        diff = (infer_logp.float() - old_logp.float()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        k, inf, one = (
            torch.exp(-diff),
            torch.tensor(float("inf"), device=diff.device),
            torch.ones((), device=diff.device),
        )
        log_w = -(diff * mask).sum(-1)[
            mask.any(-1)
        ]  # log prod_t k_t per row with tokens; ESS via logsumexp (no overflow)
        return {
            "mismatch/ess": (k * mask).sum() ** 2 / (mask.sum() * (k * k * mask).sum()) if mask.any() else one,
            "mismatch/seq_ess": torch.exp(2 * log_w.logsumexp(0) - (2 * log_w).logsumexp(0)) / len(log_w)
            if len(log_w)
            else one,
            "mismatch/k1": _mean0(diff, mask),
            "mismatch/k3": _mean0(k - 1 + diff, mask),
            "mismatch/abs_diff_mean": _mean0(diff.abs(), mask),
            "mismatch/abs_diff_max": torch.where(mask, diff.abs(), 0).max(),
            "mismatch/ratio_min": torch.where(mask, k, inf).min(),
            "mismatch/ratio_mean": _mean0(k, mask),
            "mismatch/ratio_max": torch.where(mask, k, -inf).max(),
            # the heavy tail, both sides: the 0.1% and 99.9% quantiles of k (linear interpolation), 1 for no tokens
            **dict(
                zip(
                    ("mismatch/ratio_p001", "mismatch/ratio_p999"),
                    k[mask].quantile(torch.tensor([0.001, 0.999], device=k.device))
                    if mask.any()
                    else torch.ones(2, device=k.device),
                )
            ),
            **_band_metrics(k, mask, alpha, beta, "mismatch"),
        }


# ----------------------------------------------------------------------------- aggregation


def window_slope(ys: list[float]) -> float:
    """The least-squares slope of ys against 0, 1, 2, ... (per step; NaN below 2 points or with a NaN): mismatch/k3_slope,
    the trend of k3 over the last steps, an early warning of collapse."""
    y = torch.tensor(ys, dtype=torch.float64)
    x = torch.arange(len(y), dtype=torch.float64) - (len(y) - 1) / 2
    return float((x * (y - y.mean())).sum() / (x * x).sum()) if len(y) > 1 and torch.isfinite(y).all() else float("nan")


def loss_denominator(mask: Tensor, agg: str, max_len: int | None = None) -> Tensor:
    """The denominator of ``aggregate`` for a whole batch, to compute once before micro-batching.

    token-mean: number of valid tokens; seq-mean-token-mean: number of sequences;
    seq-mean-token-sum-norm (Dr. GRPO): B * L_max, L_max = max_len (the generation budget) or T.
    Sum it over data-parallel ranks and pass it as ``num_tokens`` to every micro-batch's loss: the
    micro-batch losses then add up to the full-batch loss, and their gradients to its gradient. It may be 0 (no
    valid token here): clamp it to at least 1 after the sum over ranks, so a rank with nothing adds nothing.
    """
    if agg == "token-mean":
        return mask.sum().float()
    if agg == "seq-mean-token-mean":
        return torch.tensor(float(mask.size(0)), device=mask.device)
    if agg == "seq-mean-token-sum-norm":
        return torch.tensor(float(mask.size(0) * (max_len or mask.size(1))), device=mask.device)
    raise ValueError(f"unknown loss aggregation {agg!r}, expected one of {AGG_MODES}")


def aggregate(
    loss_tok: Tensor, mask: Tensor, agg: str = "token-mean", num_tokens: Tensor | float | None = None
) -> Tensor:
    """Reduce a [B, T] per-token loss to a scalar.

    token-mean: sum(m l) / N_tokens. seq-mean-token-mean: sum over sequences of each sequence's token
    mean / N_seqs. seq-mean-token-sum-norm: sum(m l) / (B * L_max). ``num_tokens`` overrides the
    denominator with the global one (see ``loss_denominator``); default: this batch's own.
    """
    _check(mask, loss_tok=loss_tok)
    denom = loss_denominator(mask, agg).clamp_min(1) if num_tokens is None else num_tokens  # no valid token: 0, not 0/0
    if agg == "seq-mean-token-mean":
        per_seq = (loss_tok * mask).sum(-1) / mask.sum(-1).clamp_min(1)
        return per_seq.sum() / denom
    return (loss_tok * mask).sum() / denom


# ----------------------------------------------------------------------------- policy and value losses


def ppo_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
    is_weights: Tensor | None = None,
    agg: str = "token-mean",
    num_tokens: Tensor | float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped PPO surrogate with clip-higher, optional dual-clip, and per-token IS weights.

    r_t = exp(logp - old_logp) (log-ratio clamped); l_t = max(-A_t r_t, -A_t clip(r_t, 1 - clip_low,
    1 + clip_high)) (DAPO clip-higher: 0.2 / 0.28); with dual_clip = c > 1, for A_t < 0 also
    l_t = min(l_t, -c A_t) (Ye et al. 2020). ``is_weights`` (detached, e.g. IcePop M(k)) multiply l_t:
    tokens with weight 0 get exactly zero gradient but stay in the denominator (the IcePop paper's
    1/|y|). To drop them from the denominator too (verl's rejection form), pass ``mask & (w > 0)``.

    logp: [B, T] with grad; old_logp, advantages: [B, T] no grad; mask: bool [B, T].
    Denominator: ``aggregate(agg, num_tokens)``. Returns (loss, metrics: ppo/clipfrac, ppo/dual_clipfrac,
    ppo/approx_kl (k3 of KL(pi_old || pi_theta)), ppo/ratio_mean).
    """
    _check(mask, logp=logp, old_logp=old_logp, advantages=advantages)
    log_ratio = (logp.float() - old_logp.float()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    adv = advantages.float()
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss_tok = torch.maximum(pg_unclipped, pg_clipped)
    dual = torch.zeros_like(mask)
    if dual_clip is not None:
        assert dual_clip > 1, f"dual_clip must be > 1, got {dual_clip}"
        dual = (adv < 0) & (loss_tok > -dual_clip * adv)
        loss_tok = torch.where(dual, -dual_clip * adv, loss_tok)
    if is_weights is not None:
        _check(mask, is_weights=is_weights)
        loss_tok = loss_tok * is_weights.detach()
    loss = aggregate(loss_tok, mask, agg, num_tokens)
    metrics = {
        "ppo/clipfrac": _mean0((pg_clipped > pg_unclipped).float(), mask),
        "ppo/dual_clipfrac": _mean0(dual.float(), mask),
        "ppo/approx_kl": _mean0(ratio - 1 - log_ratio, mask),
        "ppo/ratio_mean": _mean0(ratio, mask),
    }
    return loss, metrics


def dis_policy_loss(
    logp: Tensor,
    infer_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    agg: str = "token-mean",
    num_tokens: Tensor | float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DIS actor loss (GLM-5 agentic RL; SAO arXiv 2607.07508, the GLM-5.2 actor loss): no pi_old.

    rho_t = pi_theta / pi_infer; f(rho) = rho if 1 - eps_low < rho < 1 + eps_high (strict) else 0;
    l_t = -sg(f(rho_t) A_t) * logp_t, so in-band tokens get the importance-weighted policy gradient
    and out-of-band tokens exactly zero gradient (and stay in the denominator).
    Returns (loss, metrics: dis/masked_frac, dis/ratio_mean).
    """
    _check(mask, logp=logp, infer_logp=infer_logp, advantages=advantages)
    with torch.no_grad():
        rho = torch.exp((logp.float() - infer_logp.float()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        in_band = (rho > 1 - eps_low) & (rho < 1 + eps_high)
        coef = rho * in_band * advantages.float()
    loss = aggregate(-coef * logp.float(), mask, agg, num_tokens)
    return loss, {"dis/masked_frac": _mean0((~in_band).float(), mask), "dis/ratio_mean": _mean0(rho, mask)}


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    clip: float | None,
    agg: str = "token-mean",
    num_tokens: Tensor | float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss: 0.5 * agg(max((V - R)^2, (V_old + clip(V - V_old, -clip, clip) - R)^2)).

    values: [B, T] critic output with grad; old_values: [B, T] critic output at rollout time; returns:
    [B, T] GAE targets, the critic's regression targets; mask: [B, T] bool, the tokens that count.
    clip: eps_v (project default 0.2, slime); None disables the clipped branch.
    The 1/2 is PPO's convention (cleanrl, verl, OpenRLHF): the gradient of the unclipped branch is the residual
    V - R. No other scale: the critic has its own AdamW, which cancels a constant factor on the loss.
    Denominator: `agg` with num_tokens (the global token count of the minibatch: gradient accumulation equals one
    large batch), or this batch's own count when None.
    Returns (loss, metrics): critic/value_loss (the loss over this batch's own denominator, whatever num_tokens:
    comparable across micro-batches and ranks), critic/clipfrac (tokens where the clipped branch is larger),
    critic/value_mean.
    """
    _check(mask, values=values, old_values=old_values, returns=returns)
    v, r = values.float(), returns.float()
    err = (v - r) ** 2
    if clip is not None:
        delta = v - old_values.float()
        err_clipped = (old_values.float() + delta.clamp(-clip, clip) - r) ** 2
        # Count only tokens really outside the clip range: inside it the two errors differ by rounding alone.
        clipfrac = _mean0(((delta.abs() > clip) & (err_clipped > err)).float(), mask)
        err = torch.maximum(err, err_clipped)
    else:
        clipfrac = torch.zeros((), device=mask.device)
    loss = 0.5 * aggregate(err, mask, agg, num_tokens)
    metric = 0.5 * aggregate(err.detach(), mask, agg)
    return loss, {"critic/value_loss": metric, "critic/clipfrac": clipfrac, "critic/value_mean": _mean0(v, mask)}


def ev_stats(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """The sufficient statistics of the explained variance over the valid tokens: [5] float64, detached,

        (n, sum R, sum R^2, sum e, sum e^2)      e = R - V, sums over the n tokens of mask

    values, returns: [B, T]; mask: bool [B, T]. Summed over micro-batches and ranks (runlog.Metrics.add_ev) they are
    those of all the tokens, and ev_from_stats of the sum is the EV of the whole batch, as verl and NeMo-RL compute it,
    not a mean of per-rank EVs. float64: the variances are differences of these sums, which cancel.
    """
    _check(mask, values=values, returns=returns)
    with torch.no_grad():
        r = returns.double()
        e = r - values.double()
        return torch.stack(
            [mask.sum().double(), (r * mask).sum(), (r * r * mask).sum(), (e * mask).sum(), (e * e * mask).sum()]
        )


# With all returns equal, Var(R) = E[R^2] - E[R]^2 of float64 sums is round-off (about log2(n) x 1e-16 of E[R^2]),
# not 0, and 1 - Var(e) / Var(R) a huge number made of it. Below 1e-12 of E[R^2] (a spread under 1e-6 of the returns'
# size, a few float32 ulps) the returns count as equal.
EV_CONSTANT_RTOL = 1e-12


def ev_from_stats(stats: Tensor) -> Tensor:
    """EV = 1 - Var(R - V) / Var(R) from ev_stats' statistics (summed over any number of batches): [..., 5] -> [...]
    float32. Var = E[x^2] - E[x]^2, the mean of squared deviations (divides by the count n).

    NaN where Var(R) = 0 (all returns equal, up to EV_CONSTANT_RTOL) or where there is no token (n = 0).
    """
    n, sum_r, sum_r2, sum_e, sum_e2 = stats.double().unbind(-1)
    n = n.clamp_min(1)  # no token: every sum is 0, so Var(R) = 0 and the result NaN, without a 0 / 0 on the way
    var_r = sum_r2 / n - (sum_r / n) ** 2
    var_e = sum_e2 / n - (sum_e / n) ** 2
    constant = var_r <= EV_CONSTANT_RTOL * sum_r2 / n
    return torch.where(constant, torch.full_like(var_r, float("nan")), 1 - var_e / var_r).float()


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """1 - Var(R - V) / Var(R) over the valid tokens of this batch alone (0-d float32, detached): ev_from_stats of
    ev_stats. NaN when the returns are constant or no token is valid. Over several micro-batches or ranks, sum the
    ev_stats instead (runlog.Metrics.add_ev)."""
    return ev_from_stats(ev_stats(values, returns, mask))


def position_buckets(T: int) -> list[tuple[str, int, int]]:
    """Response positions grouped for per-position diagnostics: 0, 1, 2, 3 alone, then [4, 8), [8, 16), ...
    (powers of two), cut at T; a label names its whole bucket, so keys stay the same whatever T. Returns
    (label, start, end) triples, e.g. T=6: 0, 1, 2, 3, and "4-7" = [4, 6)."""
    out, lo = [], 0
    while lo < T:
        hi = lo + 1 if lo < 4 else 2 * lo
        out.append((str(lo) if hi == lo + 1 else f"{lo}-{hi - 1}", lo, min(hi, T)))
        lo = hi
    return out


def ev_stats_by_position(values: Tensor, returns: Tensor, mask: Tensor, width: int | None = None) -> dict[str, Tensor]:
    """ev_stats restricted to each bucket of position_buckets(width or T): {"critic/ev_pos_<label>": [5] float64}.
    Give width (the response budget) when ranks hold batches of different T, so they all return the same keys.

    Early positions are the hard ones (the value must predict the whole outcome); the last position before
    a terminal reward only has to read off what was already written.
    """
    _check(mask, values=values, returns=returns)
    cols = torch.arange(mask.size(1), device=mask.device)
    return {
        f"critic/ev_pos_{label}": ev_stats(values, returns, mask & (cols >= lo) & (cols < hi))
        for label, lo, hi in position_buckets(max(width or 0, mask.size(1)))
    }


def explained_variance_by_position(
    values: Tensor, returns: Tensor, mask: Tensor, width: int | None = None
) -> dict[str, Tensor]:
    """explained_variance of this batch alone in each bucket of position_buckets(width or T):
    {"critic/ev_pos_<label>": 0-d float32} (ev_from_stats of ev_stats_by_position)."""
    return {k: ev_from_stats(st) for k, st in ev_stats_by_position(values, returns, mask, width).items()}
