"""Multi-turn rollouts (agent.py): observation tokens are attended and never trained, the driver keeps the engine's
ids, budgets end episodes with their reason, compaction rows carry the episode's return, and the loop trains on them."""

import json

import pytest
import torch

import agent
import chat
import logprobs
import losses as L
from conftest import read_metrics, torchrun, train_cli
from data.guess import GuessEnv, interval
from data.tasks import guess_task
from data.tiny import build_tiny_model, build_tokenizer, demo_engine
from embedded_engine import EmbeddedEngine
from rollout import Rollout, Sampling
from update import minibatches

TOK = build_tokenizer()
EOS = TOK.eos_token_id


class ThreeTurns:
    """Any text is a turn; the observation names the turn; reward 0.1 on turns 1 and 2, 1 on turn 3, which ends it."""

    def reset(self, row):
        self.t = 0
        return row["prompt"]

    def step(self, text):
        self.t += 1
        return (None, 1.0, True) if self.t == 3 else (f"turn {self.t} noted", 0.1, False)


class Scripted:
    """A fake engine: row r answers the next text of its script (chosen by how many turns its context holds), with
    made-up log-probs, and records every call."""

    def __init__(self, texts, finish="stop"):
        self.finish, self.calls = finish, []
        self.ids = [TOK(t, add_special_tokens=False).input_ids + ([EOS] if finish == "stop" else []) for t in texts]

    def generate(self, prompt_ids, sampling):
        self.calls.append(([list(p) for p in prompt_ids], sampling))
        outs = []
        for p in prompt_ids:
            k = TOK.decode(p).count("<|im_start|>assistant") - 1
            outs.append(self.ids[k % len(self.ids)])
        T = max(map(len, outs))
        tokens = torch.tensor([o + [0] * (T - len(o)) for o in outs])
        mask = torch.tensor([[True] * len(o) + [False] * (T - len(o)) for o in outs])
        logp = -torch.arange(1, T + 1).float().expand(len(outs), T) / 10 * mask
        return Rollout(tokens, logp, mask, [list(p) for p in prompt_ids], [self.finish] * len(outs))


def test_to_batch_attends_observations_and_recompute_equals_engine(tiny_policy):
    """3-turn episodes on an fp32 engine: the trainer's forward over to_batch's layout gives the engine's log-probs
    on every model token; with the observations dropped from the attention mask (the TRL#4974 bug) it does not."""
    model = tiny_policy
    engine = EmbeddedEngine(model, dtype="fp32")
    rows = [{"prompt": f"{a:03d}+{b:03d}", "answer": ""} for a, b in ((12, 345), (999, 1), (500, 500))]
    ep = agent.run_episodes(
        engine,
        TOK,
        ThreeTurns,
        rows,
        Sampling(max_new_tokens=12, n=4, seed=3, stop_token_ids=(EOS,)),
        max_turns=5,
        context_len=256,
    )
    ro = ep.rollout
    assert (
        ep.turns.count(3) >= 4 and ep.finish.count("done") >= 4
    )  # most turns of the warmed-up model end in its stop token
    obs = ro.attend & ~ro.mask
    assert obs.any() and not (ro.infer_logp[obs] != 0).any()
    b = ro.to_batch(TOK.pad_token_id)
    P = b.response_start
    assert torch.equal(b.attention_mask[:, P:].bool(), ro.attend)
    for r in range(len(ro.mask)):  # positions run 0, 1, 2, ... over every attended token, observations included
        real = b.attention_mask[r].bool()
        assert torch.equal(b.position_ids[r][real], torch.arange(int(real.sum())))

    def recompute(attention_mask):
        pos = (attention_mask.cumsum(-1) - 1).clamp_min(0)
        logits = model(input_ids=b.input_ids, attention_mask=attention_mask, position_ids=pos).logits[:, P - 1 : -1]
        return logprobs.token_logprobs(logits, ro.tokens, 1.0)

    with torch.no_grad():
        good = recompute(b.attention_mask)
        dropped = b.attention_mask.clone()
        dropped[:, P:] = ro.mask.long()
        bad = recompute(dropped)
    assert (good - ro.infer_logp)[ro.mask].abs().max() < 1e-4
    assert (bad - ro.infer_logp)[ro.mask].abs().max() > 0.1


