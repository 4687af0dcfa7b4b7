"""Multi-turn rollouts: the environment interface, the driver that plays episodes on any engine, and context compaction.

An environment works in text. One instance per episode (the class is called with no arguments):

    class MyEnv:                                   # --env path/to/file.py:MyEnv  or  --env package.module:MyEnv
        def reset(self, row: dict) -> str:         # a task row (its columns: prompt, answer, ...) -> first user message
            ...
        def step(self, text: str) -> tuple[str | None, float, bool]:
            ...                                    # the model's turn -> (observation, reward, done); None only when done
        def reseed(self, seed: int) -> None:       # optional: seed the environment's own randomness (called before reset)
            ...
        def critic_context(self) -> str:           # optional: what --critic-context env shows the critic only (called
            ...                                    # once, right after reset): its hidden state, never the policy's input

A tool environment (TRL's environment_factory form: reset(**row), its typed public methods the tools, an optional
get_reward) is played through tools.ToolEpisode, which gives it this form: its observations are lists of
{"role": "tool"} messages, its class carries the tools' schemas (`tools`, rendered into the first prompt) and its
turns are decoded with special tokens kept (the tool-call markup), without the stop token. A skyrl-gym environment
(BaseTextEnv's init(prompt) and step(action) -> {observations, reward, done}) is played through `skyrl_env`, an
adapter to the text form: --env picks either adapter by the class's methods.

The driver (`run_episodes`) owns every token. It keeps the ids the engine sampled (model text is decoded for the
environment, never encoded back), and takes each observation's ids from the chat template as a delta: the template
rendered with and without the new user message, the suffix kept (`observation_ids`). A training row is

    prompt (first user message + assistant header) | turn 1 | obs 1 | turn 2 | obs 2 | ... | turn k

with `Rollout.mask` True on model tokens (trained, with the engine's log-probs) and `Rollout.attend` True on model and
observation tokens (the trainer attends to observations and never trains on them). Each turn's reward sits on its
last model token. An episode ends when the environment says done ("done"), after --max-turns turns ("turns"), when a
turn hits --max-new-tokens without its stop token ("turn_length"), or when the next turn, or an observation, would not
fit in the context ("context"; an observation too long for the context left is not appended, nor encoded when its
length in characters already rules it out, and a warning names the environment, episode and turn).

The environment's code (its constructor, reseed, reset, critic_context and step) runs through data.rewards.call_user:
in a worker thread, each call limited to --user-timeout seconds; reset gets a copy of its row. A hang, an exception or a sys.exit stops
the run with an error naming the class, the method, the episode (its row's "where" column, or its prompt) and the turn.

Context compaction (GLM-5.2): once a row's context would pass `compact_at` tokens, the next user message is the
observation plus the environment's `summary_request` (default SUMMARY_REQUEST); the model's answer (the summary) is
trained, that row ends ("compact"), and the episode continues in a new row whose prompt is the first user message plus
the summary (`summary_prompt`: the summary's sampled ids are spliced in, not re-encoded). Every row of an episode
carries the episode's return: the rewards of the later rows are added on the row's last model token, so with
gamma = 1 every token's return-to-go is the episode's (not divided by the number of rows).
"""

from __future__ import annotations

import copy
import functools
import inspect
import math
import numbers
import warnings
from dataclasses import dataclass, field, replace

import torch

from data.rewards import DEFAULT_USER_TIMEOUT, call_user, failure, import_target
from rollout import Rollout, Sampling
from tools import is_tool_env, tool_methods, tool_schemas

ENV_FORMS = "'path/to/file.py:Class' or 'package.module:Class'"
SUMMARY_REQUEST = "Summarise the progress so far in one line."
SUMMARY_JOIN = "\nso far: "  # the new row's first user message: the task's, SUMMARY_JOIN, the summary
DEFAULT_MAX_TURNS = 8  # --max-turns 0 with --env
FINISH_REASONS = ("done", "turns", "turn_length", "context")  # of an episode; a compacted row's is "compact"
_CALLS_PER_EPISODE = 1024  # seed stride: engine calls (turns + summaries) one episode may make
_SLOT = "\x00slot\x00"  # a placeholder content for chat-template renders
_CHECKED: set[tuple] = set()  # (chat template, tools) pairs check_chat_template has passed
_WARNED: set[str] = set()  # environments already warned about an observation too long for the context


