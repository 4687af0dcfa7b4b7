"""Losses and estimators of the recipe: pure tensor functions, torch-only.

One alignment convention for everything below, asserted at the entry of every function that takes a mask
(``_check``): per-token tensors are ``[B, T]`` over response tokens, right-padded, with a bool ``mask`` of the same
shape that is True on real response tokens (the stop token included; False on padding and on the observation tokens
of a multi-turn row). Policies:

    logp        pi_theta, the policy being optimised (trainer, with grad)
    old_logp    pi_old, the trainer's own recompute at the rollout weights, before any update (no grad)
    infer_logp  pi_infer, what the rollout engine reported for the token it sampled
    ref_logp    pi_ref, a frozen initial policy (only when a KL term is on)

Log-ratios are formed in float32 and clamped at +-LOG_RATIO_CLAMP before exp. Functions that produce diagnostics
return ``(value, metrics)``; metrics are detached 0-d tensors under namespaced keys, local to the tensors passed in
(the trainer reduces them across ranks once per step). Each function's docstring states its formula, shapes,
denominator and source; docs/algorithms.md states the same formulas with the flags that reach them. The token
log-probs, the sampling transform and the entropy are in logprobs.py.

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
    """The masked mean sum(x * mask) / sum(mask), over all elements or along ``dim``.

    x: any shape, e.g. [B, T]; mask: bool (or 0/1) of x's shape. Returns a 0-d tensor, or x's shape without ``dim``.
    Denominator: the count of masked-in elements, not clamped, so an empty mask (or row) gives NaN, 0 / 0; the
    metrics use ``_mean0``, which gives 0. The masked mean of verl and OpenRLHF, without their guards for an empty mask.
    """
    if dim is None:
        return (x * mask).sum() / mask.sum()
    return (x * mask).sum(dim) / mask.sum(dim)


def whiten_stats(x: Tensor, mask: Tensor) -> Tensor:
    """The sufficient statistics of ``whiten`` over the masked elements: [3] float64 ``[sum x, sum x^2, n]``.

    x: [B, T] (the advantages, any float dtype); mask: bool [B, T]. float64: squares of large values overflow float32,
    and the variance is a difference of these sums. Sum them over the data-parallel ranks (all_reduce SUM), then pass
    them to ``whiten``, to whiten over the global batch while this module stays free of torch.distributed.
    """
    x = x.double()
    return torch.stack([(x * mask).sum(), (x * x * mask).sum(), mask.sum()])


def whiten(x: Tensor, mask: Tensor, stats: Tensor, eps: float = 1e-8) -> Tensor:
    """Advantage whitening with the statistics of ``whiten_stats`` (summed over ranks: the global batch):

        mean = sum x / n,   var = (sum x^2 - n mean^2) / (n - 1)   (unbiased),   x' = (x - mean) / sqrt(var + eps)

    x: [B, T]; mask: bool [B, T]; stats: [3] float64 [sum x, sum x^2, n]; eps: added to the variance. Returns [B, T]
    float32, 0 on masked-out entries (the mean stays subtracted). No element: mean 0 (not NaN); one element: the
    variance is divided by 1, not 0. verl's masked_whiten (unbiased variance, eps 1e-8), over all ranks at once.
    """
    mean = stats[0] / stats[2].clamp_min(1)
    var = (stats[1] - stats[2] * mean**2) / (stats[2] - 1).clamp_min(1)
    return ((x.double() - mean) * torch.rsqrt(var + eps)).float() * mask


# ----------------------------------------------------------------------------- advantages


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float | Tensor) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over response tokens (Schulman et al. 2016, arXiv 1506.02438).

        delta_t = r_t + gamma V_{t+1} - V_t;   A_t = delta_t + gamma lam A_{t+1};   R_t = A_t + V_t

    with V = A = 0 after the last valid token. Masked positions are transparent ("skip observation", verl / SAO): the
    recursion runs over valid tokens only, so an observation span inside a multi-turn response neither breaks nor
    discounts the chain. With gamma = lam = 1 and a terminal reward R, A_t = R - V_t and R_t = R; with lam = 0, A_t is
    the one-step TD error.

    rewards, values: [B, T] float (reward on the last valid token for outcome rewards; rewards on masked positions are
    ignored; V_t is the value of the state before token t); mask: bool [B, T]; gamma: the discount; lam: a float or a
    [B] tensor (per-sequence lambda, e.g. ``length_adaptive_lambda``). Returns (advantages, returns), [B, T] float32
    each, 0 on masked positions, no grad; the returns are the critic's targets.
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
    """Monte Carlo advantages over chunks (VinePPO, Kazemnejad et al. 2024, arXiv 2410.01679), gamma = 1.

    The states t_0 < t_1 < ... of a row (``states`` True) cut it into chunks [t_j, t_{j+1}), the last one running to the
    row's end, where the state is terminal (V = 0). Every token of chunk j gets

        A = r(chunk j) + V(s_{t_{j+1}}) - V(s_{t_j}),     r(chunk) = the sum of ``rewards`` on the chunk's valid tokens

    With a state at every valid token this is GAE with lambda = 0 (one-step TD errors); with one state at the first
    token it is R - V(s_0). Tokens before a row's first state (no baseline) get 0.

    values: [B, T] V(s_t) = the expected sum of rewards from token t on, e.g. the mean over K sampled continuations
    (read where ``states``); states: [B, T] bool, True at valid tokens only (asserted); rewards: [B, T] (ignored on
    masked positions); mask: bool [B, T]. Returns [B, T] float32, 0 on masked positions, no grad.
    """
    _check(mask, values=values, states=states, rewards=rewards)
    assert not (states & ~mask).any(), "vine_advantages: a state must sit on a valid token"
    with torch.no_grad():
        B, T = mask.shape
        cols = torch.arange(T, device=mask.device).expand(B, T)
        # G_t: the rewards of columns t .. T-1
        togo = (rewards.float() * mask).flip(-1).cumsum(-1).flip(-1)
        # D_t = G_t - V_t at the states, 0 at the end: A over chunk [a, b) = (G_a - G_b) + V_b - V_a = D_a - D_b.
        d = torch.cat([torch.where(states, togo - values.float(), 0.0), torch.zeros(B, 1, device=mask.device)], -1)
        # The state at or before t (-1: none), then the state at or after t.
        cur = torch.where(states, cols, -1).cummax(-1).values
        nxt = torch.where(states, cols, T).flip(-1).cummin(-1).values.flip(-1)
        # The state strictly after t (T: the end).
        nxt = torch.cat([nxt[:, 1:], torch.full((B, 1), T, device=mask.device)], -1)
        adv = d.gather(-1, cur.clamp_min(0)) - d.gather(-1, nxt)
        return torch.where(mask & (cur >= 0), adv, 0.0)


def last_token_rewards(scores: Tensor, mask: Tensor) -> Tensor:
    """Outcome rewards placed on each row's last valid token: out[i, t_i] = scores[i], 0 elsewhere.

    scores: [B] one scalar per row; mask: bool [B, T]. Returns [B, T] float32. t_i is the last column where mask[i] is
    True, not column lengths - 1: a multi-turn row has holes (observation tokens, mask False) and may end in one. A row
    without a valid token gets nothing. The outcome-reward placement of verl's reward managers and OpenRLHF (the score
    on the last response token), for rows with holes.
    """
    _check(mask, scores=scores[:, None].expand_as(mask))
    cols = torch.arange(mask.size(1), device=mask.device)
    last = torch.where(mask, cols, -1).amax(-1)  # [B], -1 if the row has no valid token
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    rows = (last >= 0).nonzero()[:, 0]
    out[rows, last[rows]] = scores[rows].float()
    return out


def length_adaptive_lambda(lengths: Tensor, alpha: float) -> Tensor:
    """VAPO's length-adaptive GAE lambda (arXiv 2504.05118), per sequence:

        lambda_i = clamp(1 - 1 / (alpha * max(L_i, 1)), 0, 1)

    lengths: [B] L_i, the valid tokens of row i; alpha: VAPO uses 0.05 (for thousands of tokens), SAO
    re-implementations 1.5. Returns [B] float32, the policy side's ``lam`` of ``gae``. The clamp gives very short
    responses lambda 0 (pure TD) rather than a negative lambda: at alpha 0.05, every response of 20 tokens or fewer.
    """
    return (1.0 - 1.0 / (alpha * lengths.float().clamp_min(1))).clamp(0.0, 1.0)


def grpo_advantages(
    scores: Tensor, group_size: int, norm_std: bool = True, eps: float = 1e-6, valid: Tensor | None = None
) -> Tensor:
    """Group-relative advantages (GRPO, arXiv 2402.03300; Dr. GRPO, arXiv 2503.20783, drops the std):

        A_i = (R_i - mean_group) / (std_group + eps)     norm_std=True, unbiased std (divides by n - 1)
        A_i =  R_i - mean_group                          norm_std=False (Dr. GRPO)

    scores: [N] one scalar per response; groups of ``group_size`` are contiguous (one prompt's samples), and N must be
    a multiple of it (ValueError). eps: 1e-6, as verl's compute_grpo_outcome_advantage. A group of size 1 has no
    baseline: its advantage is 0. ``valid`` ([N] bool, default all True) marks the rewarded responses: the mean and
    std are over a group's valid members only, an invalid response gets 0, and so does every member of a group with
    fewer than 2 valid ones (no baseline). Returns [N] float32; the caller puts A_i on every valid token of response i.
    """
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
    """REINFORCE with a running-mean per-prompt baseline (the control of SAO, arXiv 2607.07508):

        A_i = R_i - b_i,   b_i = mean(past[i, :past_count[i]])  if past_count[i] > 0,  else batch_mean

    rewards: [N] each row's reward (its episode's return); past: [N, W] the last W earlier rewards of row i's prompt,
    right-padded (entries at or after past_count are ignored); past_count: [N] long in [0, W]; batch_mean: 0-d, the
    fallback (the step's mean reward over the global batch). Denominator of b_i: past_count[i]; float64 inside.
    Returns [N] float32; the caller puts it on every kept model token. Mismatched shapes raise ValueError.
    """
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
    """Per-token estimate of KL(pi_theta || pi_ref) from samples of pi_theta (Schulman, "Approximating KL
    Divergence", 2020, blog post):

        log r = clamp(ref_logp - logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        k1 = -log r                unbiased, either sign per token
        k3 = r - 1 - log r         unbiased, >= 0 per token, lower variance

    The estimate is capped at +-KL_ESTIMATE_CAP (10, verl's and OpenRLHF's cap): a token past the cap adds exactly the
    cap to the loss and gets zero gradient. logp: [B, T] (pi_theta with grad for the k3 loss, pi_old for the k1 reward
    penalty); ref_logp: [B, T]; kind: "k1" or "k3" (ValueError otherwise). Returns [B, T] (same dtype as the inputs),
    not masked: reduce it with ``aggregate``, whose mask and denominator apply.
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
    """IcePop token weights M(k) (Ring-1T arXiv 2510.18855; GLM-5 arXiv 2602.15763):

        k_t = pi_old(y_t) / pi_infer(y_t) = exp(clamp(old_logp - infer_logp)),   M(k) = k if alpha <= k <= beta else 0

    The band is inclusive. Out-of-band tokens are dropped (zero gradient once multiplied into the loss), not clipped;
    in-band tokens are weighted by k itself; padding gets 0. Project default band [0.5, 2] (GLM-5's pop(rho, 1/beta,
    beta), beta = 2); Ring-1T used [0.5, 5]. Dropped tokens stay in the loss's denominator (see ``ppo_policy_loss``).

    old_logp, infer_logp: [B, T]; mask: bool [B, T]. Returns (weights [B, T] float32, detached; metrics
    icepop/masked_frac, _low (k < alpha), _high (k > beta), shares of the valid tokens; icepop/seq_masked_frac, the
    share of rows with any dropped token).
    """
    _check(mask, old_logp=old_logp, infer_logp=infer_logp)
    with torch.no_grad():
        k = _train_infer_ratio(old_logp, infer_logp)
        keep = (k >= alpha) & (k <= beta) & mask
        return k * keep, _band_metrics(k, mask, alpha, beta, "icepop")


def tis_weights(
    old_logp: Tensor, infer_logp: Tensor, mask: Tensor, cap: float = 2.0
) -> tuple[Tensor, dict[str, Tensor]]:
    """Truncated importance sampling (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
    Training", blog post): weight w_t = min(k_t, cap), k = pi_old / pi_infer (fp32, log-ratio clamped).

    old_logp, infer_logp: [B, T]; mask: bool [B, T]; cap: C (the blog's C = 2; the trainer passes the IcePop band's
    upper bound). Every weight is > 0, so no token is dropped. Returns (weights [B, T] float32 detached, 0 on padding;
    metrics tis/clip_frac (share of the valid tokens with k > cap), tis/weight_mean (over the valid tokens)).
    """
    _check(mask, old_logp=old_logp, infer_logp=infer_logp)
    with torch.no_grad():
        k = _train_infer_ratio(old_logp, infer_logp)
        w = k.clamp(max=cap) * mask
        clipped = (k > cap) & mask
        return w, {"tis/clip_frac": _mean0(clipped.float(), mask), "tis/weight_mean": _mean0(w, mask)}


def geo_seq_mask(
    old_logp: Tensor, infer_logp: Tensor, mask: Tensor, alpha: float = 0.5, beta: float = 2.0
) -> tuple[Tensor, dict[str, Tensor]]:
    """Sequence-level masking by the geometric-mean ratio (length-invariant), the geometric rejection of verl's rollout
    correction (Liu, Li et al. 2025, "When Speed Kills Stability", blog post):

        g_i = (prod_t k_it)^(1/|y_i|) = exp(sum_t m_it log k_it / max(1, sum_t m_it)),   k = pi_old / pi_infer
        w_it = 1 if alpha <= g_i <= beta and m_it, else 0

    The whole sequence is dropped when g is outside [alpha, beta] (IcePop's band); kept sequences get weight 1, not g.
    old_logp, infer_logp: [B, T]; mask: bool [B, T]; a row without a valid token has g = 1. Returns (weights [B, T]
    float32 detached; metrics geo/seq_masked_frac (share of rows dropped), geo/ratio_mean (mean of g over rows)).
    """
    _check(mask, old_logp=old_logp, infer_logp=infer_logp)
    with torch.no_grad():
        log_k = (old_logp.float() - infer_logp.float()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        g = torch.exp((log_k * mask).sum(-1) / mask.sum(-1).clamp_min(1))
        keep = (g >= alpha) & (g <= beta)
        weights = (keep[:, None] & mask).float()
        return weights, {"geo/seq_masked_frac": (~keep).float().mean(), "geo/ratio_mean": g.mean()}


def mismatch_metrics(
    old_logp: Tensor, infer_logp: Tensor, mask: Tensor, alpha: float = 0.5, beta: float = 2.0
) -> dict[str, Tensor]:
    """Train-inference mismatch diagnostics, logged by every run whatever the correction, all under mismatch/:

        d = clamp(infer_logp - old_logp, +-LOG_RATIO_CLAMP),  k = exp(-d) = pi_old / pi_infer   (fp32)
        k1 = mean(d), k3 = mean(k - 1 + d) = mean(k - 1 - log k)    both estimate KL(pi_infer || pi_old)
        abs_diff_mean, abs_diff_max = mean, max |d|                (the max is max |log k|)
        ratio_min, ratio_mean, ratio_max of k; ratio_p001, ratio_p999: its 0.1% / 99.9% quantiles (linear)
        masked_frac, _low, _high, seq_masked_frac: what the IcePop band [alpha, beta] would drop
        ess = (sum k)^2 / (n sum k^2) over the n valid tokens, in (0, 1]; seq_ess the same over the rows' weights
              w_b = prod_t k_bt (from log w_b by logsumexp: no overflow)

    The KL direction is KL(pi_infer || pi_old) because the tokens were sampled from pi_infer. The ESS is VCPO's
    collapse predictor (arXiv 2602.17616). old_logp, infer_logp: [B, T]; mask: bool [B, T]; means are over the valid
    tokens. Without a valid token: the means and abs_diff_max 0, ratio_min / ratio_max +inf / -inf, ess, seq_ess and
    the quantiles 1. Returns {key: detached 0-d tensor}.
    """
    _check(mask, old_logp=old_logp, infer_logp=infer_logp)
    with torch.no_grad():
        diff = (infer_logp.float() - old_logp.float()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        k = torch.exp(-diff)
        inf = torch.tensor(float("inf"), device=diff.device)
        one = torch.ones((), device=diff.device)
        # log prod_t k_t of each row with tokens; the sequence ESS goes through logsumexp, so it cannot overflow.
        log_w = -(diff * mask).sum(-1)[mask.any(-1)]
        if mask.any():
            ess = (k * mask).sum() ** 2 / (mask.sum() * (k * k * mask).sum())
            seq_ess = torch.exp(2 * log_w.logsumexp(0) - (2 * log_w).logsumexp(0)) / len(log_w)
            # The heavy tail, both sides: the 0.1% and 99.9% quantiles of k (linear interpolation).
            p001, p999 = k[mask].quantile(torch.tensor([0.001, 0.999], device=k.device))
        else:
            ess = seq_ess = one
            p001, p999 = torch.ones(2, device=k.device)
        return {
            "mismatch/ess": ess,
            "mismatch/seq_ess": seq_ess,
            "mismatch/k1": _mean0(diff, mask),
            "mismatch/k3": _mean0(k - 1 + diff, mask),
            "mismatch/abs_diff_mean": _mean0(diff.abs(), mask),
            "mismatch/abs_diff_max": torch.where(mask, diff.abs(), 0).max(),
            "mismatch/ratio_min": torch.where(mask, k, inf).min(),
            "mismatch/ratio_mean": _mean0(k, mask),
            "mismatch/ratio_max": torch.where(mask, k, -inf).max(),
            "mismatch/ratio_p001": p001,
            "mismatch/ratio_p999": p999,
            **_band_metrics(k, mask, alpha, beta, "mismatch"),
        }


# ----------------------------------------------------------------------------- aggregation


def window_slope(ys: list[float]) -> float:
    """The least-squares slope of ys against 0, 1, 2, ...: sum (x - mean x)(y - mean y) / sum (x - mean x)^2.

    ys: one metric's values over the last steps, oldest first (mismatch/k3 over runlog.K3_SLOPE_WINDOW steps). Returns
    a float, ys' units per step (float64 inside); NaN below 2 points or with a non-finite value. It is
    mismatch/k3_slope: a growing k3 is an early warning of collapse (VCPO, arXiv 2602.17616).
    """
    y = torch.tensor(ys, dtype=torch.float64)
    x = torch.arange(len(y), dtype=torch.float64) - (len(y) - 1) / 2
    if len(y) < 2 or not torch.isfinite(y).all():
        return float("nan")
    return float((x * (y - y.mean())).sum() / (x * x).sum())


def loss_denominator(mask: Tensor, agg: str, max_len: int | None = None) -> Tensor:
    """The denominator of ``aggregate`` for a whole batch, to compute once before micro-batching:

        token-mean               N_tok = sum(mask), the valid tokens
        seq-mean-token-mean      N_seq = B, the sequences
        seq-mean-token-sum-norm  B * L_max, L_max = max_len (the generation budget) or T     (Dr. GRPO)

    mask: bool [B, T], the loss mask; agg: one of AGG_MODES (ValueError otherwise). Returns a 0-d float32 tensor.
    Sum it over data-parallel ranks and pass it as ``num_tokens`` to every micro-batch's loss: the micro-batch losses
    then add up to the full-batch loss, and their gradients to its gradient. It may be 0 (no valid token here): clamp
    it to at least 1 after the sum over ranks, so a rank with nothing adds nothing.
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
    """Reduce a [B, T] per-token loss to a scalar:

        token-mean               sum_{i,t} m_it l_it / N_tok
        seq-mean-token-mean      sum_i [ sum_t m_it l_it / max(1, sum_t m_it) ] / N_seq
        seq-mean-token-sum-norm  sum_{i,t} m_it l_it / (N_seq * L_max)       (Dr. GRPO, arXiv 2503.20783)

    loss_tok: [B, T] per-token loss; mask: bool [B, T], the tokens that count; agg: one of AGG_MODES. Denominator:
    ``num_tokens``, the global one (``loss_denominator`` summed over ranks); default: this batch's own (L_max = T),
    clamped to at least 1. A row without a valid token adds 0 (and still counts in N_seq). Returns a 0-d tensor. The
    mode names and the first two are verl's agg_loss; its seq-mean-token-sum-norm divides by T, not by B * L_max.
    """
    _check(mask, loss_tok=loss_tok)
    # No valid token: the loss is 0, not 0/0.
    denom = loss_denominator(mask, agg).clamp_min(1) if num_tokens is None else num_tokens
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
    """Clipped PPO surrogate (Schulman et al. 2017, arXiv 1707.06347) with clip-higher, optional dual-clip, and
    per-token IS weights:

        r_t = exp(clamp(logp - old_logp, +-LOG_RATIO_CLAMP))                                    (fp32)
        l_t = max(-A_t r_t, -A_t clip(r_t, 1 - clip_low, 1 + clip_high))     DAPO clip-higher, arXiv 2503.14476
        l_t = min(l_t, -c A_t) where A_t < 0, with dual_clip = c > 1            Ye et al. 2020, arXiv 1912.09729
        l_t = w_t l_t                                                        is_weights w, e.g. IcePop M(k)
        loss = aggregate(l, mask, agg, num_tokens)

    DAPO's clips are 0.2 / 0.28; the usual c is 3 (verl's clip_ratio_c). ``is_weights`` are detached: tokens with
    weight 0 get exactly zero gradient but stay in the denominator (the IcePop paper's 1/|y|; slime, OpenRLHF and
    TRL). To drop them from the denominator too (verl's rejection form), pass ``mask & (w > 0)``.

    logp: [B, T] with grad; old_logp, advantages: [B, T] no grad; mask: bool [B, T]; is_weights: [B, T] or None.
    Denominator: ``aggregate(agg, num_tokens)``. Returns (loss: 0-d; metrics over the valid tokens: ppo/clipfrac
    (the clipped branch strictly larger), ppo/dual_clipfrac, ppo/approx_kl = mean(r - 1 - log r) (k3 of
    KL(pi_old || pi_theta), cleanrl's approx_kl), ppo/ratio_mean).
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
    """DIS actor loss (GLM-5 agentic RL, arXiv 2602.15763; SAO arXiv 2607.07508, the GLM-5.2 actor loss): no pi_old.

        rho_t = pi_theta / pi_infer = exp(clamp(logp - infer_logp, +-LOG_RATIO_CLAMP))     (fp32, no grad)
        f(rho) = rho if 1 - eps_low < rho < 1 + eps_high (strict) else 0
        l_t = -sg(f(rho_t) A_t) * logp_t,   loss = aggregate(l, mask, agg, num_tokens)      (sg: stop gradient)

    The gradient is -f(rho_t) A_t d logp_t: in-band tokens get the importance-weighted policy gradient and
    out-of-band tokens exactly zero gradient (and stay in the denominator). It replaces the PPO surrogate (no clip,
    dual clip or correction weights). logp: [B, T] with grad; infer_logp, advantages: [B, T] no grad; mask: bool [B, T].
    Denominator: ``aggregate(agg, num_tokens)``. Returns (loss: 0-d; metrics dis/masked_frac (share of the valid
    tokens out of band), dis/ratio_mean).
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
    """Clipped value loss (PPO's; verl's compute_value_loss):

        e = (V - R)^2,   e_c = (V_old + clip(V - V_old, -clip, clip) - R)^2
        loss = 0.5 * aggregate(max(e, e_c), mask, agg, num_tokens)             (e alone when clip is None)

    values: [B, T] critic output with grad; old_values: [B, T] critic output at rollout time; returns: [B, T] GAE
    targets, the critic's regression targets; mask: [B, T] bool, the tokens that count. clip: eps_v (project default
    0.2, slime); None disables the clipped branch. The 1/2 is PPO's convention (cleanrl, verl, OpenRLHF): the gradient
    of the unclipped branch is the residual V - R. No other scale: the critic has its own AdamW, which cancels a
    constant factor on the loss. Denominator: `agg` with num_tokens (the global token count of the minibatch: gradient
    accumulation equals one large batch), or this batch's own count when None.
    Returns (loss: 0-d, metrics): critic/value_loss (the loss over this batch's own denominator, whatever num_tokens:
    comparable across micro-batches and ranks), critic/clipfrac (tokens with |V - V_old| > clip where the clipped
    branch is larger), critic/value_mean.
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
    """EV = 1 - Var(R - V) / Var(R) from ev_stats' statistics (summed over any number of batches):

        Var(x) = sum x^2 / n - (sum x / n)^2      the mean of squared deviations (denominator n, not n - 1)

    stats: [..., 5] float. Returns [...] float32. NaN where Var(R) = 0 (all returns equal, up to EV_CONSTANT_RTOL) or
    where there is no token (n = 0). EV > 0 is the break-even point against a batch-mean baseline (EVPO, arXiv
    2604.19485); verl's critic/vf_explained_var is the same ratio, with 1e-5 added to Var(R).
    """
    n, sum_r, sum_r2, sum_e, sum_e2 = stats.double().unbind(-1)
    # No token: every sum is 0, so Var(R) = 0 and the result NaN, without a 0 / 0 on the way.
    n = n.clamp_min(1)
    var_r = sum_r2 / n - (sum_r / n) ** 2
    var_e = sum_e2 / n - (sum_e / n) ** 2
    constant = var_r <= EV_CONSTANT_RTOL * sum_r2 / n
    return torch.where(constant, torch.full_like(var_r, float("nan")), 1 - var_e / var_r).float()


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """1 - Var(R - V) / Var(R) over the valid tokens of this batch alone: ev_from_stats of ev_stats.

    values, returns: [B, T]; mask: bool [B, T]. Returns a 0-d float32 tensor, detached; NaN when the returns are
    constant or no token is valid. Over several micro-batches or ranks, sum the ev_stats instead
    (runlog.Metrics.add_ev). Source: as ``ev_from_stats``.
    """
    return ev_from_stats(ev_stats(values, returns, mask))


def position_buckets(T: int) -> list[tuple[str, int, int]]:
    """Response positions grouped for per-position diagnostics: 0, 1, 2, 3 alone, then [4, 8), [8, 16), ...
    (powers of two), cut at T; a label names its whole bucket, so keys stay the same whatever T.

    T: the response width. Returns (label, start, end) triples, end exclusive, e.g. T=6: 0, 1, 2, 3, and "4-7" =
    [4, 6). The project's own bucketing (docs/algorithms.md, section 13).
    """
    out = []
    lo = 0
    while lo < T:
        hi = lo + 1 if lo < 4 else 2 * lo
        out.append((str(lo) if hi == lo + 1 else f"{lo}-{hi - 1}", lo, min(hi, T)))
        lo = hi
    return out


def ev_stats_by_position(values: Tensor, returns: Tensor, mask: Tensor, width: int | None = None) -> dict[str, Tensor]:
    """ev_stats restricted to each bucket of position_buckets(width or T): {"critic/ev_pos_<label>": [5] float64}.
    Give width (the response budget) when ranks hold batches of different T, so they all return the same keys.

    values, returns: [B, T]; mask: bool [B, T]; width: the response budget (the larger of width and T is bucketed).
    Sum each key's stats over ranks, as ev_stats'. Early positions are the hard ones (the value must predict the whole
    outcome); the last position before a terminal reward only has to read off what was already written.
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
    {"critic/ev_pos_<label>": 0-d float32} (ev_from_stats of ev_stats_by_position).

    values, returns: [B, T]; mask: bool [B, T]; width: the response budget, so that batches of different T give the
    same keys. A bucket without a valid token, or with constant returns, gives NaN. Early positions are the hard
    ones (the value must predict the whole outcome); the last position before a terminal reward only has to read off
    what was already written.
    """
    return {k: ev_from_stats(st) for k, st in ev_stats_by_position(values, returns, mask, width).items()}
