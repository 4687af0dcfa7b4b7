"""losses.py against hand-computed cases and independent slow (loop) implementations."""

import math
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import logprobs
import losses as L
from conftest import direct_ev


def rand_batch(B=4, T=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None] < lengths[:, None]
    return mask, lambda scale=1.0: torch.randn(B, T, generator=g) * scale


# ----------------------------------------------------------------------------- log-probs


def slow_logprob(logits_row, token, temperature, top_k, top_p):
    """One position, written the long way: scale, sort, keep the nucleus, renormalise."""
    x = [v / temperature for v in logits_row.tolist()]
    order = sorted(range(len(x)), key=lambda i: -x[i])
    keep = set(order[:top_k] if top_k else order)
    mx = max(x)
    z = sum(math.exp(x[i] - mx) for i in keep)
    cum, nucleus = 0.0, set()
    for i in order:
        if i not in keep:
            continue
        if cum >= top_p:
            break
        nucleus.add(i)
        cum += math.exp(x[i] - mx) / z
    if token not in nucleus:
        return logprobs.EXCLUDED_LOGP
    zn = sum(math.exp(x[i] - mx) for i in nucleus)
    return x[token] - mx - math.log(zn)


@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0), (0.8, 0, 0.9), (1.0, 6, 0.7)]
)
def test_token_logprobs_matches_slow(temperature, top_k, top_p):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 11, generator=g) * 2
    tokens = torch.randint(0, 11, (2, 5), generator=g)
    got = logprobs.token_logprobs(logits, tokens, temperature, top_k=top_k, top_p=top_p)
    want = torch.tensor(
        [
            [slow_logprob(logits[b, t], tokens[b, t].item(), temperature, top_k, top_p) for t in range(5)]
            for b in range(2)
        ]
    )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (got == logprobs.EXCLUDED_LOGP).any() == (
        top_k > 0 or top_p < 1
    )  # truncation really excluded a sampled token


def test_token_logprobs_chunked_equals_unchunked_and_bf16(monkeypatch):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 9, 17, generator=g).bfloat16()
    tokens = torch.randint(0, 17, (3, 9), generator=g)
    full = logprobs.token_logprobs(logits, tokens, 0.9)
    monkeypatch.setattr(logprobs, "CHUNK_ROWS", 4)
    chunked = logprobs.token_logprobs(logits, tokens, 0.9)
    assert chunked.dtype == torch.float32
    torch.testing.assert_close(chunked, full, atol=0, rtol=0)
    want = torch.log_softmax(logits.float() / 0.9, -1).gather(-1, tokens[..., None]).squeeze(-1)
    torch.testing.assert_close(full, want)


@pytest.mark.parametrize("kw", [{}, {"temperature": 0.7, "top_k": 5}, {"top_p": 0.8}])
def test_head_logprobs_equals_full_logits_values_and_gradients(monkeypatch, kw):
    # The checkpointed, chunked LM head against the plain path: head over every position, then token_logprobs.
    monkeypatch.setattr(
        logprobs, "HEAD_CHUNK_ELEMENTS", 4 * 23
    )  # 15 positions: 4 chunks of 4 x 23 logits, the last one short
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(0)  # the head's init
    head = torch.nn.Linear(6, 23, bias=False)
    hidden, tokens, w = (
        torch.randn(3, 5, 6, generator=g),
        torch.randint(0, 23, (3, 5), generator=g),
        torch.randn(3, 5, generator=g),
    )
    grads = []
    for path in ("full", "head"):
        h = hidden.clone().requires_grad_(True)
        head.zero_grad()
        if path == "full":
            logits = head(h)
            lp, ent = (
                logprobs.token_logprobs(logits, tokens, **kw),
                logprobs.entropy_from_logits(logits, kw.get("temperature", 1.0)),
            )
        else:
            lp, ent = logprobs.head_logprobs(head, h, tokens, **kw, entropy=True)
        (lp * w).sum().backward()
        grads.append((lp.detach(), ent, h.grad, head.weight.grad.clone()))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert not grads[1][1].requires_grad  # entropy is a metric: detached
    with torch.no_grad():  # the recompute path (no checkpointing) gives the same numbers
        torch.testing.assert_close(
            logprobs.head_logprobs(head, hidden, tokens, **kw)[0], grads[0][0], rtol=1e-5, atol=1e-6
        )