def load_env(spec: str):
    """The environment class a --env value names ('path/to/file.py:Class' or 'package.module:Class'). Every
    problem, including a constructor that needs arguments or a reset or step that cannot take one, is a ValueError
    naming --env, before any work."""
    module, where, name = import_target(spec, "--env", "an environment", ENV_FORMS)
    cls = getattr(module, name, None)
    if not isinstance(cls, type):
        raise ValueError(
            f"--env {spec!r}: {where} has no class {name!r}"
            + ("" if cls is None else f" (it is a {type(cls).__name__})")
        )
    if is_skyrl_env(cls):  # skyrl-gym's BaseTextEnv form, played through its adapter
        return skyrl_env(cls)
    if not callable(getattr(cls, "reset", None)):
        raise ValueError(
            f"--env {spec!r}: {name} has no reset method (a text environment needs reset(row) -> str and "
            "step(text) -> (observation or None, reward, done); a tool environment reset(**row) and its tools as methods; "
            "a skyrl-gym one init(prompt) and step(action))"
        )
    if is_tool_env(cls) and not tool_methods(cls):
        raise ValueError(
            f"--env {spec!r}: {name} has no step method (a text environment needs step(text) -> (observation "
            "or None, reward, done)) and no public method to offer as a tool (a tool environment, docs/tools.md)"
        )
    if is_tool_env(cls):  # TRL's environment_factory form: its tools are checked here (tools.tool_schemas)
        tool_schemas(cls, f"--env {spec!r}")
        checks = (("__init__", cls, ()),)
    else:
        checks = (("__init__", cls, ()), ("reset", cls.reset, (None, {})), ("step", cls.step, (None, "")))
    for method, call, args in checks:
        if method != "__init__" and isinstance(inspect.getattr_static(cls, method), (staticmethod, classmethod)):
            args = args[1:]  # no instance to pass
        try:
            inspect.signature(call).bind(*args)
        except TypeError as e:
            takes = (
                "no arguments (one instance per episode)"
                if method == "__init__"
                else f"one argument ({method}({'row' if method == 'reset' else 'text'}))"
            )
            raise ValueError(f"--env {spec!r}: {name}.{method} must take {takes}: {e}") from None
        except ValueError:  # a builtin without a signature: nothing to check
            pass
    return cls


def is_skyrl_env(cls) -> bool:
    """skyrl-gym's text-environment form (skyrl_gym.envs.base_text_env.BaseTextEnv): init and step, no reset."""
    return (
        isinstance(cls, type)
        and all(callable(getattr(cls, m, None)) for m in ("init", "step"))
        and not callable(getattr(cls, "reset", None))
    )


def skyrl_env(cls) -> type:
    """The text environment that plays skyrl-gym environment class `cls` (no skyrl-gym import: the form is enough).
    reset(row) builds cls(env_config={}, extras=...), with the row's columns in extras, its answer as
    extras["reward_spec"]["ground_truth"] (skyrl-gym's dataset convention) and the row in extras["extra_info"], and
    returns the one user message init() returns; step(text) returns step()'s observations (chat messages, user or
    tool), reward and done. metadata is dropped; close() is called when the episode is done."""

    class SkyRL:
        def reset(self, row: dict) -> str:
            info = {k: v for k, v in row.items() if k not in ("prompt", "where")}
            self.env = cls(
                env_config={},
                extras={
                    **info,
                    "reward_spec": {"method": "rule", "ground_truth": row.get("answer")},
                    "extra_info": info,
                },
            )
            prompt, _ = self.env.init([{"role": "user", "content": row["prompt"]}])
            if not (isinstance(prompt, list) and len(prompt) == 1 and prompt[0].get("role") == "user"):
                raise ValueError(
                    f"{cls.__name__}.init returned {str(prompt)[:200]}; the adapter takes one user message (the first prompt)"
                )
            return prompt[0]["content"]

        def step(self, text: str):
            out = self.env.step(text)
            if out["done"]:
                self.env.close()
                return None, out["reward"], True
            return out["observations"], out["reward"], False

    SkyRL.__name__ = SkyRL.__qualname__ = cls.__name__
    return SkyRL