def test_prefix_cache_prefills_only_new_tokens_and_keeps_the_log_probs(tiny_policy):
    """EmbeddedEngine(prefix_cache=True): 3-turn episodes over prompts of unequal length (padded rows) on an fp32
    engine sample what a fresh prefill of each turn's whole context samples, with log-probs equal to float rounding,
    and prefill fewer tokens (measured 450 against 830: each turn prefills its observation, and the rows' longest one
    sets the window); new weights drop the cache."""
    rows = [{"prompt": p, "answer": ""} for p in ("12+345", "9+1", "500+500 and some more words")]
    s = Sampling(max_new_tokens=12, n=2, seed=3, stop_token_ids=(EOS,))
    got = {}
    for cached in (False, True):
        engine = EmbeddedEngine(tiny_policy, dtype="fp32", prefix_cache=cached)
        got[cached] = (
            agent.run_episodes(engine, TOK, ThreeTurns, rows, s, max_turns=5, context_len=256),
            engine.prefill_tokens,
        )
    (plain, n_plain), (fast, n_fast) = got[False], got[True]
    assert plain.messages == fast.messages and torch.equal(plain.rollout.tokens, fast.rollout.tokens)
    assert max(plain.turns) == 3 and n_fast < 0.6 * n_plain, (n_fast, n_plain)
    # float rounding, bounded as the trainer-vs-engine recompute tests are: max 1.5e-5 on one build of the default
    # model (this machine's after a reset), under 1e-5 on the build before
    assert (plain.rollout.infer_logp - fast.rollout.infer_logp)[plain.rollout.mask].abs().max() < 1e-4
    assert engine._prefixes
    engine.update_weights(tiny_policy.named_parameters())
    assert not engine._prefixes


def test_observation_positions_get_no_gradient_and_change_nothing():
    g = torch.Generator().manual_seed(0)
    B, T = 3, 10
    mask = torch.rand(B, T, generator=g) > 0.4
    mask[:, 0] = True
    logp = (torch.randn(B, T, generator=g) - 1).requires_grad_()
    old, infer, adv, ret = (torch.randn(B, T, generator=g) for _ in range(4))
    values = torch.randn(B, T, generator=g).requires_grad_()
    ref = torch.randn(B, T, generator=g) - 1
    losses = {
        "ppo": lambda lp, o, i, a, v, r: L.ppo_policy_loss(
            lp,
            o - 1,
            a,
            mask,
            clip_low=0.2,
            clip_high=0.28,
            dual_clip=3.0,
            is_weights=L.icepop_weights(o - 1, i - 1, mask, 0.5, 2.0)[0],
        )[0],
        "dis": lambda lp, o, i, a, v, r: L.dis_policy_loss(lp, i - 1, a, mask)[0],
        "value": lambda lp, o, i, a, v, r: L.value_loss(v, o, r, mask, clip=0.2)[0],
        "kl": lambda lp, o, i, a, v, r: L.aggregate(L.kl_estimate(lp, ref, "k3"), mask),
    }

    def noise(x):
        return torch.where(mask, x, x + 5 * torch.randn(B, T, generator=g))

    for name, fn in losses.items():
        logp.grad = values.grad = None
        loss = fn(logp, old, infer, adv, values, ret)
        loss.backward()
        for t in (logp, values):
            if t.grad is not None:
                assert (t.grad[~mask] == 0).all(), name
        with torch.no_grad():  # anything at observation positions changes nothing
            assert fn(noise(logp), noise(old), noise(infer), noise(adv), noise(values), noise(ret)) == pytest.approx(
                loss.item(), abs=1e-6
            ), name
    # GAE with holes equals GAE over the row with the holes removed; rewards and values in the holes are ignored
    rewards, v = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    adv_h, ret_h = L.gae(rewards, v, mask, 1.0, 0.9)
    adv_n, _ = L.gae(noise(rewards), noise(v), mask, 1.0, 0.9)
    assert torch.equal(adv_h, adv_n)
    for r in range(B):
        m = mask[r]
        a, R = L.gae(rewards[r][m][None], v[r][m][None], torch.ones(1, int(m.sum()), dtype=torch.bool), 1.0, 0.9)
        torch.testing.assert_close(adv_h[r][m], a[0])
        torch.testing.assert_close(ret_h[r][m], R[0])


