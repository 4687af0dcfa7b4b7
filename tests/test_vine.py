"""vine.py (VinePPO's Monte Carlo values) against hand-computed cases with a fake engine whose continuations are known,
its seeds, and --algo vine end to end on the tiny addition model."""

import datasets
import pytest
import torch

import losses as L
import vine
from conftest import small
from data.tasks import Task
from data.tiny import build_tokenizer
from rollout import Rollout, Sampling

TOK = build_tokenizer()
EOS = TOK.eos_token_id
PROMPT = TOK("q", add_special_tokens=False).input_ids


def ids(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False).input_ids


class Continuations:
    """A fake engine: continuation i (of n) from a state t tokens into the response answers "y" if i < t, else "n",
    then EOS; it records the calls."""

    def __init__(self):
        self.calls = []

    def generate(self, prompt_ids, s):
        self.calls.append(([list(p) for p in prompt_ids], s))
        outs = [
            ids("y" if s.row_seed(r) % s.n < len(prompt_ids[r // s.n]) - len(PROMPT) else "n") + [EOS]
            for r in range(len(prompt_ids) * s.n)
        ]
        return Rollout.from_ragged(outs, [p for p in prompt_ids for _ in range(s.n)], ["stop"] * len(outs))


def has_y(completions, **columns):
    return [float("y" in c) for c in completions]


def y_or_none(completions, **columns):
    return [1.0 if "y" in c else None for c in completions]


def task(reward) -> Task:
    rows = datasets.Dataset.from_dict({"prompt": ["q"], "answer": [""]})
    return Task("fake", rows, rows, reward, max_new_tokens=8)


def response(text: str) -> Rollout:
    return Rollout.from_ragged([ids(text) + [EOS]], [PROMPT], ["stop"])


S = Sampling(max_new_tokens=8, stop_token_ids=(EOS,), seed=5)


def test_mc_values_by_hand():
    """The response "ayc<eos>" (reward 1: it holds a y). From t tokens in, t of the 4 continuations answer y, and
    from t >= 2 the prefix "ay" already holds one: V = 0, 1/4, 1, 1; the advantages are V(t+1) - V(t), R - V(3)."""
    t = task(has_y)
    engine = Continuations()
    v = vine.mc_values(engine, TOK, t, t.train, response("ayc"), S, k=4, every=1)
    torch.testing.assert_close(v.values, torch.tensor([[0.0, 0.25, 1.0, 1.0]]))
    assert v.states.all() and v.extra_tokens == 4 * 4 * 2  # 4 states x 4 continuations of 2 tokens
    # one call per column, k samples per state, the budget left, seeds above every rollout seed
    assert [len(c[0][0]) - len(PROMPT) for c in engine.calls] == [0, 1, 2, 3]
    assert [c[1].max_new_tokens for c in engine.calls] == [8, 7, 6, 5] and all(c[1].n == 4 for c in engine.calls)
    assert engine.calls[0][1].seeds == tuple(
        2**31 + 5 * 8 * 4 + i for i in range(4)
    )  # row seed 5, 8 states x 4 at most
    mask = torch.ones(1, 4, dtype=torch.bool)
    rewards = L.last_token_rewards(torch.tensor([1.0]), mask)
    torch.testing.assert_close(
        L.vine_advantages(v.values, v.states, rewards, mask), torch.tensor([[0.25, 0.75, 0.0, 0.0]])
    )
    assert L.ev_from_stats(vine.ev_stats(v, rewards, mask, 8)["vine/ev_pos_0"]).isnan()  # one row: no variance

    v2 = vine.mc_values(Continuations(), TOK, t, t.train, response("ayc"), S, k=4, every=2)  # states at 0 and 2
    assert v2.states.tolist() == [[True, False, True, False]] and v2.values[0, 2] == 1.0 and v2.extra_tokens == 16
    torch.testing.assert_close(
        L.vine_advantages(v2.values, v2.states, rewards, mask), torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    )
    vals, has = vine.token_values(v2, mask)
    assert vals.tolist() == [[0.0, 0.0, 1.0, 1.0]] and has.all()


def test_unrewarded_continuations_leave_the_mean():
    """Continuations answering n get no reward (None): each state's mean is over its y's (1), and state 0, whose 4
    continuations all answer n, is no state (no baseline before column 1: advantage 0 there)."""
    t = task(y_or_none)
    v = vine.mc_values(Continuations(), TOK, t, t.train, response("abc"), S, k=4, every=1)
    assert v.states.tolist() == [[False, True, True, True]] and v.values[0, 1:].tolist() == [1.0, 1.0, 1.0]


def test_seeds_are_disjoint_from_the_rollouts_and_distinct():
    """In [2^31, 2^32) (the engine keeps a seed's low 32 bits; every other seed is below 2^31), one per continuation."""
    seeds = [
        vine.continuation_seed(r, j, i, 4, 3) for r in range(2**31 - 64, 2**31 + 64) for j in range(3) for i in range(4)
    ]
    assert len(set(s % 2**32 for s in seeds)) == len(seeds) and min(seeds) >= 2**31 and max(seeds) < 2**32


def test_same_step_same_values_on_the_tiny_model(tiny_model_dir):
    """With the real engine: the same rollout and step seed give the same values; another step seed gives others."""
    from data.tasks import encode_prompt, get_task
    from embedded_engine import EmbeddedEngine

    t = get_task("addition")
    rows = t.train.select(range(6))
    engine = EmbeddedEngine(tiny_model_dir, dtype="fp32")
    s = Sampling(max_new_tokens=t.max_new_tokens, stop_token_ids=(EOS,), seed=11)
    ro = engine.generate([encode_prompt(TOK, p) for p in rows["prompt"]], s)
    a, b = (vine.mc_values(engine, TOK, t, rows, ro, s, k=4, every=1) for _ in range(2))
    c = vine.mc_values(engine, TOK, t, rows, ro, Sampling(**{**s.__dict__, "seed": 12}), k=4, every=1)
    assert torch.equal(a.values, b.values) and torch.equal(a.states, b.states) and not torch.equal(a.values, c.values)
    assert torch.equal(a.states, ro.mask)  # the exact-match reward is never None: every token is a state


@pytest.mark.e2e
def test_algo_vine_trains_two_steps(tmp_path):
    from train_ppo import main

    hist = main(small(tmp_path, algo="vine", vine_k=2, eval_size=8))
    rl = [r for r in hist if r["step"] >= 1]
    assert len(rl) == 2 and all(r["ppo/grad_norm"] > 0 and "critic/value_loss" not in r for r in rl)
    for r in rl:  # addition's 5-token answers, every token a state: 2 x (5 + 4 + 3 + 2 + 1) continuation tokens per row
        assert r["vine/extra_tokens"] > 0 and r["vine/extra_token_ratio"] > 1 and r["time/vine"] > 0
        assert 0 < r["vine/explained_variance"] <= 1 and "vine/ev_pos_0" in r


# ----------------------------------------------------------------------------- multi-turn


class Rolls:
    """Three turns, ended by the environment itself (so a continuation finds the copy's turn count): reward 1 for the
    text "y"; each observation is a die roll from the environment's own generator, which reseed sets."""

    def reseed(self, seed):
        import random

        self.rng = random.Random(seed)

    def reset(self, row):
        self.t = 0
        return row["prompt"]

    def step(self, text):
        self.t += 1
        return (None if self.t == 3 else f"roll {self.rng.randint(1, 6)}"), float(text == "y"), self.t == 3


class Episodic:
    """A fake engine: a rollout episode (seed < 2^31) answers "y" on its first turn, then "n"; continuation i of 4
    (vine's seeds: i = (seed - 2^31) // 1024 mod 4) answers "y" on every turn if i < 2, else "n"."""

    def generate(self, prompt_ids, s):
        outs = []
        for r in range(len(prompt_ids)):
            seed, turn = s.row_seed(r), TOK.decode(prompt_ids[r]).count("<|im_start|>assistant") - 1
            y = (seed - 2**31) // 1024 % 4 < 2 if seed >= 2**31 else turn == 0
            outs.append(ids("y" if y else "n") + [EOS])
        return Rollout.from_ragged(outs, list(prompt_ids), ["stop"] * len(outs))


def test_mc_values_of_episodes_by_hand():
    """The rollout episode answers y, n, n (return 1). From the start of turn j, half the continuations answer y on
    each of the 3 - j turns left: V = (3 - j) / 2 = 1.5, 1, 0.5 (the y already collected is not counted). The advantages
    are turn 1: 1 + 1 - 1.5, turn 2: 0.5 - 1, turn 3: 0 - 0.5, on model tokens; the observations are masked."""
    import agent

    s = Sampling(max_new_tokens=4, stop_token_ids=(EOS,), seed=3)
    played = []

    def play(engine, rows, s_, **kw):
        played.append(agent.run_episodes(engine, TOK, Rolls, rows, s_, max_turns=5, context_len=256, **kw))
        return played[-1]

    ep = play(Episodic(), [{"prompt": "go", "answer": ""}], s, snapshots=True)
    assert ep.returns.tolist() == [1.0] and [st.turns for st in ep.starts[0]] == [0, 1, 2]
    v = vine.mc_values(Episodic(), TOK, None, None, ep, s, k=4, play=play)
    ro = ep.rollout
    cols = [len(st.tokens) for st in ep.starts[0]]  # the first model token of each turn
    assert cols[0] == 0 and all(ro.mask[0, c] and not ro.mask[0, c - 1] for c in cols[1:])
    assert v.states[0].nonzero().flatten().tolist() == cols and v.values[0, cols].tolist() == [1.5, 1.0, 0.5]
    assert v.extra_tokens == 4 * 2 * (3 + 2 + 1)  # 4 continuations x 2 tokens a turn x the turns left
    adv = L.vine_advantages(v.values, v.states, ep.rewards, ro.mask)
    turn = torch.cumsum(torch.zeros_like(ro.mask).index_fill(1, torch.tensor(cols), True), -1)  # 1, 2, 3 per column
    want = torch.tensor([0.0, 0.5, -0.5, -0.5])[turn] * ro.mask
    torch.testing.assert_close(adv, want)

    # The continuations' own randomness is fresh: the 4 copies of a state roll differently from each other, and from
    # the episode (their generators were deep-copied from it, then reseeded).
    cont = played[-1]
    rolls = [tuple(m["content"] for m in msgs if m["role"] == "user") for msgs in cont.messages]
    assert len(rolls) == 3 * 4 and len(set(rolls[:4])) > 1 and len(rolls[0]) == 2  # from turn 1: rolls after turns 1, 2
    own = tuple(m["content"] for m in ep.messages[0][2::2])
    assert any(r != own for r in rolls[:4])


def test_a_continuation_needs_reseed():
    import agent

    class NoSeed(Rolls):
        reseed = None

    ep = agent.run_episodes(
        Episodic(),
        TOK,
        Rolls,
        [{"prompt": "go", "answer": ""}],
        Sampling(max_new_tokens=4, stop_token_ids=(EOS,)),
        max_turns=5,
        context_len=256,
        snapshots=True,
    )
    st = ep.starts[0][1]
    st.env.__class__ = NoSeed
    with pytest.raises(ValueError, match="has no reseed"):
        agent.run_episodes(
            Episodic(), TOK, NoSeed, [], Sampling(max_new_tokens=4), max_turns=5, context_len=256, starts=[st]
        )


RETRY = '''
class Retry:
    """examples/env_retry.py's environment with the no-op reseed --algo vine asks for."""

    def reseed(self, seed):
        pass

    def reset(self, row):
        self.answer = row["answer"]
        return row["prompt"]

    def step(self, text):
        return (None, 1.0, True) if text.strip() == self.answer else ("wrong, try again", 0.0, False)
'''


@pytest.mark.e2e
def test_algo_vine_on_episodes_and_its_reseed_refusal(tmp_path):
    from train_ppo import main

    with pytest.raises(ValueError, match="RetryEnv has no reseed"):
        main(small(tmp_path / "refused", algo="vine", env="examples/env_retry.py:RetryEnv", max_turns=2))
    env = tmp_path / "retry.py"
    env.write_text(RETRY)
    hist = main(small(tmp_path / "run", algo="vine", vine_k=2, env=f"{env}:Retry", max_turns=2, eval_size=8))
    rl = [r for r in hist if r["step"] >= 1]
    assert len(rl) == 2 and all(
        r["ppo/grad_norm"] > 0 and r["vine/extra_token_ratio"] > 0 and "rollout/turns_mean" in r for r in rl
    )