def test_excluded_token_gets_floor_and_zero_grad():
    logits = torch.tensor([[[3.0, 2.0, -1.0, -2.0]]], requires_grad=True)
    lp = logprobs.token_logprobs(logits, torch.tensor([[3]]), top_k=2)
    assert lp.item() == logprobs.EXCLUDED_LOGP
    lp.sum().backward()
    assert torch.all(logits.grad == 0)


def test_greedy_keeps_one_token_lowest_id_on_ties():
    # Ties with the maximum: top_k=1 keeps only the lowest id among them (a kth-value rule kept all three).
    logits = torch.tensor([[1.0, 3.0, 0.5, 3.0, 3.0], [2.0, 2.0, 2.0, 2.0, 2.0]], dtype=torch.bfloat16)
    x = logprobs.process_logits(logits, 1.0, top_k=1)
    assert torch.isfinite(x).sum(-1).tolist() == [1, 1]
    assert x.argmax(-1).tolist() == [1, 0] and torch.isfinite(x[0, 1]) and torch.isfinite(x[1, 0])
    assert logprobs.token_logprobs(logits[:, None], torch.tensor([[1], [0]]), top_k=1).tolist() == [[0.0], [0.0]]


def test_entropy_from_logits():
    logits = torch.randn(2, 3, 6, generator=torch.Generator().manual_seed(0))
    p = torch.softmax(logits / 0.5, -1)
    torch.testing.assert_close(logprobs.entropy_from_logits(logits, 0.5), -(p * p.log()).sum(-1))
    assert torch.allclose(logprobs.entropy_from_logits(torch.zeros(1, 1, 8)), torch.tensor(math.log(8)))


# ----------------------------------------------------------------------------- statistics


def test_masked_mean_and_whiten_hand():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]])
    m = torch.tensor([[True, True, False], [True, False, False]])
    assert L.masked_mean(x, m).item() == pytest.approx(2.0)
    torch.testing.assert_close(L.masked_mean(x, m, dim=1), torch.tensor([1.5, 3.0]))
    w = L.whiten(x, m, L.whiten_stats(x, m))  # values 1, 2, 3: mean 2, unbiased var 1
    torch.testing.assert_close(w, torch.tensor([[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]), atol=1e-6, rtol=0)
    # values 1e30, -1e30, 3e30: mean 1e30, unbiased var 4e60 (the squares overflow float32), std 2e30
    x, m = torch.tensor([[1e30, -1e30, 3e30, 0.0]]), torch.tensor([[True, True, True, False]])
    torch.testing.assert_close(
        L.whiten(x, m, L.whiten_stats(x, m)), torch.tensor([[0.0, -1.0, 1.0, 0.0]]), atol=1e-6, rtol=0
    )
    # no valid element: mean 0 and variance 0 -> all zeros, not NaN
    assert L.whiten(x, ~torch.ones_like(m), L.whiten_stats(x, ~torch.ones_like(m))).eq(0).all()


# ----------------------------------------------------------------------------- GAE


def slow_gae(rewards, values, mask, gamma, lam):
    """Per sequence: compress to the valid tokens, run textbook GAE, scatter back."""
    B, T = mask.shape
    adv, ret = torch.zeros(B, T), torch.zeros(B, T)
    for b in range(B):
        idx = [t for t in range(T) if mask[b, t]]
        lam_b = float(lam[b]) if torch.is_tensor(lam) else lam
        a_next, v_next = 0.0, 0.0
        for t in reversed(idx):
            delta = rewards[b, t].item() + gamma * v_next - values[b, t].item()
            a_next = delta + gamma * lam_b * a_next
            v_next = values[b, t].item()
            adv[b, t], ret[b, t] = a_next, a_next + v_next
    return adv, ret


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (1.0, 0.95), (0.9, 0.5), (0.99, 0.0)])
def test_gae_matches_slow_with_holes(gamma, lam):
    g = torch.Generator().manual_seed(2)
    mask = torch.rand(5, 9, generator=g) > 0.3  # holes = observation tokens inside the response
    rewards, values = torch.randn(5, 9, generator=g) * mask, torch.randn(5, 9, generator=g)
    adv, ret = L.gae(rewards, values, mask, gamma, lam)
    want_adv, want_ret = slow_gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv, want_adv, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret, want_ret, atol=1e-5, rtol=1e-5)