# ----------------------------------------------------------------------------- chat-template deltas


def _render(tok, messages, generation_prompt: bool, tools: list[dict] | None = None) -> str:
    return tok.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=False)


def observation_ids(
    tok, message: str | list[dict], stop: str | None = None, tools: list[dict] | None = None
) -> list[int]:
    """Token ids that follow a model turn's stop token: the end of the assistant turn (what the template writes after
    the stop token, e.g. ChatML's newline), the next message(s), and the next assistant header. Taken from the chat
    template as a delta, with a placeholder for the model's turn, so no model text is encoded. message: a user
    message, or a list of messages (a tool turn's {"role": "tool", "content": ...} results). stop: the text of the
    stop token the turn ended with (default EOS); where the template opens the next message with it (GLM's
    <|observation|>, which ends a turn that calls tools), that sampled token is the delta's start and is not repeated;
    any other stop token stands in for the template's EOS, which the delta then starts after.
    tools: the schemas the first prompt was rendered with (a template may print them)."""
    base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _SLOT}]
    before = _render(tok, base, False, tools)
    after = _render(
        tok, base + ([{"role": "user", "content": message}] if isinstance(message, str) else list(message)), True, tools
    )
    cut = before.index(_SLOT) + len(_SLOT)
    if not after.startswith(before[:cut]):
        raise ValueError(
            "observation_ids: the chat template renders earlier turns differently once a message follows "
            "them, so observation tokens cannot be taken as a delta"
        )
    rest = after[cut:]
    ends = [t for t in (stop, tok.eos_token) if t]  # another stop token stands in for EOS
    end = next((t for t in ends if rest.startswith(t)), None)
    if end is None:
        raise ValueError(
            f"observation_ids: the chat template does not end an assistant turn with {' or '.join(map(repr, ends))} "
            f"(it writes {rest[:20]!r}), the stop token the model's turn ended with"
        )
    return tok(rest[len(end) :], add_special_tokens=False).input_ids


THINK_PROBE = "<think>\nprobe\n</think>\n\nanswer"  # an assistant turn as reasoning models write it


def check_chat_template(tok, tools: list[dict] | None = None) -> None:
    """Refuse a chat template that rewrites earlier assistant turns once a message follows them (Qwen3's drops their
    <think> blocks): a multi-turn row would then not be the conversation the template renders. run_episodes calls it;
    a template is checked once per process (_CHECKED); a ValueError says what the template dropped."""
    key = (tok.chat_template, repr(tools))
    if key in _CHECKED:
        return
    base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": THINK_PROBE}]
    for later in ([{"role": "user", "content": "y"}], [{"role": "tool", "content": "y"}]):
        try:
            text = _render(tok, base + later, True, tools)
        except Exception:
            # a template without a tool role: a tool episode would fail at its first tool turn, named there
            continue
        if THINK_PROBE not in text:
            raise ValueError(
                f"the chat template rewrites an earlier assistant turn once a {later[0]['role']} message follows it "
                f"(an assistant turn {THINK_PROBE!r} does not survive): multi-turn rows could not be the rendered "
                "conversation. Use a template that keeps earlier turns verbatim"
            )
    _CHECKED.add(key)


def first_prompt_ids(tok, message: str, tools: list[dict] | None = None) -> list[int]:
    """The first prompt's ids: the user message (after the tools' schemas, where the template prints them) and the
    assistant header."""
    return tok(_render(tok, [{"role": "user", "content": message}], True, tools), add_special_tokens=False).input_ids


def summary_prompt(tok, first: str, summary_ids: list[int]) -> list[int]:
    """The prompt of a compacted episode's next row: the first user message, SUMMARY_JOIN and the summary's own
    sampled ids (without their stop token), spliced into the rendered template."""
    text = _render(tok, [{"role": "user", "content": first + SUMMARY_JOIN + _SLOT}], True)
    head, tail = text.split(_SLOT)

    def enc(s):
        return tok(s, add_special_tokens=False).input_ids

    return enc(head) + list(summary_ids) + enc(tail)


