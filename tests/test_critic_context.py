"""--critic-context: a critic-only prefix before each row's prompt (value_model.context_ids, critic_batch). The critic's
values at the response positions equal a plain forward of prefix + prompt + response in every layout; the policy's
inputs, log-probs and losses are those of a --critic-context policy run; an environment's critic_context() string
reaches the critic only, on every row of its episode; and the option is refused where it cannot apply."""

import dataclasses
import json
import os

import pytest
import torch

import agent
import train_ppo
from checkpoint import check_resume
from conftest import small
from config import Config, check_critic_context, resolve
from data.guess import GuessEnv
from data.tasks import get_task, guess_task
from data.tiny import build_tokenizer, demo_engine
from forward import response_values
from rollout import Rollout, Sampling
from value_model import ANSWER_CONTEXT, build_critic, context_ids, critic_batch, critic_values

TOK = build_tokenizer()


class SecretGuess(GuessEnv):
    """guess, with its secret shown to the critic."""

    def critic_context(self):
        return f"secret {self.secret}\n"


class TaggedGuess(SecretGuess):
    """Also a per-episode tag (from its reseed), so a prompt's episodes show the critic different strings."""

    def reseed(self, seed):
        self.tag = seed % 97

    def critic_context(self):
        return f"secret {self.secret} tag {self.tag}\n"


def _rows(g, n: int = 2):
    """4 rows: 2 prompts (5 and 8 tokens) x n = 2 samples, responses of 6, 3, 4, 6 tokens, two rows with observation
    tokens (attended, not trained)."""
    prompts = [torch.randint(3, 100, (k,), generator=g).tolist() for k in (5, 8)]
    tokens = torch.randint(3, 100, (4, 6), generator=g)
    attend = torch.arange(6)[None] < torch.tensor([6, 3, 4, 6])[:, None]
    mask = attend.clone()
    mask[0, 2:4] = mask[3, 1] = False
    return Rollout(tokens, torch.zeros(4, 6), mask, [p for p in prompts for _ in range(n)], ["stop"] * 4, attend=attend)


def _plain_values(critic, ro: Rollout, prefixes) -> torch.Tensor:
    """[B, T] values, 0 off `attend`: one unpadded forward per row of prefix + prompt + its real response tokens, read
    before each response token (an independent implementation of critic_batch + response_values)."""
    attend = ro.mask if ro.attend is None else ro.attend
    out = torch.zeros(ro.tokens.shape)
    for b in range(len(ro.tokens)):
        head = list(prefixes[b]) + ro.prompt_ids[b]
        resp = ro.tokens[b][attend[b]].tolist()
        with torch.no_grad():
            v = critic_values(critic, torch.tensor([head + resp]))[0]
        out[b, : len(resp)] = v[len(head) - 1 : len(head) - 1 + len(resp)]
    return out


def test_critic_values_equal_a_plain_forward_in_every_layout(tiny_model_dir):
    """Padded rows with prefixes of different lengths (3 and 7 tokens, so the left padding differs), the shared layout
    (a group's rows share their prefix), and per-row prefixes inside a group (env: not shared) all give the values of
    one plain forward of [prefix + prompt + response] per row, at every attended response position."""
    critic = build_critic(tiny_model_dir, dtype=torch.float32)  # a random head: values vary with the input
    g = torch.Generator().manual_seed(0)
    ro = _rows(g)
    attend, rows = ro.attend, torch.arange(4)
    per_group = [[7, 8, 9]] * 2 + [[10, 11, 12, 13, 14, 15, 16]] * 2
    per_row = [[7], [8, 9], [10, 11, 12], [13, 14, 15, 16]]
    for prefixes, n, group in ((per_group, 1, 1), (per_group, 2, 2), (per_row, 2, 1)):
        ctb = critic_batch(ro, prefixes, TOK.pad_token_id, n)
        assert ctb.group == group
        with torch.no_grad():
            got = response_values(critic, ctb, rows)
        want = _plain_values(critic, ro, prefixes)
        torch.testing.assert_close(got[attend], want[attend], rtol=1e-5, atol=1e-5)
        assert want[attend].std() > 1e-3  # the comparison can fail: the values differ across positions
    # the prefix matters: without it the values differ
    assert not torch.allclose(_plain_values(critic, ro, [[]] * 4)[attend], want[attend], atol=1e-4)
    with pytest.raises(ValueError, match="3 prefixes for 4 rows"):
        critic_batch(ro, per_row[:3], 0)