def test_gae_per_sequence_lambda():
    mask, r = rand_batch(4, 8, seed=3)
    rewards, values = r() * mask, r()
    lam = torch.tensor([0.0, 0.5, 0.9, 1.0])
    adv, _ = L.gae(rewards, values, mask, 1.0, lam)
    torch.testing.assert_close(adv, slow_gae(rewards, values, mask, 1.0, lam)[0], atol=1e-5, rtol=1e-5)


def test_gae_terminal_reward_and_td():
    values = torch.tensor([[0.2, 0.5, 0.7, 9.0]])
    mask = torch.tensor([[True, True, True, False]])
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    adv, ret = L.gae(rewards, values, mask, 1.0, 1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.8, 0.5, 0.3, 0.0]]))  # A_t = R - V_t
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0, 0.0]]))
    adv0, _ = L.gae(rewards, values, mask, 1.0, 0.0)  # lambda 0: one-step TD errors
    torch.testing.assert_close(adv0, torch.tensor([[0.5 - 0.2, 0.7 - 0.5, 1.0 - 0.7, 0.0]]))


def test_vine_advantages_hand():
    """Chunks between states: A = r(chunk) + V(next state) - V(state), V = 0 after the row's end."""
    T_, F_ = True, False
    mask = torch.tensor([[T_, T_, T_, T_, T_, F_], [T_, T_, F_, F_, T_, T_], [T_, T_, T_, F_, F_, F_]])
    states = torch.tensor([[T_, F_, T_, F_, T_, F_], [T_, F_, F_, F_, T_, F_], [F_, T_, F_, F_, F_, F_]])
    values = torch.tensor(
        [[0.3, 9.0, 0.6, 9.0, 0.9, 9.0], [1.2, 9.0, 9.0, 9.0, 0.8, 9.0], [9.0, 0.5, 9.0, 9.0, 9.0, 9.0]]
    )
    rewards = torch.tensor(
        [[0.0, 0.0, 0.0, 0.0, 1.0, 0.0], [0.0, 0.5, 7.0, 0.0, 0.0, 1.0], [0.0, 0.0, 1.0, 0.0, 0.0, 0.0]]
    )
    adv = L.vine_advantages(values, states, rewards, mask)
    want = torch.tensor(
        [
            [0.3, 0.3, 0.3, 0.3, 0.1, 0.0],  # 0.6 - 0.3, 0.9 - 0.6, 1 - 0.9
            [0.1, 0.1, 0.0, 0.0, 0.2, 0.2],  # turn 1's 0.5 + 0.8 - 1.2 (the observation's 7 ignored), 1 - 0.8
            [0.0, 0.5, 0.5, 0.0, 0.0, 0.0],
        ]
    )  # no state before column 1: no baseline, 0
    torch.testing.assert_close(adv, want)


def test_vine_advantages_at_every_token_are_td_errors():
    g = torch.Generator().manual_seed(4)
    mask = torch.rand(5, 9, generator=g) > 0.3  # holes = observation tokens
    rewards, values = torch.randn(5, 9, generator=g), torch.randn(5, 9, generator=g)
    torch.testing.assert_close(
        L.vine_advantages(values, mask, rewards, mask), L.gae(rewards * mask, values, mask, 1.0, 0.0)[0]
    )
    first = mask & (mask.cumsum(-1) == 1)  # one state at each row's first token: R - V(s_0) on every token
    R = (rewards * mask).sum(-1, keepdim=True)
    v0 = (values * first).sum(-1, keepdim=True)
    torch.testing.assert_close(L.vine_advantages(values, first, rewards, mask), (R - v0).expand_as(mask) * mask)


def test_length_adaptive_lambda():
    lam = L.length_adaptive_lambda(torch.tensor([100, 20, 1]), alpha=0.05)
    torch.testing.assert_close(lam, torch.tensor([1 - 1 / 5, 0.0, 0.0]))


# ----------------------------------------------------------------------------- GRPO, KL