# ----------------------------------------------------------------------------- the driver


@dataclass
class _Row:
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    model: list[bool] = field(default_factory=list)
    logp: list[float] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    turns: int = 0
    finish: str = ""

    def add(self, ids, logp=None, model=True):
        self.tokens += ids
        self.model += [model] * len(ids)
        self.logp += logp if logp is not None else [0.0] * len(ids)
        self.rewards += [0.0] * len(ids)


@dataclass
class Start:
    """A state to play an episode on from (VinePPO's continuations, vine.py): the start of a model turn."""

    env: object  # the environment at the state: run_episodes(snapshots=True) deep-copies it; starts= plays it itself
    where: str  # the episode it comes from, for errors
    prompt: list[int]
    # the row's response so far, model and observation tokens; the state is response column len(tokens)
    tokens: list[int]
    model: list[bool]  # per token of tokens: a model token
    turns: int  # turns played before the state
    ret: float  # rewards collected before the state
    seed: int = 0  # starts=: the episode's c-th engine call draws from seed + c, and its env.reseed gets seed + 1023


@dataclass
class _Episode:
    k: int
    env: object
    first: str
    where: str  # the episode and its row, for errors
    rows: list[_Row]
    messages: list[dict]
    seed: int  # engine call c draws from seed + c
    turns: int = 0
    calls: int = 0
    ret: float = 0.0
    finish: str = ""
    summarising: bool = False
    hidden: str | None = None  # what env.critic_context() returned after reset


@dataclass
class Episodes:
    """What run_episodes returns: B training rows (one per row of an episode: several with compaction)."""

    rollout: Rollout
    """mask = model tokens, attend = model and observation tokens, infer_logp 0 on observations; finish_reasons per
    row: "compact" for a row that ended in a summary, else the episode's FINISH_REASONS."""
    rewards: torch.Tensor
    """[B, T] float32: each turn's reward on its last model token; a compacted row also carries the rewards of the
    episode's later rows on its last model token."""
    returns: torch.Tensor
    """[E] float32: the return (sum of rewards) of each episode; episode e is row e // n of the call, sample e % n."""
    episode: list[int]
    """Per row: its episode."""
    turns: list[int]
    """Per episode: environment turns played (summaries are not turns)."""
    finish: list[str]
    """Per episode: how it ended (FINISH_REASONS)."""
    messages: list[list[dict]]
    """Per episode: the conversation as chat messages (for samples files); a compaction shows as the summary request
    and the summary."""
    critic_context: list[str | None] = field(default_factory=list)
    """Per episode: what its environment's critic_context() returned right after reset (None: it has no such method);
    --critic-context env puts it before every row of the episode, in the critic's input only."""
    starts: list[list[Start]] = field(default_factory=list)
    """snapshots=True: per episode, the state at the start of each of its model turns (its env deep-copied there)."""
    tool_stats: list[dict] = field(default_factory=list)
    """A tool environment: per episode, its ToolEpisode.stats (calls, errors, seconds, task_reward, env_reward, turn_limit)."""


def _check_step(out, env, turn: str, text: str):
    name = type(env).__name__

    def short(x):
        return repr(x)[:200]

    if not (isinstance(out, tuple) and len(out) == 3):
        raise RuntimeError(
            f"environment {name}.step returned {short(out)} on {turn} (model text {text!r}); it must return "
            "(observation: str or None, reward: float, done: bool)"
        )
    obs, reward, done = out
    if not isinstance(done, bool):
        raise RuntimeError(f"environment {name}.step returned done={short(done)} on {turn}; done must be a bool")
    if not (isinstance(reward, numbers.Real) and not isinstance(reward, bool) and math.isfinite(reward)):
        raise RuntimeError(
            f"environment {name}.step returned reward {short(reward)} on {turn} (model text {text!r}); "
            "rewards must be finite numbers"
        )
    messages = (
        isinstance(obs, list)
        and obs
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in obs
        )
    )
    if not (isinstance(obs, str) or messages or (obs is None and done)):
        raise RuntimeError(
            f"environment {name}.step returned observation {short(obs)} with done={done} on {turn}; an "
            "observation must be a str or a non-empty list of chat messages ({'role': str, 'content': str}; "
            "None only when done)"
        )
    return obs, float(reward), done