def test_answer_prefix_is_the_rows_answer():
    task = get_task("addition")
    rows = task.train.select(range(3))
    ro = Rollout(
        torch.ones(6, 2, dtype=torch.long),
        torch.zeros(6, 2),
        torch.ones(6, 2, dtype=torch.bool),
        [[1]] * 6,
        ["stop"] * 6,
    )
    ids = context_ids("answer", TOK, rows, ro, 2)  # row b is task row b // 2
    assert [TOK.decode(i) for i in ids] == [f"Reference answer: {rows[b // 2]['answer']}\n" for b in range(6)]
    assert (
        ANSWER_CONTEXT.format("x") == "Reference answer: x\n"
    )  # bench/value_fit.py's text (issue 22's offline figures)


def test_env_string_reaches_the_critic_only_on_every_row_of_an_episode():
    """Guess episodes with compaction (several rows per episode): each row's critic prompt is its episode's
    critic_context() string, then the row's own prompt; the policy's batch holds the same prompts without it."""
    task = guess_task(n_train=100, n_test=10)
    rows = task.train.to_list()[:40]
    ep = agent.run_episodes(
        demo_engine(TOK),
        TOK,
        SecretGuess,
        rows,
        Sampling(max_new_tokens=8, seed=5),
        max_turns=6,
        context_len=256,
        compact_at=90,
    )
    assert ep.critic_context == [f"secret {r['answer']}\n" for r in rows]
    assert len(ep.episode) > len(rows)  # some episodes span several rows
    ro = ep.rollout
    ids = context_ids("env", TOK, rows, ep, 1)
    ctb, tb = critic_batch(ro, ids, TOK.pad_token_id), ro.to_batch(TOK.pad_token_id)
    for b, e in enumerate(ep.episode):
        prefix = TOK(f"secret {rows[e]['answer']}\n", add_special_tokens=False).input_ids
        assert ids[b] == prefix
        real = ctb.input_ids[b][ctb.attention_mask[b].bool()].tolist()
        assert real == prefix + ro.prompt_ids[b] + ro.tokens[b][ro.attend[b]].tolist()
        assert "secret" not in TOK.decode(tb.input_ids[b][tb.attention_mask[b].bool()])
    assert torch.equal(
        ctb.input_ids[:, ctb.response_start :], tb.input_ids[:, tb.response_start :]
    )  # the same response block
    plain = agent.run_episodes(
        demo_engine(TOK), TOK, GuessEnv, rows[:2], Sampling(max_new_tokens=8, seed=5), max_turns=6, context_len=256
    )
    assert plain.critic_context == [None, None]
    with pytest.raises(ValueError, match="critic_context"):
        context_ids("env", TOK, rows[:2], plain, 1)


def test_refusals(tmp_path):
    with pytest.raises(ValueError, match="--critic-context answer needs a critic: --algo grpo"):
        resolve(Config(algo="grpo", critic_context="answer"), 1)
    with pytest.raises(ValueError, match="--critic-context env needs a multi-turn task"):
        resolve(Config(critic_context="env"), 1)
    resolve(Config(task="guess", critic_context="env"), 1)  # guess is multi-turn: the method is checked with the task
    with pytest.raises(ValueError, match="GuessEnv' has no critic_context"):
        check_critic_context(Config(task="guess", critic_context="env"), guess_task(n_train=10, n_test=2))
    task = guess_task(n_train=10, n_test=2)
    task.env = SecretGuess
    check_critic_context(Config(task="guess", critic_context="env"), task)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": "" if i == 3 else "a"}) + "\n" for i in range(20)))
    task = get_task(str(data))
    check_critic_context(Config(task=str(data)), task)  # policy: answers are not needed
    with pytest.raises(ValueError, match="--critic-context answer: 1 train rows have no answer"):
        check_critic_context(Config(task=str(data), critic_context="answer"), task)
    # a resume may not change it: check_resume against a recorded run
    cfg = Config(out_dir=str(tmp_path / "run"))
    ckpt = tmp_path / "run" / "checkpoints" / "step_000001"
    os.makedirs(ckpt)
    (ckpt / "meta.json").write_text(json.dumps({"step": 1, "world_size": 1, "models": ["policy", "critic"]}))
    (tmp_path / "run" / "config.json").write_text(json.dumps({"config": dataclasses.asdict(cfg)}))
    defaults = dataclasses.asdict(Config())
    assert check_resume(str(ckpt), 1, options=dataclasses.asdict(cfg), defaults=defaults) == {}
    answer = dataclasses.asdict(dataclasses.replace(cfg, critic_context="answer"))
    with pytest.raises(ValueError, match="--critic-context 'policy' -> 'answer'"):
        check_resume(str(ckpt), 1, options=answer, defaults=defaults)


