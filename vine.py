"""Monte Carlo values (VinePPO: Kazemnejad et al. 2024, "VinePPO: Unlocking RL Potential For LLM Reasoning Through
Refined Credit Assignment", arXiv 2410.01679): `--algo vine`, and bench/value_ceiling.py's oracle.

    from vine import mc_values
    v = mc_values(engine, tok, task, rows, ro, sampling, k=4, every=1)   # v.values, v.states [B, T]; v.extra_tokens
    adv = losses.vine_advantages(v.values, v.states, token_rewards, mask)

A state is a row's context before response column t (prompt + response[:t]). From each chosen state the rollout engine
samples K continuations with the run's sampling settings; V(s) is their mean reward to go, the expected sum of rewards
from t on (gamma = 1). The state after the last token is terminal: V = 0, and the row's reward sits on its last token,
so the last chunk's advantage is R - V (losses.vine_advantages). States:
- single-turn: columns 0, M, 2M, ... of each response (M = --vine-every; 1 = every token); a continuation is scored
  with the task's reward exactly as the batch is (the prefix and the continuation decoded together);
- multi-turn: the start of each model turn; a continuation plays the rest of the episode (agent.run_episodes with
  starts=) from a deep copy of the environment at the state, reseeded, so its own randomness is drawn afresh; V is
  the mean of the continuations' returns less the rewards collected before the state.

A continuation without a reward (the reward returned None) leaves its state's mean; a state none of whose K
continuations is rewarded is no state (its tokens join the previous chunk; before a row's first state the advantage
is 0).

Seeds: continuation i of state j of the rollout row seeded q draws from 2^31 + (q S + j K + i) mod 2^31, with
S = K x the most states a row can have (continuation_seed; multi-turn: episode_seed). Every other seed of the project (rollouts, evaluation,
multi-turn calls) is below 2^31, and the embedded engine's generators keep a seed's low 32 bits (torch's mt19937), so
vine's seeds live in [2^31, 2^32): continuations never replay the rollout's own draws (a continuation from state 0
seeded like its row would be the row itself); they are distinct within a run while its rows x S stay below 2^31; and
the same step gives the same values whatever the split over data-parallel ranks (rollout row seeds are consecutive).
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import NamedTuple

import torch
from torch import Tensor

import losses
from data.rewards import reward_columns, score
from agent import _CALLS_PER_EPISODE as CALLS_PER_EPISODE, Episodes
from rollout import Sampling

VINE_SEED_BASE = 2**31  # above every other seed of the project (all are reduced mod 2^31), below 2^32
MAX_TURN_STATES = 512  # agent.run_episodes takes max_turns < 512: the states of an episode


class Values(NamedTuple):
    """Monte Carlo values of a batch's rows."""

    values: Tensor  # [B, T] float32: V(s_t), the mean reward of the continuations from before column t (where states)
    states: Tensor  # [B, T] bool: the columns whose state has a value
    extra_tokens: int  # model tokens the continuations generated


def continuation_seed(row_seed: int, state: int, i: int, k: int, states: int) -> int:
    """The seed of continuation i (of k) from state number `state` (of at most `states`) of the rollout row seeded
    `row_seed`: in [2^31, 2^32), distinct for consecutive row seeds while rows x states x k < 2^31."""
    assert 0 <= i < k and 0 <= state < states, (state, i, states, k)
    return VINE_SEED_BASE + (row_seed * states * k + state * k + i) % 2**31


def episode_seed(episode: int, turn: int, i: int, k: int) -> int:
    """The seed of continuation i (of k) from the start of turn `turn` of the episode seeded `episode` (its
    Sampling.row_seed): its engine call c draws from this + c, its environment's reseed gets this + 1023 (agent.Start).
    In [2^31, 2^32); distinct for consecutive episode seeds while episodes x 512 x k < 2^21."""
    assert 0 <= i < k and 0 <= turn < MAX_TURN_STATES, (turn, i, k)
    return VINE_SEED_BASE + ((episode * MAX_TURN_STATES + turn) * k + i) * CALLS_PER_EPISODE % 2**31