def test_grpo_advantages_hand():
    s = torch.tensor([1.0, 0.0, 1.0, 1.0])
    torch.testing.assert_close(L.grpo_advantages(s, 2), torch.tensor([0.5, -0.5, 0.0, 0.0]) / (math.sqrt(0.5) + 1e-6))
    torch.testing.assert_close(L.grpo_advantages(s, 2, norm_std=False), torch.tensor([0.5, -0.5, 0.0, 0.0]))
    assert torch.equal(L.grpo_advantages(s, 1), torch.zeros(4))
    with pytest.raises(ValueError, match="groups of 3"):
        L.grpo_advantages(s, 3)


def test_kl_estimators_hand():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])  # log r = -log 2
    lr = -math.log(2)
    assert L.kl_estimate(logp, ref, "k1").item() == pytest.approx(-lr)
    assert L.kl_estimate(logp, ref, "k3").item() == pytest.approx(0.5 - 1 - lr)
    with pytest.raises(ValueError, match="k2"):
        L.kl_estimate(logp, ref, "k2")  # no flag reaches k2: removed


def test_kl_estimate_is_capped_at_10():
    """One token far from the reference adds at most KL_ESTIMATE_CAP to the loss, with zero gradient (uncapped,
    a log-ratio of 20 puts exp(20) - 21 ~ 4.85e8 into k3)."""
    logp = torch.tensor([0.0, 0.0, 0.0], requires_grad=True)
    ref = torch.tensor([20.0, -20.0, math.log(2.0)])  # k3 = e^20 - 21, 19 + e^-20, 2 - 1 - log 2
    k3 = L.kl_estimate(logp, ref, "k3")
    assert k3.tolist() == pytest.approx([10.0, 10.0, 1 - math.log(2.0)])
    k3.sum().backward()
    assert logp.grad[:2].tolist() == [0.0, 0.0]  # past the cap: no gradient
    assert logp.grad[2].item() == pytest.approx(1 - 2.0)  # d/dlogp (r - 1 - log r) = 1 - r
    assert L.kl_estimate(logp, ref, "k1").tolist() == pytest.approx([-10.0, 10.0, -math.log(2.0)])


# ----------------------------------------------------------------------------- mismatch corrections


def test_icepop_band_is_inclusive_and_drops_outside():
    k = torch.tensor([[0.49, 0.5, 1.0, 2.0, 2.01, 1.0]])
    infer = torch.zeros(1, 6)
    old = k.log()
    mask = torch.tensor([[True, True, True, True, True, False]])
    w, m = L.icepop_weights(old, infer, mask, alpha=0.5, beta=2.0)
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.5, 1.0, 2.0, 0.0, 0.0]]))
    assert m["icepop/masked_frac"].item() == pytest.approx(2 / 5)
    assert m["icepop/masked_frac_low"].item() == pytest.approx(1 / 5)
    assert m["icepop/masked_frac_high"].item() == pytest.approx(1 / 5)
    assert m["icepop/seq_masked_frac"].item() == 1.0


def test_icepop_masked_and_padding_tokens_get_exactly_zero_grad():
    mask, r = rand_batch(3, 6, seed=4)
    old, adv = r(0.1), r()
    infer = old + torch.tensor([0.0, 1.0, -1.0, 0.0, 2.0, 0.0]).expand(3, 6)  # k = e^0, e^-1, e^1, ..., e^-2
    logp = (old + r(0.05)).requires_grad_()
    w, _ = L.icepop_weights(old, infer, mask)
    loss, _ = L.ppo_policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, is_weights=w)
    loss.backward()
    dropped = w == 0
    assert torch.all(logp.grad[dropped] == 0)
    assert torch.all(logp.grad[~mask] == 0)
    assert (logp.grad[~dropped] != 0).any()


def test_tis_and_geo_seq_mask_hand():
    old = torch.tensor([[math.log(3.0), math.log(0.5), 0.0], [math.log(4.0), math.log(4.0), 0.0]])
    infer = torch.zeros(2, 3)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    w, m = L.tis_weights(old, infer, mask, cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5, 0.0], [2.0, 2.0, 1.0]]))
    assert m["tis/clip_frac"].item() == pytest.approx(3 / 5)
    # geometric means: sqrt(3 * 0.5) = 1.22 (kept); (4 * 4 * 1)^(1/3) = 2.52 (dropped)
    g, gm = L.geo_seq_mask(old, infer, mask, alpha=0.5, beta=2.0)
    torch.testing.assert_close(g, torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))
    assert gm["geo/seq_masked_frac"].item() == 0.5