@functools.cache
def _longest_token(tok) -> int:
    """Characters of the tokenizer's longest token (special tokens included): an observation of c characters is at least
    c / this many tokens, a bound that rules out a huge observation without encoding it."""
    return max(map(len, tok.get_vocab()))


@dataclass(frozen=True)
class _Play:
    """What every step of run_episodes reads: the tokenizer, the environment (named for errors), the limits."""

    tok: object
    name: str  # "environment <class>", for errors
    tools: list[dict] | None  # a tools.ToolEpisode class: the schemas of its tools
    timeout: float
    context_len: int
    max_new_tokens: int  # every turn gets sampling.max_new_tokens
    max_turns: int
    compact_at: int

    def user(self, method: str, fn, args: tuple, where: str):
        """One call of the environment's code, its failures named."""
        try:  # a ToolEpisode limits each call of the class's code itself
            return call_user(fn, *args, timeout=self.timeout if self.tools is None else 0, what=f"{self.name}{method}")
        except Exception as e:
            raise RuntimeError(failure(f"{self.name}{method}", e, where)) from e

    def render(self, f, *args, where: str) -> list[int]:
        """The chat template on an environment's message (f: first_prompt_ids or observation_ids)."""
        try:
            return f(self.tok, *args)
        except Exception as e:
            raise RuntimeError(f"the chat template failed on the message of {self.name} on {where}: {e!r}") from e


def run_episodes(
    engine,
    tok,
    env_cls,
    rows: list[dict],
    sampling: Sampling,
    *,
    max_turns: int,
    context_len: int,
    compact_at: int = 0,
    timeout: float = DEFAULT_USER_TIMEOUT,
    snapshots: bool = False,
    starts: list[Start] | None = None,
) -> Episodes:
    """Play sampling.n episodes per task row with `engine` (any rollout.Engine: one generate call per turn over the live
    episodes). Episode e (row e // n, sample e % n) makes its c-th engine call with seed
    (sampling.seed + e) * 1024 + c, so an episode's draws do not depend on the other episodes in the call, and a batch
    split over calls (data-parallel ranks) whose seeds are offset by their first episode gives the same episodes.
    Every turn gets sampling.max_new_tokens; a turn that would pass context_len is not started ("context"). The
    environment's constructor, reset and step each run under `timeout` seconds (data.rewards.call_user; 0 = no limit).
    An environment with randomness of its own defines reseed(seed): episode e calls it before reset with
    (sampling.seed + e) * 1024 + 1023 (a seed no engine call of the episode uses), so its draws are reproducible and
    independent of the batch's split, like the engine's. An environment's critic_context(), if defined, is called once
    right after reset (Episodes.critic_context).

    VinePPO (vine.py): snapshots=True records each episode's state at the start of every model turn (Episodes.starts,
    its environment deep-copied; not with compaction). starts= plays one episode from each Start instead of the rows:
    on its env (reseeded with start.seed + 1023), from its row so far, with its turns and return so far; the returns
    are whole episodes' (rewards before the state included)."""
    if not 1 <= max_turns < _CALLS_PER_EPISODE // 2:  # turns and summaries must stay within the seed stride
        raise ValueError(f"run_episodes: max_turns must be in [1, {_CALLS_PER_EPISODE // 2}), got {max_turns}")
    play = _Play(
        tok,
        name=f"environment {getattr(env_cls, '__name__', repr(env_cls))}",
        tools=getattr(env_cls, "tools", None),
        timeout=timeout,
        context_len=context_len,
        max_new_tokens=sampling.max_new_tokens,
        max_turns=max_turns,
        compact_at=compact_at,
    )
    if (snapshots or starts is not None) and compact_at:
        raise ValueError("run_episodes: snapshots and starts are not implemented with compaction (compact_at)")
    if play.tools is not None and compact_at:
        raise ValueError("run_episodes: compaction (compact_at) is not implemented for tool environments")
    check_chat_template(tok, play.tools)
    eps = _start_episodes(play, env_cls, rows, sampling) if starts is None else _continue_from(play, starts)
    starts_of: dict[int, list[Start]] = {}  # snapshots=True: per episode (its k), the state before each turn
    while True:
        live = _live_episodes(play, eps)
        if not live:
            break
        if snapshots:
            _snapshot(play, live, starts_of)
        _play_turn(play, engine, sampling, live)
    return _to_episodes(eps, starts_of if snapshots else None, tool_env=play.tools is not None)


