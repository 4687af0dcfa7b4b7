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
rendered with and without the new user message, the suffix kept (`chat.observation_ids`). A training row is

    prompt (first user message + assistant header) | turn 1 | obs 1 | turn 2 | obs 2 | ... | turn k

with `Rollout.mask` True on model tokens (trained, with the engine's log-probs) and `Rollout.attend` True on model and
observation tokens (the trainer attends to observations and never trains on them). Each turn's reward sits on its
last model token. An episode ends when the environment says done ("done"), after --max-turns turns ("turns"), when a
turn hits --max-new-tokens without its stop token ("turn_length"), or when the next turn, or an observation, would not
fit in the context ("context"; an observation too long for the context left is not appended, nor encoded when its
length in characters already rules it out, and a warning names the environment, episode and turn).

The environment's code (its constructor, reseed, reset, critic_context and step) runs through data.rewards.call_user:
in a worker thread, each call limited to --user-timeout seconds; reset gets a copy of its row. A hang, an exception or a
sys.exit stops the run with an error naming the class, the method, the episode (its row's "where" column, or its
prompt) and the turn.

Context compaction (GLM-5.2): once a row's context would pass `compact_at` tokens, the next user message is the
observation plus the environment's `summary_request` (default SUMMARY_REQUEST); the model's answer (the summary) is
trained, that row ends ("compact"), and the episode continues in a new row whose prompt is the first user message plus
the summary (`chat.summary_prompt`: the summary's sampled ids are spliced in, not re-encoded). Every row of an episode
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

from chat import check_chat_template, first_prompt_ids, observation_ids, summary_prompt
from data.rewards import DEFAULT_USER_TIMEOUT, call_user, failure, import_target
from rollout import Rollout, Sampling
from tools import is_tool_env, tool_methods, tool_schemas

ENV_FORMS = "'path/to/file.py:Class' or 'package.module:Class'"
SUMMARY_REQUEST = "Summarise the progress so far in one line."
DEFAULT_MAX_TURNS = 8  # --max-turns 0 with --env
FINISH_REASONS = ("done", "turns", "turn_length", "context")  # of an episode; a compacted row's is "compact"
_CALLS_PER_EPISODE = 1024  # seed stride: engine calls (turns + summaries) one episode may make
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
            if method == "__init__":
                takes = "no arguments (one instance per episode)"
            else:
                takes = f"one argument ({method}({'row' if method == 'reset' else 'text'}))"
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


# ----------------------------------------------------------------------------- the driver


@dataclass
class _Row:
    """One training row while its episode plays: the prompt ids, then the response as it grows (the model's turns and
    the observations between them), with per response token its kind, log-prob and reward. Lists, not tensors: rows
    grow by a turn at a time and have different lengths until _to_episodes pads them (Rollout.from_ragged)."""

    prompt: list[int]  # the first prompt, or after a compaction the task's and the summary (chat.summary_prompt)
    tokens: list[int] = field(default_factory=list)  # the response: model and observation tokens, in order
    model: list[bool] = field(default_factory=list)  # per token of tokens: sampled by the model (trained)
    logp: list[float] = field(default_factory=list)  # per token: the engine's log-prob, 0.0 on observation tokens
    rewards: list[float] = field(default_factory=list)  # per token: each turn's reward on its last model token
    turns: int = 0  # environment turns played in this row (a summary is not one)
    finish: str = ""  # "compact" once a summary ends the row; the others take the episode's finish in _to_episodes

    def add(self, ids, logp=None, model=True):
        """Append `ids` to the response: a model turn (model=True) with the engine's log-probs `logp`, one per id, or
        an observation (model=False, logp None) whose tokens get log-prob 0.0, as they are attended and never
        trained. Every new token's reward is 0.0; the caller adds the turn's reward on the last one after the
        environment's step."""
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
    """One episode while it plays: its environment instance, its rows (one, or one more per compaction; the last is
    the one that grows), its conversation, and the counters run_episodes' steps read and advance."""

    k: int  # its index in the call: row k // n, sample k % n (a continuation: its Start's index)
    env: object  # the environment instance (one per episode; a continuation's is the Start's copy)
    first: str  # the first user message, which a compacted row's prompt repeats ("" for a continuation)
    where: str  # the episode and its row, for errors
    rows: list[_Row]
    messages: list[dict]  # the conversation as chat messages (Episodes.messages)
    seed: int  # engine call c draws from seed + c
    turns: int = 0  # environment turns played (a continuation starts at its Start's)
    calls: int = 0  # engine calls made: turns and summaries, the c of the next call's seed
    ret: float = 0.0  # the rewards collected so far
    finish: str = ""  # how it ended (FINISH_REASONS); "" while it plays
    summarising: bool = False  # the last observation asked for a summary: the next turn ends the row
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
    """The (observation, reward, done) that environment `env`'s step returned (`out`), checked and with the reward as a
    float. turn: the turn and episode, text: the model's turn, both for errors. Returns (obs, float(reward), done):
    obs a str or a non-empty list of chat messages ({"role": str, "content": str}), or None when done. A wrong
    return raises a RuntimeError that names the class, the turn and what it returned: left unchecked, it would fail
    later and far from its cause (in the chat template on a bad observation, or as a non-finite loss)."""
    name = type(env).__name__

    def short(x):
        return repr(x)[:200]

    def is_message(m):
        return isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)

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
    messages = isinstance(obs, list) and obs and all(is_message(m) for m in obs)
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
    c / this many tokens, a bound that rules out a huge observation without encoding it (a runaway environment's
    megabyte message would otherwise be encoded only to be dropped). Cached per tokenizer: the vocabulary is read
    once."""
    return max(map(len, tok.get_vocab()))


@dataclass(frozen=True)
class _Play:
    """What every step of run_episodes reads: the tokenizer, the environment (named for errors), the limits. Built
    once per call, so the steps take one argument for it instead of eight; frozen, as no step changes it."""

    tok: object
    name: str  # "environment <class>", for errors
    tools: list[dict] | None  # a tools.ToolEpisode class: the schemas of its tools
    timeout: float
    context_len: int
    max_new_tokens: int  # every turn gets sampling.max_new_tokens
    max_turns: int
    compact_at: int

    def user(self, method: str, fn, args: tuple, where: str):
        """fn(*args), a call of the environment's code, through data.rewards.call_user: in a worker thread under
        the --user-timeout limit (none for a tools.ToolEpisode, which limits each call of the class's code itself).
        method: the call's name after the class's ("()", ".reset", ".step"); where: the episode or turn; both for
        errors. Returns what fn returns; an exception, a sys.exit or a timeout becomes a RuntimeError naming the
        environment, the method and where (data.rewards.failure)."""
        try:  # a ToolEpisode limits each call of the class's code itself
            return call_user(fn, *args, timeout=self.timeout if self.tools is None else 0, what=f"{self.name}{method}")
        except Exception as e:
            raise RuntimeError(failure(f"{self.name}{method}", e, where)) from e

    def render(self, f, *args, where: str) -> list[int]:
        """f(tok, *args): the chat template on an environment's message (f: chat.first_prompt_ids or
        chat.observation_ids, args: the message and what f takes after it). Returns the ids f returns; a template
        that fails on the message (a role it does not know, content it cannot print) becomes a RuntimeError naming
        the environment and `where`, the episode or turn, instead of an error from inside Jinja."""
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
    """sampling.n episodes per task row of `rows`, each started at its first prompt (_start_episode), in order:
    episode e is row e // n, sample e % n. Episode e's c-th engine call draws from (sampling.seed + e) * 1024 + c,
    so its draws depend on its own index and not on the other episodes of the call (a batch split over ranks, whose
    sampling.seed is offset by their first episode, plays the same episodes). Returns the episodes."""
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
    """Episode k on task row `row`: its environment built (env_cls()), reseeded with seed + 1023 where it defines
    reseed (a seed none of the episode's engine calls uses), reset on a copy of the row (user code must not change the
    row that the episode's other samples and the reward read), its critic context taken, and its first prompt encoded
    (chat.first_prompt_ids, with the tools' schemas). where: the episode for errors; seed: its engine calls' base.
    Returns the episode with one row, its prompt. A reset that does not return a non-empty str, or a critic_context
    that does not return a str, is a RuntimeError; a first message that cannot fit in the context with a turn's
    max_new_tokens is a ValueError (not encoded when its length in characters already rules it out)."""
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
        size = f"{len(prompt)} tokens" if prompt else f"{len(first)} characters"
        raise ValueError(
            f"run_episodes: the first message of {play.name}.reset on {where} is {size}; with --max-new-tokens "
            f"{play.max_new_tokens} it does not fit in the context ({play.context_len})"
        )
    return _Episode(k, env, first, where, [_Row(prompt)], [{"role": "user", "content": first}], seed, hidden=hidden)


def _continue_from(play: _Play, starts: list[Start]) -> list[_Episode]:
    """VinePPO's continuations (vine.py): episode i plays on from starts[i], on its environment (a deep copy the
    caller made), reseeded with start.seed + 1023, from its row so far (prompt, tokens and model flags copied; the
    tokens before the state get log-prob and reward 0.0: vine.py reads the returns) with its turns and return so
    far, so its return is the whole episode's. Its engine calls draw from start.seed + c. Returns the episodes; an
    environment without reseed is a ValueError: a copy would replay the randomness of the episode it was copied from
    in every continuation, where each must draw its own."""
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
    """The episodes of `eps` that play another turn, in order. One still playing whose next turn (its row's prompt
    and response, plus max_new_tokens) would pass the context ends here, with finish "context": the engine must never
    be asked for more tokens than the context holds."""
    live = []
    for e in eps:
        row = e.rows[-1]
        if not e.finish and len(row.prompt) + len(row.tokens) + play.max_new_tokens > play.context_len:
            e.finish = "context"
        if not e.finish:
            live.append(e)
    return live


def _snapshot(play: _Play, live: list[_Episode], starts_of: dict[int, list[Start]]) -> None:
    """VinePPO (run_episodes(snapshots=True)): each live episode's state before its next turn appended to
    starts_of[e.k] as a Start: its environment deep-copied (the original plays on, so the copy must be taken before
    the step changes it), its row so far, its turns and return. starts_of maps an episode's k to its states in turn
    order. An environment that cannot be copied is a RuntimeError naming it and the turn."""
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
    """One turn of every episode in `live`: one engine generate call over them all (each row's prompt and response
    so far as the context, n=1, episode e's seed e.seed + e.calls), then each episode's sampled ids and log-probs
    (the response's masked tokens) taken in order (_take_turn). One call per turn, not per episode, so the engine
    batches the episodes; the per-episode seeds keep each one's draws independent of the others in the call."""
    seeds = tuple(e.seed + e.calls for e in live)
    ro = engine.generate([e.rows[-1].prompt + e.rows[-1].tokens for e in live], replace(sampling, n=1, seeds=seeds))
    for i, e in enumerate(live):
        m = ro.mask[i]
        _take_turn(play, e, ro.tokens[i][m].tolist(), ro.infer_logp[i][m].tolist(), ro.finish_reasons[i])


def _take_turn(play: _Play, e: _Episode, ids: list[int], logp: list[float], finish_reason: str) -> None:
    """Episode e's sampled turn (ids and the engine's log-probs logp, one per id) appended to its row; then the turn
    ends the episode ("turn_length") when finish_reason is not "stop" (cut at max_new_tokens, it has no stop token
    for the template to follow), or, decoded, it is the summary that ends the row (compaction: the episode goes on in
    a new row from chat.summary_prompt), or it is the text stepped in the environment: its reward goes on the turn's
    last token, and the episode ends ("done", "turns") or takes the observation (_add_observation). A tool turn is
    decoded with special tokens kept (the tool-call markup may be special tokens) and without its stop token."""
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
    out = play.user(".step", e.env.step, (text,), f"{turn} (model text {text!r})")
    obs, reward, done = _check_step(out, e.env, turn, text)
    row.rewards[-1] += reward
    row.turns += 1
    e.turns += 1
    e.ret += reward
    if done or e.turns == play.max_turns:
        e.finish = "done" if done else "turns"
        return
    _add_observation(play, e, obs, ids[-1], turn)


def _add_observation(play: _Play, e: _Episode, obs: str | list[dict], last_id: int, turn: str) -> None:
    """Observation `obs` (a str, or a tool turn's list of messages) appended to episode e's row after its turn, as
    the ids the chat template puts after the turn's stop token, last_id (chat.observation_ids: a stop token other
    than EOS, such as GLM's <|observation|>, is passed on as the text it stands for). Where the row would pass
    compact_at, the observation gets the environment's summary_request (default SUMMARY_REQUEST) and the next turn
    is the summary. An observation that does not fit in the context left ends the episode ("context") with a
    warning, once per environment (the rest show in rollout/finish_context_frac); it is not encoded when its length
    in characters already rules it out. turn: the turn and episode, for errors and the warning."""
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
    """The finished episodes `eps` as what run_episodes returns: their rows with a model token (a new row whose
    context ran out before a turn is dropped), padded into one Rollout, episode by episode; each row's finish set
    (a compacted row keeps "compact", the others take the episode's), and each row carrying its episode's return: the
    rewards of the episode's later rows are added on its last model token, so with gamma = 1 every token's
    return-to-go is the episode's, whichever row it is in. starts_of: the snapshots per episode k (None without
    snapshots); tool_env: fill Episodes.tool_stats from each environment's ToolEpisode.stats."""
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