def test_mismatch_metrics_hand():
    infer = torch.tensor([[math.log(0.5), math.log(0.25), 0.0]])
    old = torch.tensor([[math.log(0.25), math.log(0.25), 5.0]])  # k = 0.5, 1; third is padding
    mask = torch.tensor([[True, True, False]])
    m = L.mismatch_metrics(old, infer, mask)
    assert m["mismatch/k1"].item() == pytest.approx(math.log(2) / 2)
    assert m["mismatch/k3"].item() == pytest.approx((0.5 - 1 + math.log(2)) / 2)
    assert m["mismatch/abs_diff_max"].item() == pytest.approx(math.log(2))
    assert m["mismatch/ratio_min"].item() == pytest.approx(0.5)
    assert m["mismatch/ratio_max"].item() == pytest.approx(1.0)
    assert m["mismatch/masked_frac"].item() == 0.0  # 0.5 is inside the inclusive band
    assert m["mismatch/ratio_p001"].item() == pytest.approx(0.5 + 0.001 * 0.5)  # linear between the 2 sorted values
    assert m["mismatch/ratio_p999"].item() == pytest.approx(0.5 + 0.999 * 0.5)
    # 1001 tokens with k = 1, 2, ..., 1001: the 99.9% quantile sits at sorted index 999 (k = 1000), the 0.1% at index 1
    ks = torch.arange(1, 1002, dtype=torch.float64)[None]
    m = L.mismatch_metrics(ks.log(), torch.zeros_like(ks), torch.ones_like(ks, dtype=torch.bool))
    assert m["mismatch/ratio_p999"].item() == pytest.approx(1000) and m["mismatch/ratio_p001"].item() == pytest.approx(
        2
    )
    assert L.mismatch_metrics(old, infer, torch.zeros_like(mask))["mismatch/ratio_p999"].item() == 1.0


def test_effective_sample_size_hand():
    """Token ESS (sum k)^2 / (n sum k^2); sequence ESS over the rows' weights prod_t k_t; 1 without tokens."""
    old = torch.tensor([[math.log(2.0), 0.0, 7.0], [math.log(0.5), math.log(0.5), 0.0], [9.0, 9.0, 9.0]])
    infer = torch.zeros(3, 3)  # k = 2, 1 | 0.5, 0.5 | (row 3 and the third column: padding)
    mask = torch.tensor([[True, True, False], [True, True, False], [False, False, False]])
    m = L.mismatch_metrics(old, infer, mask)
    assert m["mismatch/ess"].item() == pytest.approx(4**2 / (4 * (4 + 1 + 0.25 + 0.25)))  # 16 / 22
    assert m["mismatch/seq_ess"].item() == pytest.approx((2 + 0.25) ** 2 / (2 * (4 + 0.0625)))  # row weights 2 and 1/4
    equal = L.mismatch_metrics(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool))
    assert equal["mismatch/ess"].item() == pytest.approx(1.0) and equal["mismatch/seq_ess"].item() == pytest.approx(1.0)
    # one row's weight e^60 dominates (no overflow in float32: logsumexp): ESS -> 1 / n
    huge = L.mismatch_metrics(
        torch.tensor([[20.0, 20.0, 20.0], [0.0, 0.0, 0.0]]), torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    )
    assert huge["mismatch/seq_ess"].item() == pytest.approx(0.5) and math.isfinite(huge["mismatch/ess"].item())
    none = L.mismatch_metrics(old, infer, torch.zeros_like(mask))
    assert none["mismatch/ess"].item() == 1.0 and none["mismatch/seq_ess"].item() == 1.0


def test_window_slope_hand():
    assert L.window_slope([1.0, 3.0, 5.0]) == pytest.approx(2.0)
    assert L.window_slope([0.0, 1.0, 0.0, 1.0]) == pytest.approx(
        0.2
    )  # sum (x - 1.5)(y - 0.5) / sum (x - 1.5)^2 = 1 / 5
    assert L.window_slope([4.0, 4.0]) == 0.0
    assert math.isnan(L.window_slope([1.0])) and math.isnan(L.window_slope([1.0, float("nan"), 2.0]))


# ----------------------------------------------------------------------------- PPO / DIS / value