def test_outcome_reward_sits_on_the_last_model_token():
    mask = torch.tensor(
        [
            [True, True, False, False, True, False, False],  # ends in an observation (cols 5-6)
            [True, False, False, False, False, False, False],
            [False] * 7,
        ]
    )
    r = L.last_token_rewards(torch.tensor([1.0, 2.0, 3.0]), mask)
    assert torch.equal(r, torch.tensor([[0, 0, 0, 0, 1.0, 0, 0], [2.0, 0, 0, 0, 0, 0, 0], [0.0] * 7]))


def test_driver_keeps_engine_ids_and_matches_the_chat_template(monkeypatch):
    texts = ["zebra 1", "zebra  22", "zebra\n3"]
    engine = Scripted(texts)
    encoded = []
    real_call = type(TOK).__call__
    monkeypatch.setattr(
        type(TOK), "__call__", lambda self, text, *a, **k: encoded.append(text) or real_call(self, text, *a, **k)
    )
    ep = agent.run_episodes(
        engine,
        TOK,
        ThreeTurns,
        [{"prompt": "go"}],
        Sampling(max_new_tokens=8, stop_token_ids=(EOS,)),
        max_turns=5,
        context_len=256,
    )
    monkeypatch.undo()
    assert not any("zebra" in t for t in encoded)  # the driver never encodes model text
    ro = ep.rollout
    model_ids = ro.tokens[0][ro.mask[0]].tolist()
    engine_ids = [t for t in (TOK(x, add_special_tokens=False).input_ids + [EOS] for x in texts) for t in t]
    assert model_ids == engine_ids  # the engine's ids come back unchanged
    # the row is the chat template applied to the episode's messages (up to the template's closing newline)
    msgs = ep.messages[0]
    assert [m["content"] for m in msgs] == ["go", texts[0], "turn 1 noted", texts[1], "turn 2 noted", texts[2]]
    want = TOK(TOK.apply_chat_template(msgs, tokenize=False), add_special_tokens=False).input_ids
    assert ro.prompt_ids[0] + ro.tokens[0][ro.attend[0]].tolist() == want[:-1] and TOK.decode(want[-1:]) == "\n"
    # per-turn rewards sit on each turn's last model token (its stop token)
    on = ep.rewards[0] != 0
    assert torch.equal(on, ro.mask[0] & (ro.tokens[0] == EOS)) and ep.rewards[0][on].tolist() == pytest.approx(
        [0.1, 0.1, 1.0]
    )
    assert ep.finish == ["done"] and ep.turns == [3] and ro.finish_reasons == ["done"]


@pytest.mark.parametrize(
    "kw,finish,turns",
    [
        (dict(max_turns=2), "turns", 2),
        (dict(max_turns=5, context_len=60), "context", 1),
        (dict(max_turns=5, engine_finish="length"), "turn_length", 0),
    ],
)
def test_budgets_end_episodes_with_their_reason(kw, finish, turns):
    engine = Scripted(["abc"], finish=kw.pop("engine_finish", "stop"))
    ep = agent.run_episodes(
        engine,
        TOK,
        ThreeTurns,
        [{"prompt": "go"}] * 2,
        Sampling(max_new_tokens=8, stop_token_ids=(EOS,)),
        context_len=kw.pop("context_len", 256),
        **kw,
    )
    assert ep.finish == [finish] * 2 and ep.turns == [turns] * 2
    for p, s in engine.calls:  # no turn was started that would not fit in the context
        assert all(len(x) + s.max_new_tokens <= 256 for x in p)
    ctx = [len(p) + int(a.sum()) for p, a in zip(ep.rollout.prompt_ids, ep.rollout.attend)]
    if finish == "context":
        assert all(c + 8 > 60 for c in ctx) and all(c <= 60 for c in ctx)