@pytest.mark.e2e
def test_answer_run_leaves_the_policy_untouched(tmp_path, monkeypatch):
    """Two samples per prompt (shared prefixes): a --critic-context answer run's first batch has the policy inputs and
    pi_old of a policy run (the same object as the critic's batch there); its critic batch is shared per group and
    holds each row's answer; and at every step the recomputed values equal a plain forward of the critic over
    [answer prefix + prompt + response]. The run trains 2 steps."""
    seen, rows = {}, []
    recompute, rollout_phase = train_ppo.recompute, train_ppo.rollout_phase

    def spy_rollout(*args):
        out = rollout_phase(*args)
        rows[:] = out[0]["answer"]  # the batch's task rows' answers (row b is task row b // 2)
        return out

    def spy(run, models, batch, m):
        old = recompute(run, models, batch, m)
        prefixes = [[]] * len(batch.tokens)  # policy: no prefix
        if run.cfg.critic_context == "answer":
            prefixes = [
                TOK(ANSWER_CONTEXT.format(rows[b // 2]), add_special_tokens=False).input_ids
                for b in range(len(batch.tokens))
            ]
        want = _plain_values(models.critic, batch.rollout, prefixes)
        torch.testing.assert_close(old.values[batch.rollout.mask], want[batch.rollout.mask], rtol=1e-5, atol=1e-5)
        seen.setdefault(run.cfg.critic_context, []).append((batch, old, want[batch.rollout.mask].std().item()))
        return old

    monkeypatch.setattr(train_ppo, "recompute", spy)
    monkeypatch.setattr(train_ppo, "rollout_phase", spy_rollout)
    base = dict(n_samples=2, rollout_batch=8, eval_size=4)
    train_ppo.main(small(tmp_path / "policy", steps=1, **base))
    hist = train_ppo.main(small(tmp_path / "answer", steps=2, critic_context="answer", **base))
    assert hist[-1]["step"] == 2 and hist[-1]["train/skipped_update"] == 0
    ((pb, pold, _),) = seen["policy"]
    ab, aold, _ = seen["answer"][0]
    assert pb.critic_inputs is pb.inputs  # policy: the critic's batch is the policy's, nothing added
    assert pb.inputs.group == 2 and ab.critic_inputs.group == 2 and ab.critic_inputs is not ab.inputs
    for x, y in zip(pb.inputs, ab.inputs):
        assert torch.equal(x, y) if torch.is_tensor(x) else x == y
    assert torch.equal(pold.logp, aold.logp) and torch.equal(pb.tokens, ab.tokens) and torch.equal(pb.mask, ab.mask)
    assert ab.critic_inputs.response_start > ab.inputs.response_start
    assert "Reference answer: " in TOK.decode(ab.critic_inputs.input_ids[0]) and "Reference answer" not in TOK.decode(
        ab.inputs.input_ids[0]
    )
    assert seen["answer"][1][2] > 0  # after one critic update the values vary: the plain-forward check had teeth


@pytest.mark.e2e
def test_env_run_shows_each_episode_its_string(tmp_path, monkeypatch, tiny_model_dir):
    """A PPO step on guess with --critic-context env and 2 samples per prompt whose episodes tell the critic different
    strings: the policy's batch shares each prompt, the critic's falls back to one row per sample; every critic row
    is its episode's string + prompt + response, the policy's rows never hold it, and the values equal a plain forward."""
    seen = []
    recompute = train_ppo.recompute

    def spy(run, models, batch, m):
        old = recompute(run, models, batch, m)
        ep, ro = batch.generated, batch.rollout
        prefixes = [TOK(ep.critic_context[e], add_special_tokens=False).input_ids for e in ep.episode]
        for b in range(len(ro.tokens)):
            real = batch.critic_inputs.input_ids[b][batch.critic_inputs.attention_mask[b].bool()].tolist()
            assert real == prefixes[b] + ro.prompt_ids[b] + ro.tokens[b][ro.attend[b]].tolist()
        assert "tag" not in TOK.decode(batch.inputs.input_ids.flatten())
        torch.testing.assert_close(
            old.values[ro.mask], _plain_values(models.critic, ro, prefixes)[ro.mask], rtol=1e-5, atol=1e-5
        )
        seen.append(batch)
        return old

    monkeypatch.setattr(train_ppo, "recompute", spy)
    env = f"{os.path.abspath(__file__)}:TaggedGuess"
    hist = train_ppo.main(
        small(
            tmp_path,
            model=tiny_model_dir,
            task="guess",
            env=env,
            critic_context="env",
            steps=1,
            n_samples=2,
            rollout_batch=8,
            eval_size=2,
            max_turns=2,
        )
    )
    assert hist[-1]["step"] == 1 and len(seen) == 1
    assert seen[0].inputs.group == 2 and seen[0].critic_inputs.group == 1