def slow_ppo_token(lp, old, a, cl, ch, dual):
    r = math.exp(lp - old)
    loss = max(-a * r, -a * min(max(r, 1 - cl), 1 + ch))
    if dual is not None and a < 0:
        loss = min(loss, -dual * a)
    return loss


@pytest.mark.parametrize("dual", [None, 3.0])
def test_ppo_policy_loss_matches_slow(dual):
    mask, r = rand_batch(4, 6, seed=5)
    old, adv = r(), r()
    logp = old + r(0.5)
    w = torch.rand(4, 6, generator=torch.Generator().manual_seed(0))
    loss, m = L.ppo_policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=dual, is_weights=w)
    total = n = 0
    for b in range(4):
        for t in range(6):
            if mask[b, t]:
                total += w[b, t].item() * slow_ppo_token(
                    logp[b, t].item(), old[b, t].item(), adv[b, t].item(), 0.2, 0.28, dual
                )
                n += 1
    assert loss.item() == pytest.approx(total / n, rel=1e-5)
    assert 0 < m["ppo/clipfrac"].item() < 1


def test_ppo_ratio_one_is_minus_mean_advantage_and_grad():
    mask, r = rand_batch(3, 5, seed=6)
    adv = r()
    logp = r().requires_grad_()
    loss, m = L.ppo_policy_loss(logp, logp.detach(), adv, mask, clip_low=0.2, clip_high=0.28)
    assert loss.item() == pytest.approx(-L.masked_mean(adv, mask).item(), rel=1e-6)
    assert m["ppo/clipfrac"].item() == 0 and m["ppo/approx_kl"].item() == 0
    loss.backward()
    torch.testing.assert_close(logp.grad, -adv * mask / mask.sum())


def test_ppo_clip_and_dual_clip_hand():
    mask = torch.ones(1, 4, dtype=torch.bool)
    old = torch.zeros(1, 4)
    logp = torch.tensor([[math.log(1.5), math.log(1.5), math.log(0.5), math.log(5.0)]])
    adv = torch.tensor([[1.0, -1.0, -1.0, -1.0]])
    loss, m = L.ppo_policy_loss(
        logp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0, agg="seq-mean-token-sum-norm"
    )
    # token losses: A>0,r=1.5 -> -1.28 (clipped); A<0,r=1.5 -> 1.5; A<0,r=0.5 -> 0.8 (clipped); A<0,r=5 -> 3 (dual)
    assert loss.item() == pytest.approx((-1.28 + 1.5 + 0.8 + 3.0) / 4)
    assert m["ppo/clipfrac"].item() == pytest.approx(2 / 4)
    assert m["ppo/dual_clipfrac"].item() == pytest.approx(1 / 4)


def test_aggregation_modes_hand():
    token_losses = torch.tensor([[1.0, 3.0, 9.0], [4.0, 9.0, 9.0]])
    m = torch.tensor([[True, True, False], [True, False, False]])
    assert L.aggregate(token_losses, m, "token-mean").item() == pytest.approx(8 / 3)
    assert L.aggregate(token_losses, m, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert L.aggregate(token_losses, m, "seq-mean-token-sum-norm").item() == pytest.approx(8 / 6)
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        L.aggregate(token_losses, m, "mean")


@settings(max_examples=25, deadline=None)
@given(
    B=st.integers(2, 6),
    T=st.integers(1, 6),
    n_split=st.integers(1, 3),
    seed=st.integers(0, 10_000),
    agg=st.sampled_from(L.AGG_MODES),
    which=st.sampled_from(["ppo", "value", "dis"]),
)
def test_microbatches_with_global_denominator_equal_full_batch(B, T, n_split, seed, agg, which):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) > 0.3
    a, b, c = (torch.randn(B, T, generator=g) for _ in range(3))

    def run(sl, denom):
        x = (a[sl] * 0.3).clone().requires_grad_()
        if which == "ppo":
            loss, _ = L.ppo_policy_loss(
                x, b[sl] * 0.3, c[sl], mask[sl], clip_low=0.2, clip_high=0.28, agg=agg, num_tokens=denom
            )
        elif which == "value":
            loss, _ = L.value_loss(x, b[sl], c[sl], mask[sl], clip=0.2, agg=agg, num_tokens=denom)
        else:
            loss, _ = L.dis_policy_loss(x, b[sl] * 0.3, c[sl], mask[sl], agg=agg, num_tokens=denom)
        loss.backward()
        return loss.detach(), x.grad

    denom = L.loss_denominator(mask, agg).clamp_min(1)
    full_loss, full_grad = run(slice(None), denom)
    bounds = torch.linspace(0, B, n_split + 1).long().tolist()
    parts = [run(slice(lo, hi), denom) for lo, hi in zip(bounds[:-1], bounds[1:]) if hi > lo]
    torch.testing.assert_close(sum(p[0] for p in parts), full_loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([p[1] for p in parts]), full_grad, atol=1e-6, rtol=1e-5)