def test_episode_seeds_do_not_depend_on_the_batch_split(tmp_path):
    model = build_tiny_model(str(tmp_path))
    engine = EmbeddedEngine(model, dtype="fp32")
    rows = [{"prompt": f"guess {lo}-{lo + 20}", "answer": str(lo + 7)} for lo in (1, 10, 30, 50)]
    s = Sampling(max_new_tokens=4, n=2, seed=11, stop_token_ids=(EOS,))
    whole = agent.run_episodes(engine, TOK, GuessEnv, rows, s, max_turns=3, context_len=256)
    a = agent.run_episodes(engine, TOK, GuessEnv, rows[:1], s, max_turns=3, context_len=256)
    b = agent.run_episodes(
        engine, TOK, GuessEnv, rows[1:], Sampling(**{**s.__dict__, "seed": 11 + 2}), max_turns=3, context_len=256
    )
    assert whole.messages == a.messages + b.messages
    assert len({json.dumps(m) for m in whole.messages}) > 1
    # Sampling.seeds: explicit per-row seeds equal the default seed + r, and their count is checked
    p = [chat.first_prompt_ids(TOK, "a"), chat.first_prompt_ids(TOK, "bc")]
    x = engine.generate(p, Sampling(max_new_tokens=6, n=2, seed=5))
    y = engine.generate(p, Sampling(max_new_tokens=6, n=2, seeds=(5, 6, 7, 8)))
    assert torch.equal(x.tokens, y.tokens) and not torch.equal(x.tokens[0], x.tokens[1])
    with pytest.raises(ValueError, match="3 seeds for 2 prompts x n=2 rows"):
        engine.generate(p, Sampling(max_new_tokens=6, n=2, seeds=(5, 6, 7)))


class Dice:
    """An environment with randomness of its own: each observation is a die roll from the seed reseed gave it."""

    def reseed(self, seed):
        import random

        self.rng, self.seed = random.Random(seed), seed

    def reset(self, row):
        return row["prompt"]

    def step(self, text):
        return f"rolled {self.rng.randint(1, 6)}", 0.0, False


def test_environment_reseed_follows_the_episode_not_the_batch_split():
    rows = [{"prompt": f"p{i}", "answer": "1"} for i in range(3)]
    s = Sampling(max_new_tokens=4, n=2, seed=7, stop_token_ids=(EOS,))

    def play(rows, s):
        return agent.run_episodes(Scripted(["a"]), TOK, Dice, rows, s, max_turns=4, context_len=256)

    whole = play(rows, s)
    a, b = play(rows[:1], s), play(rows[1:], Sampling(**{**s.__dict__, "seed": 7 + 2}))
    assert whole.messages == a.messages + b.messages  # episode e's rolls depend on seed + e only
    rolls = [tuple(m["content"] for m in msgs[2::2]) for msgs in whole.messages]
    assert len(set(rolls)) == len(rolls)  # six episodes, six different sequences of three rolls
    assert rolls[0] == tuple(
        f"rolled {r}"
        for r in (lambda g: [g.randint(1, 6) for _ in range(3)])(__import__("random").Random(7 * 1024 + 1023))
    )


def test_environment_output_is_checked():
    class Bad:
        def __init__(self, out):
            self.out = out

        def reset(self, row):
            return "go"

        def step(self, text):
            return self.out

    s = Sampling(max_new_tokens=4, stop_token_ids=(EOS,))
    for out, msg in [
        ((None, 1.0, False), "None only when done"),
        (("x", float("nan"), False), "finite numbers"),
        (("x", 1.0, 1), "done must be a bool"),
        ("x", "must return"),
    ]:
        with pytest.raises(RuntimeError, match=msg):
            agent.run_episodes(Scripted(["a"]), TOK, lambda o=out: Bad(o), [{}], s, max_turns=3, context_len=256)


def test_env_loader_names_the_problem(tmp_path):
    f = tmp_path / "envs.py"
    f.write_text("class NoStep:\n    def reset(self, row):\n        return 'x'\n\ndef fn():\n    pass\n")
    for spec, msg in [
        ("nonsense", "is not an environment"),
        (f"{tmp_path}/missing.py:E", "no such file"),
        (f"{f}:Nope", "has no class 'Nope'"),
        (f"{f}:fn", "it is a function"),
        (f"{f}:NoStep", "has no step method"),
    ]:
        with pytest.raises(ValueError, match=msg):
            agent.load_env(spec)
    assert (
        agent.load_env("examples/env_retry.py:RetryEnv").__name__ == "RetryEnv"
    )  # (multi-turn config refusals: test_refusals.py)


