"""--task walk (data/walk.py): the walk's rules on hand cases, the gust drawn only from the reseeded RNG, disjoint train
and test configurations, the observation format, the task through get_task, bench/walk_design.py's exact figures
against hand-computed cases and against the environment itself, and the default model's build."""

import importlib.util
import json
import os
import random
import sys

import pytest
import torch

import agent
import chat
from conftest import CACHE, REPO
from data.tasks import get_task
from data.tiny import build_tokenizer, default_model, demo_engine
from data.walk import (
    P_JUMP,
    P_JUMP1,
    START,
    TURNS,
    WALL,
    WIND,
    WalkEnv,
    demo_move,
    observation,
    parse_prompt,
    walk_rows,
)
from embedded_engine import EmbeddedEngine
from rollout import Sampling

spec = importlib.util.spec_from_file_location("walk_design", os.path.join(REPO, "bench", "walk_design.py"))
walk_design = importlib.util.module_from_spec(spec)
sys.modules["walk_design"] = walk_design  # dataclasses look their module up while the class is made
spec.loader.exec_module(walk_design)


def gust_of(seed: int, wind: int) -> int:
    """The gust a seed gives: the first draw of its RNG, as WalkEnv makes it."""
    return random.Random(seed).randint(0, wind)


def play(prompt: str, moves: list[str], seed: int = 0) -> list:
    env = WalkEnv()
    env.reseed(seed)
    assert env.reset({"prompt": prompt, "answer": "home"}) == prompt
    return [env.step(m) for m in moves]


def test_walk_rules_on_hand_cases():
    seed = next(s for s in range(100) if gust_of(s, 9) == 4)  # a seed whose gust is +4
    # 3 to go, step: 2; the gust: 6; jump, jump, jump: 4, 2, 0 -> home on the last turn
    assert play("wind 9: 3 to go, 5 left", ["1", "2", "2", "2", "1"], seed) == [
        ("6 to go, 4 left", 0.0, False),
        ("4 to go, 3 left", 0.0, False),
        ("2 to go, 2 left", 0.0, False),
        ("0 to go, 1 left", 0.0, False),
        (None, 1.0, True),
    ]  # home is absorbing: the last step stays home
    # a jump from 1 to go lands 1 past home; any other text stands still; one short of home at the end: reward 0
    seed0 = next(s for s in range(100) if gust_of(s, 6) == 0)
    assert play("wind 6: 2 to go, 4 left", ["1", "2", " go ", "1"], seed0) == [
        ("1 to go, 3 left", 0.0, False),
        ("1 to go, 2 left", 0.0, False),
        ("1 to go, 1 left", 0.0, False),
        (None, 1.0, True),
    ]
    assert play("wind 6: 2 to go, 4 left", ["1", "2", "22", "2"], seed0)[-1] == (None, 0.0, True)
    # home before the gust is out of the wind; the gust stops at the wall
    assert play("wind 12: 2 to go, 4 left", ["2"], seed)[0] == ("0 to go, 3 left", 0.0, False)
    seed12 = next(s for s in range(100) if gust_of(s, 12) == 12)
    assert play("wind 12: 5 to go, 4 left", ["1"], seed12)[0] == (f"{WALL} to go, 3 left", 0.0, False)


def test_walk_refuses_misuse():
    env = WalkEnv()
    env.reset({"prompt": "wind 6: 3 to go, 4 left"})
    with pytest.raises(RuntimeError, match=r"reseed\(seed\) must be called"):
        env.step("1")
    env.reseed(0)
    env.reset({"prompt": "wind 6: 3 to go, 1 left"})
    assert env.step("1")[2] is True
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("1")
    with pytest.raises(ValueError, match=r"'walk 3' is not 'wind G: d to go, K left'"):
        env.reset({"prompt": "walk 3"})


def test_reseed_determines_the_gust():
    """The gust is the reseeded RNG's first draw: the same seed gives the same gust, and over seeds every push 0..G
    occurs about equally often."""

    def gust(seed):
        return int(play("wind 8: 3 to go, 4 left", ["1"], seed)[0][0].split()[0]) - 2

    assert [gust(s) for s in range(50)] == [min(WALL - 2, gust_of(s, 8)) for s in range(50)]
    counts = torch.bincount(torch.tensor([gust(s) for s in range(9000)]), minlength=8).float()
    assert counts[:7].min() > 800 and counts[7] > 1600  # 0..6 ~1000 each; 7 and 8 both end at the wall (9 to go)
    # through the driver: an episode's gust follows its seed, not the batch it is played in
    tok = build_tokenizer()
    rows = [{"prompt": "wind 12: 5 to go, 4 left", "answer": "home"}] * 6
    s = Sampling(max_new_tokens=4, seed=3)
    full = agent.run_episodes(demo_engine(tok, move=demo_move), tok, WalkEnv, rows, s, max_turns=6, context_len=256)
    tail = agent.run_episodes(
        demo_engine(tok, move=demo_move),
        tok,
        WalkEnv,
        rows[3:],
        Sampling(max_new_tokens=4, seed=6),
        max_turns=6,
        context_len=256,
    )
    assert full.messages[3:] == tail.messages
    assert len({m[2]["content"] for m in full.messages}) > 1  # the gusts differ between episodes