def test_dis_gradient_is_in_band_importance_weighted():
    infer = torch.zeros(1, 4)
    logp = torch.tensor([[math.log(1.1), math.log(0.7), math.log(1.3), 0.0]], requires_grad=True)
    adv = torch.tensor([[2.0, 1.0, 1.0, -1.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    loss, m = L.dis_policy_loss(logp, infer, adv, mask, eps_low=0.2, eps_high=0.28)
    loss.backward()
    # rho = 1.1 (in), 0.7 (out, below 0.8), 1.3 (out, above 1.28), 1.0 (in): grad = -rho A / 4
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.1 * 2 / 4, 0.0, 0.0, 1.0 / 4]]))
    assert m["dis/masked_frac"].item() == 0.5


def test_value_loss_hand_and_clipfrac():
    v = torch.tensor([[1.0, 0.0]], requires_grad=True)
    old = torch.tensor([[0.0, 0.0]])
    ret = torch.tensor([[2.0, 1.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, m = L.value_loss(v, old, ret, mask, clip=0.2)
    # token 0: unclipped (1-2)^2 = 1, clipped (0.2-2)^2 = 3.24 -> 3.24; token 1: both 1
    assert loss.item() == pytest.approx(0.5 * (3.24 + 1) / 2)
    assert m["critic/clipfrac"].item() == 0.5
    loss.backward()
    assert v.grad[0, 0].item() == 0.0  # the clipped branch is constant in V beyond the clip
    loss_nc, _ = L.value_loss(v, old, ret, mask, clip=None)
    assert loss_nc.item() == pytest.approx(0.5 * (1 + 1) / 2)


def test_explained_variance():
    mask = torch.tensor([[True, True, True, False]])
    r = torch.tensor([[1.0, 2.0, 3.0, 50.0]])
    assert L.explained_variance(r, r, mask).item() == pytest.approx(1.0)
    assert L.explained_variance(torch.full_like(r, 2.0), r, mask).item() == pytest.approx(0.0)
    assert math.isnan(L.explained_variance(r, torch.ones_like(r), mask).item())


def test_shape_convention_is_asserted():
    with pytest.raises(AssertionError, match="mask must be bool"):
        L.ppo_policy_loss(
            torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), clip_low=0.2, clip_high=0.2
        )
    with pytest.raises(AssertionError, match="advantages has shape"):
        L.ppo_policy_loss(
            torch.zeros(2, 3),
            torch.zeros(2, 3),
            torch.zeros(2, 4),
            torch.ones(2, 3, dtype=torch.bool),
            clip_low=0.2,
            clip_high=0.2,
        )


def test_import_token_lossespulls_in_nothing_beyond_torch():
    code = (
        "import sys, torch; before = set(sys.modules); import losses; "
        "new = sorted(m for m in set(sys.modules) - before if m != 'losses'); print(new); assert not new, new"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(__import__("pathlib").Path(L.__file__).parent))


def test_position_buckets():
    assert L.position_buckets(3) == [("0", 0, 1), ("1", 1, 2), ("2", 2, 3)]
    assert L.position_buckets(6) == [("0", 0, 1), ("1", 1, 2), ("2", 2, 3), ("3", 3, 4), ("4-7", 4, 6)]
    assert [b[0] for b in L.position_buckets(33)] == ["0", "1", "2", "3", "4-7", "8-15", "16-31", "32-63"]


def test_explained_variance_by_position_is_ev_on_each_column_slice():
    mask, draw = rand_batch(B=16, T=10, seed=3)
    r, v = draw(), draw()
    got = L.explained_variance_by_position(v, r, mask)
    assert list(got) == [f"critic/ev_pos_{k}" for k in ("0", "1", "2", "3", "4-7", "8-15")]
    for label, lo, hi in L.position_buckets(10):  # the slow way: cut the columns out, plain EV on them
        sub = mask[:, lo:hi]
        rr, vv = r[:, lo:hi][sub], v[:, lo:hi][sub]
        want = 1 - ((rr - vv) - (rr - vv).mean()).pow(2).mean() / (rr - rr.mean()).pow(2).mean()
        assert got[f"critic/ev_pos_{label}"].item() == pytest.approx(want.item(), rel=1e-5)


def test_ev_of_summed_halves_statistics_is_the_batch_ev_not_the_mean_of_the_halves_evs():
    """Two halves of a batch (two ranks, or two micro-batches): the sum of their ev_stats gives the EV of the whole
    batch, overall and per position bucket. The halves' returns sit 3 apart, so the batch's Var(R) holds that gap and
    its EV (about 0.8) is far above each half's (about 0.4), which a mean of the halves' EVs reports."""
    g = torch.Generator().manual_seed(5)
    B, T = 16, 10
    mask = torch.arange(T)[None] < torch.randint(6, T + 1, (B,), generator=g)[:, None]
    r = torch.randn(B, T, generator=g) + 3.0 * (torch.arange(B) >= B // 2)[:, None]
    v = r + 0.8 * torch.randn(B, T, generator=g)
    halves = [slice(0, B // 2), slice(B // 2, B)]

    summed = sum(L.ev_stats(v[h], r[h], mask[h]) for h in halves)
    whole = direct_ev(v, r, mask)
    assert L.ev_from_stats(summed).item() == pytest.approx(whole, abs=1e-6)
    assert L.explained_variance(v, r, mask).item() == pytest.approx(whole, abs=1e-6)
    mean_of_halves = sum(direct_ev(v[h], r[h], mask[h]) for h in halves) / 2
    assert whole - mean_of_halves > 0.2, (whole, mean_of_halves)

    by_pos = [L.ev_stats_by_position(v[h], r[h], mask[h], width=T) for h in halves]
    assert list(by_pos[0]) == [f"critic/ev_pos_{k}" for k in ("0", "1", "2", "3", "4-7", "8-15")]
    for label, lo, hi in L.position_buckets(T):
        key = f"critic/ev_pos_{label}"
        cols = (torch.arange(T) >= lo) & (torch.arange(T) < hi)
        want = direct_ev(v, r, mask & cols)
        assert L.ev_from_stats(by_pos[0][key] + by_pos[1][key]).item() == pytest.approx(want, abs=1e-6), key
        assert want - sum(direct_ev(v[h], r[h], mask[h] & cols) for h in halves) / 2 > 0.1, key


def test_ev_from_stats_is_nan_for_constant_returns_or_no_token():
    mask = torch.ones(1, 1000, dtype=torch.bool)
    v = torch.randn(1, 1000, generator=torch.Generator().manual_seed(0))
    # Over 1000 tokens of 0.1, 3.3 or 123.4, E[R^2] - E[R]^2 of the float64 sums is round-off above 0 (1e-16 of E[R^2])
    for c in (0.0, 1.0, 0.1, 3.3, 123.4):
        assert math.isnan(L.explained_variance(v, torch.full_like(v, c), mask).item()), c
    assert math.isnan(L.explained_variance(v, v, torch.zeros_like(mask)).item())
    assert math.isnan(L.ev_from_stats(torch.zeros(5, dtype=torch.float64)).item())
    assert L.ev_from_stats(torch.zeros(3, 5)).isnan().all()  # [..., 5] -> [...]


def test_rank_without_valid_tokens_adds_nothing_to_the_global_denominator():
    """Summed over dp ranks, a rank whose minibatch has no valid token contributes 0 tokens, not 1: the global
    token-mean loss is the same as if that rank held no rows."""
    empty, full = (
        torch.zeros(2, 4, dtype=torch.bool),
        torch.tensor([[True, True, False, False], [True, False, False, False]]),
    )
    assert L.loss_denominator(empty, "token-mean").item() == 0
    assert (L.loss_denominator(empty, "token-mean") + L.loss_denominator(full, "token-mean")).item() == 3
    loss = torch.ones(2, 4)
    assert L.aggregate(loss, empty).item() == 0  # alone, a batch with nothing to learn has loss 0, not 0/0