def _start_episodes(play: _Play, env_cls, rows: list[dict], sampling: Sampling) -> list[_Episode]:
    """sampling.n episodes per task row, each at its first prompt; episode e's c-th call draws (seed + e) * 1024 + c."""
    eps = []
    for i, row in enumerate(rows):
        for j in range(sampling.n):
            origin = row.get("where") or f"prompt {str(row.get('prompt'))[:60]!r}"
            where = f"episode {len(eps)} (row {i}: {origin}; sample {j})"
            # + c < 1024: below 2^31, as (... + c) mod 2^31
            seed = (sampling.seed + len(eps)) * _CALLS_PER_EPISODE % 2**31
            eps.append(_start_episode(play, env_cls, row, len(eps), where, seed))
    return eps


def _start_episode(play: _Play, env_cls, row: dict, k: int, where: str, seed: int) -> _Episode:
    """Episode k on task row `row`: its environment built, reseeded (where it can be), reset on a copy of the row, its
    critic context taken, and its first prompt encoded; a first message that cannot fit in the context is an error."""
    env = play.user("()", env_cls, (), where)
    if callable(getattr(env, "reseed", None)):
        play.user(".reseed", env.reseed, (seed + _CALLS_PER_EPISODE - 1,), where)
    first = play.user(".reset", env.reset, (copy.deepcopy(row),), where)
    if not isinstance(first, str) or not first:
        raise RuntimeError(
            f"{play.name}.reset returned {first!r} on {where}; it must return the first user message (a non-empty str)"
        )
    hidden = None
    if callable(getattr(env, "critic_context", None)):
        hidden = play.user(".critic_context", env.critic_context, (), where)
    if hidden is not None and not isinstance(hidden, str):
        raise RuntimeError(f"{play.name}.critic_context returned {hidden!r} on {where}; it must return a str")
    room = play.context_len - play.max_new_tokens
    # a message this many characters long cannot fit in `room` tokens: not encoded
    if len(first) > room * _longest_token(play.tok):
        prompt = []
    else:
        prompt = play.render(first_prompt_ids, first, play.tools, where=where)
    if not prompt or len(prompt) > room:
        raise ValueError(
            f"run_episodes: the first message of {play.name}.reset on {where} is "
            f"{f'{len(prompt)} tokens' if prompt else f'{len(first)} characters'}; with --max-new-tokens "
            f"{play.max_new_tokens} it does not fit in the context ({play.context_len})"
        )
    return _Episode(k, env, first, where, [_Row(prompt)], [{"role": "user", "content": first}], seed, hidden=hidden)


def _continue_from(play: _Play, starts: list[Start]) -> list[_Episode]:
    """VinePPO's continuations: one episode from each Start, its environment reseeded with start.seed + 1023."""
    eps = []
    for i, st in enumerate(starts):
        where = f"a continuation (number {i}) of {st.where}"
        if not callable(getattr(st.env, "reseed", None)):
            raise ValueError(
                f"{play.name} has no reseed(seed): a continuation plays on a copy of the environment and must draw "
                "its own randomness afresh; define reseed (a no-op if it has no randomness of its own)"
            )
        play.user(".reseed", st.env.reseed, (st.seed + _CALLS_PER_EPISODE - 1,), where)
        row = _Row(list(st.prompt), list(st.tokens), list(st.model), [0.0] * len(st.tokens), [0.0] * len(st.tokens))
        eps.append(_Episode(i, st.env, "", where, [row], [], st.seed, st.turns, ret=st.ret))
    return eps