def test_critic_context_is_the_gust_to_come_and_a_reseeded_copy_draws_afresh():
    import copy

    seed = next(s for s in range(100) if gust_of(s, 9) == 4)
    env = WalkEnv()
    env.reseed(seed)
    env.reset({"prompt": "wind 9: 3 to go, 5 left"})
    assert env.critic_context() == "gust 4" and env.critic_context() == "gust 4"  # drawn once, at the RNG's first draw
    twin = copy.deepcopy(env)
    assert (
        env.step("1")[0] == "6 to go, 4 left"
    )  # 3 - 1 + 4: the gust the critic was told, the same as without the call
    other = next(s for s in range(100) if gust_of(s, 9) == 0)
    twin.reseed(other)  # a vine continuation from the turn's start: its own gust, not the original's
    assert twin.step("1")[0] == "2 to go, 4 left" and twin.critic_context() == "gust 0"
    # through the driver: the episode's critic string names the gust its observation then shows
    tok = build_tokenizer()
    out = agent.run_episodes(
        demo_engine(tok, move=demo_move),
        tok,
        WalkEnv,
        [{"prompt": "wind 12: 5 to go, 4 left", "answer": "home"}] * 8,
        Sampling(max_new_tokens=4, seed=3),
        max_turns=6,
        context_len=256,
    )
    for ctx, msgs in zip(out.critic_context, out.messages):
        first = int(msgs[1]["content"])  # the move of turn 1: 5 - move + gust, capped at the wall
        assert msgs[2]["content"].startswith(f"{min(WALL, 5 - first + int(ctx.split()[1]))} to go")


def test_observation_format_and_layout():
    """Every observation is 15 characters, so the response's token columns line up across episodes: turn j's move
    and <|im_end|> sit at the same two columns in every row."""
    assert observation(8, 4) == "8 to go, 4 left"
    assert {len(observation(d, k)) for d in range(WALL + 1) for k in range(1, max(TURNS))} == {15}
    assert parse_prompt("wind 12: 5 to go, 6 left") == (12, 5, 6)
    tok = build_tokenizer()
    task = get_task("walk")
    ep = agent.run_episodes(
        demo_engine(tok, move=demo_move),
        tok,
        WalkEnv,
        task.train.to_list()[:200],
        Sampling(max_new_tokens=task.max_new_tokens, seed=0),
        max_turns=task.max_turns,
        context_len=256,
    )
    turn = 2 + len(chat.observation_ids(tok, observation(3, 3)))  # move, <|im_end|>, observation
    for m, k in zip(ep.rollout.mask, ep.turns):
        assert m.nonzero().flatten().tolist() == [turn * j + c for j in range(k) for c in (0, 1)]
    assert set(ep.finish) == {"done"} and ep.rollout.tokens.shape[1] + max(map(len, ep.rollout.prompt_ids)) < 256


def test_walk_task_rows_and_split():
    task = get_task("walk")
    assert task.env is WalkEnv and task.max_turns == max(TURNS) == 6 and task.max_new_tokens == 4
    assert len(task.train) == 20000 and len(task.test) == 1000 and set(task.train["answer"]) == {"home"}
    train, test = set(task.train["prompt"]), set(task.test["prompt"])
    assert not train & test
    assert len(train | test) == len(WIND) * len(START) * len(TURNS) and len(test) == round(0.15 * len(train | test))
    assert walk_rows(1)[1] != walk_rows(0)[1] and walk_rows(0) == walk_rows(0)


def test_design_hand_cases():
    """One turn from 1 to go, a coin between step (home) and jump (still 1): success 1/2, the best policy 1; the
    move's column has V = 1/2 (ratio 1), the <|im_end|> column V = 1 or 0 (ratio 0): headroom 1 / mean(1, 0) = 2."""
    r = walk_design.evaluate(walk_design.Design(d0=(1,), turns=(1,), gust=(0,), p_jump=0.0, p_jump1=0.5))
    assert r["success"] == 0.5 and r["optimal"] == 1.0 and r["ratio"] == [1.0, 0.0] and r["headroom"] == 2.0
    # 2 to go, 2 turns, always step: 1 to go, the gust +0 or +1 (1 or 2 to go), step: home half the time. Turn 1's two
    # columns carry all of the variance (ratio 1), turn 2's none: headroom 2; jumping first is home out of the wind.
    r = walk_design.evaluate(walk_design.Design(d0=(2,), turns=(2,), gust=(1,), p_jump=0.0, p_jump1=0.0))
    assert r["success"] == 0.5 and r["optimal"] == 1.0 and r["ratio"] == [1.0, 1.0, 0.0, 0.0] and r["headroom"] == 2.0
    # pooled EV of the perfect critic: 1 - mean_t E[V(1-V)] / Var(R) = 1 - (0.25 + 0.25 + 0 + 0) / 4 / 0.25 = 0.5
    assert r["ev_perfect"] == pytest.approx(0.5) and r["ev_prompt"] == pytest.approx(0.0)
    # the same with a coin between step and jump from 2 to go: a jump first is home (Q = 1); a step is 1 to go, then
    # the gust: 1 to go (home next turn) or 2 to go (home if the coin jumps): Q = 3/4, V_0 = 7/8. Per column,
    # E[V(1-V)] = 7/64, then 1/2 * 3/4 * 1/4 = 3/32 (ratio 6/7), then 1/4 (2 to go) * 1/2 * 1/2 = 1/16 (ratio 4/7),
    # then 0: headroom 4 / (1 + 6/7 + 4/7) = 28/17
    r = walk_design.evaluate(walk_design.Design(d0=(2,), turns=(2,), gust=(1,), p_jump=0.5, p_jump1=0.0))
    assert r["success"] == 0.875 and r["optimal"] == 1.0
    assert r["ratio"] == pytest.approx([1.0, 6 / 7, 4 / 7, 0.0]) and r["headroom"] == pytest.approx(28 / 17)