def test_compaction_rows_carry_the_episode_return():
    task = guess_task(n_train=100, n_test=10)
    rows = task.train.to_list()[:40]
    ep = agent.run_episodes(
        demo_engine(TOK),
        TOK,
        GuessEnv,
        rows,
        Sampling(max_new_tokens=8, seed=5),
        max_turns=6,
        context_len=256,
        compact_at=90,
    )
    ro = ep.rollout
    assert len(ep.episode) > len(rows)  # some episodes were compacted
    for k in range(len(rows)):
        mine = [b for b, e in enumerate(ep.episode) if e == k]
        for i, b in enumerate(mine):
            # every row's return-to-go from its first model token is the episode's return (guess pays only at the
            # end), not a share of it
            _, ret = L.gae(ep.rewards[b : b + 1], torch.zeros(1, ro.tokens.size(1)), ro.mask[b : b + 1], 1.0, 1.0)
            assert ret[0][ro.mask[b]][0].item() == pytest.approx(ep.returns[k].item())
            if i < len(mine) - 1:
                assert ro.finish_reasons[b] == "compact"
                text = TOK.decode(ro.prompt_ids[mine[i + 1]])
                lo, hi, _ = interval(TOK.decode(ro.prompt_ids[b] + ro.tokens[b][ro.attend[b]].tolist()))
                assert f"\nso far: {lo}-{hi}<|im_end|>" in text  # the next row starts from the task plus the summary
                # ... whose ids are the summary's sampled ids (its stop token dropped), spliced in before the template's tail
                summary = ro.tokens[b][ro.mask[b]].tolist()
                summary = summary[
                    len(summary) - summary[::-1].index(EOS, 1) :
                ]  # the last turn: after the previous stop token
                tail = len(TOK("<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False).input_ids)
                assert (
                    summary[-1] == EOS and ro.prompt_ids[mine[i + 1]][-tail - len(summary) + 1 : -tail] == summary[:-1]
                )


def test_minibatches_always_have_the_requested_count():
    for rows in (1, 3, 5, 9, 64):
        parts = minibatches(rows, 4, seed=0, index=0, epoch=0)
        assert len(parts) == 4 and sorted(torch.cat(parts).tolist()) == list(range(rows))


@pytest.mark.e2e
def test_own_environment_from_the_command_line(tmp_path):
    """examples/env_retry.py on the addition rows, PPO, one process: the run logs the multi-turn metrics."""
    out = train_cli(
        "--env",
        "examples/env_retry.py:RetryEnv",
        "--max-turns",
        "3",
        "--steps",
        "2",
        "--rollout-batch",
        "16",
        "--eval-size",
        "16",
        "--critic-pretrain",
        "0",
        "--out-dir",
        tmp_path,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    last = read_metrics(tmp_path)[-1]
    assert last["step"] == 2 and 1 <= last["rollout/turns_mean"] <= 3 and 0 < last["rollout/obs_token_frac"] < 1
    samples = [json.loads(line) for line in open(tmp_path / "samples" / "step_000002.jsonl")]
    assert samples[0]["completion"][0] == {"role": "user", "content": samples[0]["prompt"]}


UNEQUAL_ENV = '''
import os

class Unequal:
    """On rank 1 the first episode of each batch of 4 gets long observations, so it is compacted once: rank 1 holds 5
    rows, rank 0 4, and 5 rows do not chunk into 4 minibatches (torch.chunk gives 3 parts)."""
    count = 0

    def reset(self, row):
        self.t, self.long = 0, os.environ["RANK"] == "1" and Unequal.count % 4 == 0
        Unequal.count += 1
        return row["prompt"]

    def step(self, text):
        self.t += 1
        if self.t == 4:
            return None, float(text.strip().isdigit()), True
        return ("x" * 40 if self.long else "again"), 0.0, False
'''


@pytest.mark.torchrun
def test_dp2_with_unequal_rows_per_rank_does_not_hang(tmp_path):
    env = tmp_path / "unequal.py"
    env.write_text(UNEQUAL_ENV)
    out = torchrun(
        2,
        "train_ppo.py",
        "--env",
        f"{env}:Unequal",
        "--compact-at",
        "110",
        "--steps",
        "2",
        "--rollout-batch",
        "8",
        "--minibatches",
        "4",
        "--micro-batch",
        "2",
        "--eval-size",
        "8",
        "--critic-pretrain",
        "0",
        "--out-dir",
        tmp_path / "run",
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    rows = read_metrics(tmp_path / "run")[1:]
    assert len(rows) == 2 and max(r["rollout/rows_per_episode"] for r in rows) > 1  # compaction made extra rows