def _live_episodes(play: _Play, eps: list[_Episode]) -> list[_Episode]:
    """The episodes that play another turn; one whose next turn would pass the context ends here ("context")."""
    live = []
    for e in eps:
        row = e.rows[-1]
        if not e.finish and len(row.prompt) + len(row.tokens) + play.max_new_tokens > play.context_len:
            e.finish = "context"
        if not e.finish:
            live.append(e)
    return live


def _snapshot(play: _Play, live: list[_Episode], starts_of: dict[int, list[Start]]) -> None:
    """VinePPO: each live episode's state before its next turn (its environment deep-copied) onto starts_of[e.k]."""
    for e in live:
        r = e.rows[-1]
        try:
            env = copy.deepcopy(e.env)
        except Exception as err:
            raise RuntimeError(
                f"{play.name} cannot be copied (copy.deepcopy) on turn {e.turns + 1} of {e.where}, which "
                f"--algo vine needs to play continuations from the state: {err!r}"
            ) from err
        starts_of.setdefault(e.k, []).append(
            Start(env, e.where, list(r.prompt), list(r.tokens), list(r.model), e.turns, e.ret)
        )


def _play_turn(play: _Play, engine, sampling: Sampling, live: list[_Episode]) -> None:
    """One turn of every live episode: one engine call over them all, then each episode's turn taken (_take_turn)."""
    seeds = tuple(e.seed + e.calls for e in live)
    ro = engine.generate([e.rows[-1].prompt + e.rows[-1].tokens for e in live], replace(sampling, n=1, seeds=seeds))
    for i, e in enumerate(live):
        m = ro.mask[i]
        _take_turn(play, e, ro.tokens[i][m].tolist(), ro.infer_logp[i][m].tolist(), ro.finish_reasons[i])


def _take_turn(play: _Play, e: _Episode, ids: list[int], logp: list[float], finish_reason: str) -> None:
    """Episode e's sampled turn (its ids and the engine's log-probs): appended to its row, then either the summary
    that ends the row (compaction) or the text stepped in the environment, whose observation follows the turn."""
    row = e.rows[-1]
    row.add(ids, logp)
    e.calls += 1
    if finish_reason != "stop":
        e.finish = "turn_length"
        return
    if play.tools is None:
        text = play.tok.decode(ids, skip_special_tokens=True)
    else:
        # tool markup may be special tokens: kept, the stop token dropped
        text = play.tok.decode(ids[:-1])
    e.messages.append({"role": "assistant", "content": text})
    if e.summarising:  # this turn was the summary: the row ends, the episode goes on from the task + summary
        row.finish = "compact"
        e.summarising = False
        e.rows.append(_Row(summary_prompt(play.tok, e.first, ids[:-1])))
        return
    turn = f"turn {e.turns + 1} of {e.where}"
    obs, reward, done = _check_step(
        play.user(".step", e.env.step, (text,), f"{turn} (model text {text!r})"), e.env, turn, text
    )
    row.rewards[-1] += reward
    row.turns += 1
    e.turns += 1
    e.ret += reward
    if done or e.turns == play.max_turns:
        e.finish = "done" if done else "turns"
        return
    _add_observation(play, e, obs, ids[-1], turn)


def _add_observation(play: _Play, e: _Episode, obs: str | list[dict], last_id: int, turn: str) -> None:
    """The observation's ids appended to episode e's row after its turn (which ended with token last_id), with the
    summary request where the row would pass compact_at; an observation that does not fit ends the episode
    ("context") with a warning, once per environment."""
    tok = play.tok
    row = e.rows[-1]
    used = len(row.prompt) + len(row.tokens)
    size = len(obs) if isinstance(obs, str) else sum(len(m["content"]) for m in obs)
    stop = None if last_id == tok.eos_token_id else tok.convert_ids_to_tokens(last_id)
    # an observation this many characters long cannot fit in the context left: not encoded
    if size > (play.context_len - used) * _longest_token(tok):
        obs_ids = None
    else:
        obs_ids = play.render(observation_ids, obs, stop, play.tools, where=turn)
    if obs_ids is not None and play.compact_at and used + len(obs_ids) > play.compact_at:
        obs = f"{obs}\n\n{getattr(e.env, 'summary_request', SUMMARY_REQUEST)}"
        obs_ids = play.render(observation_ids, obs, where=turn)
        e.summarising = True
    # appended, it would make a row longer than the context
    if obs_ids is None or used + len(obs_ids) > play.context_len:
        if play.name not in _WARNED:  # once per environment: the rest show in rollout/finish_context_frac
            _WARNED.add(play.name)
            warnings.warn(
                f"{play.name}.step returned a {size:,}-character observation on {turn}, longer than the "
                f"{play.context_len - used} tokens of context left: the episode ends ('context'), as do later "
                "ones (rollout/finish_context_frac)"
            )
        e.finish = "context"
        e.summarising = False
        return
    e.messages += [{"role": "user", "content": obs}] if isinstance(obs, str) else copy.deepcopy(obs)
    row.add(obs_ids, model=False)