def test_design_matches_the_environment():
    """bench/walk_design.py's default design is data/walk.py's, and its exact warm success is what the environment
    played with demo_move gives (Monte Carlo, 3 sigma), for each of a few rows and over all of them."""
    d = walk_design.Design()
    assert (d.d0, d.turns, d.gust, d.p_jump, d.p_jump1, walk_design.WALL) == (
        tuple(START),
        tuple(TURNS),
        tuple(WIND),
        P_JUMP,
        P_JUMP1,
        WALL,
    ) and d.slip == 0.0
    rng = random.Random(0)

    def success(prompt, n):
        wins = 0
        for i in range(n):
            env = WalkEnv()
            env.reseed(i)
            obs, done = env.reset({"prompt": prompt}), False
            while not done:
                obs, reward, done = env.step(demo_move(obs, rng))
            wins += reward
        return wins / n

    for g, d0, k in [(6, 2, 4), (12, 5, 6), (9, 3, 5)]:
        exact = walk_design.solve(d, g)[0](d0, k, False)
        n = 4000
        assert abs(success(f"wind {g}: {d0} to go, {k} left", n) - exact) < 3 * (exact * (1 - exact) / n) ** 0.5 + 1e-9
    assert walk_design.evaluate(d)["success"] == pytest.approx(0.350, abs=5e-4)


def test_walk_warmup_fits_the_demonstrations_and_is_deterministic(tmp_path):
    """The default walk build's path at a tiny size (data.tiny.warmup on walk: demonstrations played by the driver,
    supervised steps on their model tokens, greedy episodes as the evaluation): it takes its steps, changes the
    weights, and two runs give the same history and weights. The full build is the slow test below."""
    import transformers

    from data.tasks import walk_task
    from data.tiny import build_tiny_model, warmup

    start = build_tiny_model(str(tmp_path / "start"), seed=0)
    task = walk_task(n_train=96, n_test=8)
    runs = [
        warmup(start, str(tmp_path / name), task, target_acc=1.0, max_steps=3, eval_every=2, n_eval=16, batch_size=8)
        for name in ("a", "b")
    ]
    assert runs[0]["steps"] == 3 and [h["step"] for h in runs[0]["history"]] == [0, 2, 3]
    assert runs[0]["history"] == runs[1]["history"] and all(h["loss"] > 0 for h in runs[0]["history"][1:])
    a, b, s = (transformers.AutoModelForCausalLM.from_pretrained(tmp_path / n) for n in ("a", "b", "start"))
    assert all(torch.equal(pa, pb) for pa, pb in zip(a.parameters(), b.parameters()))
    assert not all(torch.equal(pa, ps) for pa, ps in zip(a.parameters(), s.parameters()))


# Slow (make test-slow, not CI): 7-8 minutes on 2 cores, the longest build, and no other test needs the model.
@pytest.mark.slow
@pytest.mark.e2e  # builds the walk model when .cache lacks it
def test_default_walk_model_builds_and_plays():
    """The default walk model imitates the demonstrations: sampled held-out success near the design's 0.35."""
    path = default_model(cache_dir=CACHE, task="walk")
    assert "tiny-walk-" in path and default_model(cache_dir=CACHE, task="walk") == path
    stats = json.load(open(os.path.join(path, "warmup.json")))
    assert stats["steps"] == 300
    tok = build_tokenizer()
    task = get_task("walk")
    ep = agent.run_episodes(
        EmbeddedEngine(path, dtype="fp32"),
        tok,
        WalkEnv,
        task.test.to_list()[:500],
        Sampling(1.0, max_new_tokens=4, stop_token_ids=(tok.eos_token_id,), seed=0),
        max_turns=task.max_turns,
        context_len=256,
    )
    assert 0.2 <= float((ep.returns > 0).float().mean()) <= 0.45