@torch.no_grad()
def mc_values(engine, tok, task, rows, out, sampling: Sampling, *, k: int, every: int = 1, play=None) -> Values:
    """V(s) of every row of `out`, the rollout of `rows` (a datasets.Dataset of task rows, sampling.n samples each)
    generated with `sampling`, from k continuations per state.

    Single-turn (out a Rollout): states at columns t = 0, every, 2 every, ... of each response; one engine call per
    column (its states share the budget max_new_tokens - t). Multi-turn (out the agent.Episodes that
    play(engine, rows, sampling, snapshots=True) returned): states at the start of each model turn; every
    continuation plays the rest of the episode from a deep copy of the environment there, reseeded (agent.Start), all
    in one play(engine, [], sampling, starts=...) call. V is the mean of the continuations' returns less the rewards
    collected before the state."""
    if k < 1 or every < 1:
        raise ValueError(f"vine: --vine-k and --vine-every must be >= 1, got {k} and {every}")
    if play is not None:
        return _episode_values(engine, play, out, sampling, k, every)
    ro = out
    B, T = ro.mask.shape
    resp = [t[m].tolist() for t, m in zip(ro.tokens, ro.mask)]
    columns = reward_columns(rows, sampling.n)  # per rollout row
    values = torch.zeros(B, T)
    states = torch.zeros(B, T, dtype=torch.bool)
    extra = 0
    most = -(-sampling.max_new_tokens // every)  # states a row can have
    for t in range(0, T, every):
        live = [b for b in range(B) if len(resp[b]) > t]
        j = t // every
        seeds = tuple(continuation_seed(sampling.row_seed(b), j, i, k, most) for b in live for i in range(k))
        s = replace(sampling, max_new_tokens=sampling.max_new_tokens - t, n=k, seeds=seeds)
        cont = engine.generate([ro.prompt_ids[b] + resp[b][:t] for b in live], s)
        extra += int(cont.mask.sum())
        owner = [b for b in live for _ in range(k)]
        texts = tok.batch_decode(
            [resp[b][:t] + c[m].tolist() for b, c, m in zip(owner, cont.tokens, cont.mask)], skip_special_tokens=True
        )
        sc = score(task, texts, {key: [col[b] for b in owner] for key, col in columns.items()})
        ok = sc.rewarded.view(-1, k)
        values[live, t] = (sc.rewards.view(-1, k) * ok).sum(-1) / ok.sum(-1).clamp_min(1)
        states[live, t] = ok.any(-1)
    return Values(values, states, extra)


def _episode_values(engine, play, ep: Episodes, sampling: Sampling, k: int, every: int) -> Values:
    if every != 1:
        raise ValueError(
            f"vine: --vine-every {every} with a multi-turn task: its states are the starts of the model turns"
        )
    if len(ep.starts) != len(ep.turns):
        raise ValueError("vine: the episodes were played without snapshots (run_episodes(snapshots=True))")
    plan = [(b, st) for b, e in enumerate(ep.episode) for st in ep.starts[e]]  # one row per episode (no compaction)
    starts = [
        replace(st, env=copy.deepcopy(st.env), seed=episode_seed(sampling.row_seed(ep.episode[b]), st.turns, i, k))
        for b, st in plan
        for i in range(k)
    ]
    cont = play(engine, [], sampling, starts=starts)
    values = torch.zeros(ep.rollout.mask.shape)
    states = torch.zeros(ep.rollout.mask.shape, dtype=torch.bool)
    for (b, st), ret in zip(plan, cont.returns.view(-1, k).mean(-1).tolist()):
        values[b, len(st.tokens)] = ret - st.ret
        states[b, len(st.tokens)] = True
    return Values(values, states, int(cont.rollout.mask.sum()) - sum(sum(st.model) for st in starts))


def token_values(v: Values, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(per token the value of its chunk's state [B, T], the valid tokens that have one [B, T] bool): the values a
    critic's would be compared with."""
    B, T = mask.shape
    cur = torch.where(v.states.to(mask.device), torch.arange(T, device=mask.device), -1).cummax(-1).values
    return v.values.to(mask.device).gather(-1, cur.clamp_min(0)), mask & (cur >= 0)


def ev_stats(v: Values, rewards: Tensor, mask: Tensor, width: int) -> dict[str, Tensor]:
    """vine/explained_variance and vine/ev_pos_*, as the [5] sufficient statistics of losses.ev_stats (for
    Metrics.add_ev, which sums them over ranks into the EV of the whole batch): the explained variance of the Monte
    Carlo values (token_values) against the returns to go (gamma = 1) over `mask`'s tokens, the figures a critic logs
    as critic/*."""
    values, has = token_values(v, mask)
    returns = (rewards.float() * mask).flip(-1).cumsum(-1).flip(-1)
    by_pos = losses.ev_stats_by_position(values, returns, has, width)
    return {
        "vine/explained_variance": losses.ev_stats(values, returns, has),
        **{k.replace("critic/", "vine/"): x for k, x in by_pos.items()},
    }