def _to_episodes(eps: list[_Episode], starts_of: dict[int, list[Start]] | None, tool_env: bool) -> Episodes:
    """The finished episodes as training rows (what run_episodes returns): each row's finish set, and every row
    carrying its episode's return (the rewards of the episode's later rows added on its last model token); per episode
    its snapshots (starts_of, where recorded) and tool statistics (tool_env)."""
    out = []  # (episode, row)
    for k, e in enumerate(eps):
        rs = [r for r in e.rows if any(r.model)]  # a new row with no turn (the context ran out) is not a row
        later = 0.0
        for r in reversed(rs):
            r.finish = r.finish or e.finish
            last = max(j for j, is_model in enumerate(r.model) if is_model)
            own = sum(r.rewards)
            # the rest of the episode's rewards: every row carries the episode's return
            r.rewards[last] += later
            later += own
        out += [(k, r) for r in rs]
    rows = [r for _, r in out]
    ro = Rollout.from_ragged(
        [r.tokens for r in rows],
        [r.prompt for r in rows],
        [r.finish for r in rows],
        infer_logp=[r.logp for r in rows],
        model=[r.model for r in rows],
    )
    rewards = torch.zeros(ro.tokens.shape)
    for b, r in enumerate(rows):
        rewards[b, : len(r.rewards)] = torch.tensor(r.rewards)
    return Episodes(
        ro,
        rewards,
        torch.tensor([e.ret for e in eps]),
        [k for k, _ in out],
        [e.turns for e in eps],
        [e.finish for e in eps],
        [e.messages for e in eps],
        [e.hidden for e in eps],
        [starts_of.get(e.k, []) for e in eps] if starts_of is not None else [],
        [dict(e.env.stats) for e in eps] if tool_env else [],
    )


def episode_metrics(ep: Episodes) -> dict[str, float]:
    """rollout/turns_mean, rollout/obs_token_frac (observation tokens / all response tokens), rollout/rows_per_episode
    and rollout/finish_<reason>_frac of each FINISH_REASON (0 when absent: every rank logs the same keys). A tool
    environment adds tool/calls_per_episode, tool/error_frac (of the calls), tool/use_frac (episodes with a call),
    tool/seconds (in tools, this batch), tool/task_reward and tool/env_reward (the two parts of the return, per
    episode) and tool/turn_limit_frac (episodes cut by the turn budget while calling tools)."""
    ro = ep.rollout
    E = len(ep.turns)
    out = {
        "rollout/turns_mean": sum(ep.turns) / E,
        "rollout/rows_per_episode": len(ep.episode) / E,
        "rollout/obs_token_frac": float((ro.attend & ~ro.mask).sum() / ro.attend.sum().clamp_min(1)),
    }
    out.update({f"rollout/finish_{k}_frac": sum(f == k for f in ep.finish) / E for k in FINISH_REASONS})
    st = ep.tool_stats
    if st:  # a tool environment

        def total(k):
            return sum(x[k] for x in st)

        out.update(
            {
                "tool/calls_per_episode": total("calls") / E,
                "tool/error_frac": total("errors") / max(total("calls"), 1),
                "tool/use_frac": sum(x["calls"] > 0 for x in st) / E,
                "tool/seconds": total("seconds"),
                "tool/task_reward": total("task_reward") / E,
                "tool/env_reward": total("env_reward") / E,
                "tool/turn_limit_frac": total("turn_limit") / E,
            }
        )
    return out
