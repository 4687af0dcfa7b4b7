"""Tool calls in a model's own output format, and the built-in tools. Pure Python: no model, no engine.

    from tools import parse_tool_calls, calculator, python
    text, calls, errors = parse_tool_calls('<tool_call>\\n{"name": "calculator", "arguments": {"expression": "2+3"}}\\n</tool_call>', "hermes")
    calls[0].name, calls[0].arguments          # 'calculator', {'expression': '2+3'}
    calculator("2 + 3 * 4")                    # '14'
    python("print(sum(range(10)))")            # '45\\n'

Parsers, by model family (which parser fits which model):
- `hermes`: JSON {"name": ..., "arguments": {...}} inside <tool_call>...</tool_call>, one block per call: Qwen2.5,
  Qwen3 and other ChatML models whose chat template renders tools the Hermes way (NousResearch's format).
- `glm`: <tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value>...</tool_call> (GLM-4.5 and later, GLM-5): a
  call with no arguments is <tool_call>name</tool_call>; a turn that calls tools ends at <|observation|>, which the
  parser drops. An argument the tool's schema types as a string stays the raw text; any other is read as JSON when
  it parses (numbers, booleans, lists, objects) and kept as text otherwise.

Model text is never evaluated: JSON goes through json.loads, arithmetic through an AST walk over numbers and
operators (calculator). A malformed call is an error string in `errors` (for the caller to answer as the tool's output
and count), never an exception, whatever the text: JSON that json.loads cannot read (an integer of over 4,300 digits,
nesting near the recursion limit) is a malformed call, and so are hermes arguments that nest lists and objects more
than MAX_DEPTH (64) levels deep (a glm value nested that deep stays text). Parsing takes time linear in the turn's
length.
A call's text outside the tool blocks is `text` (the answer when there is no call).
"""

from __future__ import annotations

import ast
import json
import math
import operator
import re
import signal
import sys
import time
from dataclasses import dataclass, field

import sandbox

PARSERS = ("hermes", "glm")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict = field(default_factory=dict)


_OPEN = "<tool_call>"
_CLOSE = "</tool_call>"
_SPACE = re.compile(r"\s*")  # the whitespace str.strip removes (re's \s and str.isspace agree on every code point)
# The deepest nesting of lists and objects a call's arguments may have, the arguments object counting 1. A tool gets
# them, and deeper values reach code that recurses per level up to the recursion limit (1,000 frames): json.loads
# stops near 1,000 levels, copy.deepcopy near 500 (VinePPO copies environments, with what they kept of their calls),
# json.dumps, repr and a tool's own walk somewhere below. Real calls nest a few levels.
MAX_DEPTH = 64


def parse_tool_calls(
    text: str, parser: str, schemas: list[dict] | None = None
) -> tuple[str, list[ToolCall], list[str]]:
    """(the text outside tool blocks, stripped; the well-formed calls in order; one error message per malformed call)
    of one model turn. schemas: the tools' JSON schemas ({"type": "function", "function": {"name", "parameters"}}, as
    transformers.utils.get_json_schema writes them), which `glm` reads for the argument types.

    The blocks are the leftmost non-overlapping <tool_call>...</tool_call>, found with str.find: time linear in the
    turn's length, whatever the model wrote (a regex with a lazy .*? rescans to the end from every unclosed opening)."""
    if parser not in PARSERS:
        raise ValueError(f"unknown tool parser {parser!r}; expected one of {list(PARSERS)}")
    calls, errors = [], []
    if parser == "glm":
        text = text.replace("<|observation|>", "")
    outside = []
    pos = 0
    while (start := text.find(_OPEN, pos)) != -1 and (end := text.find(_CLOSE, start + len(_OPEN))) != -1:
        body = text[start + len(_OPEN) : end]
        call = _hermes(body) if parser == "hermes" else _glm(body, schemas or [])
        if isinstance(call, ToolCall):
            calls.append(call)
        else:
            errors.append(call)
        outside.append(text[pos:start])
        pos = end + len(_CLOSE)
    rest = "".join(outside) + text[pos:]
    # An opening after the last closing in the text outside the blocks (the two never overlap) is a call the turn did
    # not close; the text from the first opening on is dropped. Removing a block can join "<tool_" and "call>".
    if rest.rfind(_OPEN) > rest.rfind(_CLOSE):
        errors.append("a <tool_call> block is not closed with </tool_call>")
        rest = rest[: rest.index(_OPEN)]
    return rest.strip(), calls, errors


def _loads(s: str) -> tuple[object, str | None]:
    """(json.loads(s), None), or (None, what is wrong with s) when json raises: model text gets an answer, never an
    exception out of the parser. Besides JSONDecodeError json raises the ValueError of an integer longer than
    sys.get_int_max_str_digits (4,300 digits) and the RecursionError of nesting near the recursion limit."""
    try:
        return json.loads(s), None
    except json.JSONDecodeError as e:
        return None, f"not valid JSON ({e.msg} at character {e.pos})"
    except RecursionError:
        return None, "JSON nested too deeply to read"
    except Exception as e:  # the ValueError of a huge integer, or whatever else json raises
        return None, f"JSON that json.loads cannot read ({type(e).__name__}: {e})"


def _deeper(value, limit: int) -> bool:
    """Whether lists and dicts nest in `value` more than `limit` levels ([] is 1 level, [[]] 2), walked with a stack of
    its own: a recursive walk would fail on the values it is here to find."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth > limit:
                return True
            stack.extend((c, depth + 1) for c in (v.values() if isinstance(v, dict) else v))
    return False


def _hermes(body: str) -> ToolCall | str:
    obj, why = _loads(body)
    if why:
        return f"the tool call is {why}: {_shown(body)!r}"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return f'the tool call must be a JSON object with a "name" string: {_shown(body)!r}'
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        text = args
        args, why = _loads(text)
        if why:
            return f"the tool call's arguments are a string that is not a JSON object: {text[:200]!r}"
    if not isinstance(args, dict):
        return f'the tool call\'s "arguments" must be an object, got {type(args).__name__}'
    if _deeper(args, MAX_DEPTH):
        return f"the tool call's arguments nest lists and objects more than {MAX_DEPTH} levels deep"
    return ToolCall(obj["name"], args)


def _glm(body: str, schemas: list[dict]) -> ToolCall | str:
    first = body.find("<arg_key>")
    name = (body if first == -1 else body[:first]).strip()
    if not name or any(c.isspace() for c in name):
        return f"the tool call has no function name before its arguments: {_shown(body)!r}"
    pairs = []  # a lone <arg_key> at the end is no argument, as with the regex parser this one replaces
    if first != -1 and first + len("<arg_key>") < len(body):
        pairs = _glm_pairs(body, first)
    if pairs is None:
        return f"the tool call's arguments are not <arg_key>k</arg_key><arg_value>v</arg_value> pairs: {_shown(body)!r}"
    props = {}  # the called tool's parameter schemas, from the first schema of that name
    for s in schemas:
        if s.get("function", {}).get("name") == name:
            props = s["function"].get("parameters", {}).get("properties", {})
            break
    args = {}
    for k, v in pairs:
        k = k.strip()
        if props.get(k, {}).get("type") == "string":
            args[k] = v
            continue
        value, why = _loads(v)
        # not JSON, or nested past the bound (one level is the arguments object): the text itself
        args[k] = v if why or _deeper(value, MAX_DEPTH - 1) else value
    return ToolCall(name, args)


def _glm_pairs(body: str, pos: int) -> list[tuple[str, str]] | None:
    """The (key, value) pairs of a glm call's arguments (body[pos:], from its first <arg_key> on), as the regex
    <arg_key>(.*?)</arg_key>\\s*<arg_value>(.*?)</arg_value> finds them, or None when anything but whitespace lies
    around or between them. In one pass, no regex backtracking: a key runs to the first </arg_key> that whitespace
    and an <arg_value> follow, with an </arg_value> somewhere after (so a key may hold </arg_key>); its value runs to
    the first </arg_value>."""
    last_close = body.rfind("</arg_value>")
    pairs = []
    while pos < len(body):
        if not body.startswith("<arg_key>", pos):
            return None
        key_end = body.find("</arg_key>", pos + len("<arg_key>"))
        while key_end != -1:
            value_start = _SPACE.match(body, key_end + len("</arg_key>")).end()
            if body.startswith("<arg_value>", value_start) and last_close >= value_start + len("<arg_value>"):
                break
            key_end = body.find("</arg_key>", key_end + 1)
        if key_end == -1:
            return None
        value_start += len("<arg_value>")
        value_end = body.find("</arg_value>", value_start)
        pairs.append((body[pos + len("<arg_key>") : key_end], body[value_start:value_end]))
        pos = _SPACE.match(body, value_end + len("</arg_value>")).end()
    return pairs


def _shown(body: str) -> str:
    """body.strip()[:200], the start of a malformed call in its error message, without copying all of a long body."""
    start = _SPACE.match(body).end()
    head = body[start : start + 200]
    if _SPACE.match(body, start + 200).end() == len(body):  # only whitespace after the head: the end of the body
        head = head.rstrip()
    return head


# ----------------------------------------------------------------------------- tool environments

RESERVED = ("reset", "get_reward", "reseed", "critic_context")  # an environment's methods that are not tools


def tool_methods(env_cls) -> list[str]:
    """The tools of a TRL-style environment class (environment_factory): its public methods (its own in definition
    order, then inherited ones) other than reset, get_reward and the project's optional hooks."""
    names = [n for n in vars(env_cls) if not n.startswith("_") and n not in RESERVED and callable(getattr(env_cls, n))]
    bases = [
        n
        for b in env_cls.__mro__[1:-1]
        for n in vars(b)
        if not n.startswith("_") and n not in RESERVED and callable(getattr(env_cls, n))
    ]
    return names + [n for n in dict.fromkeys(bases) if n not in names]


def tool_schemas(env_cls, where: str = "the environment") -> list[dict]:
    """The JSON schemas of an environment's tools (transformers.utils.get_json_schema: type hints and a Google-style
    docstring with an Args: section, as TRL requires), in tool_methods order. A method that cannot be described is a
    ValueError naming it and what it lacks, before any work; so is a class with no tool."""
    from transformers.utils import get_json_schema

    names = tool_methods(env_cls)
    if not names:
        raise ValueError(
            f"{where}: {env_cls.__name__} has no public method besides {', '.join(RESERVED)}, so it offers no tool"
        )
    out = []
    for name in names:
        fn = getattr(env_cls, name)
        try:
            schema = get_json_schema(fn)
        except Exception as e:  # DocstringParsingException, TypeHintParsingException
            raise ValueError(
                f"{where}: {env_cls.__name__}.{name} cannot be a tool: {e}. A tool needs type hints on every argument "
                "and a docstring with a description and an Args: section"
            ) from None
        out.append(schema)  # get_json_schema leaves a method's self out
    return out


# besides EOS, the tokens a turn in that format ends at
STOP_TOKENS = {"hermes": (), "glm": ("<|observation|>", "<|user|>")}


@dataclass(frozen=True)
class ToolLimits:
    """Per-episode limits of a tool environment: --tool-calls-per-turn and --tool-timeout; the calls per episode and
    the answer's length keep these defaults (edit them here)."""

    calls_per_turn: int = 4  # calls beyond it in one turn are not run: each gets an error message
    calls_per_episode: int = 16  # calls beyond it are not run: each gets an error message (answer now)
    timeout: float = 10.0  # seconds per call: the python tool's wall clock; a tool of yours past it stops the run
    output_chars: int = 2000  # a tool's answer is cut beyond this


def is_tool_env(cls) -> bool:
    """A TRL-style tool environment (reset(**row), tools as methods, no step) rather than a text one (reset/step)."""
    return isinstance(cls, type) and callable(getattr(cls, "reset", None)) and not callable(getattr(cls, "step", None))


def text_env(task, parser: str, limits: ToolLimits, max_turns: int, source: str):
    """task.env (a data.tasks.Task's) in agent.py's form: a tool environment becomes its ToolEpisode class (tool_env:
    the --tool-parser format, the --tool-* limits, turns per episode, and the flag that named it, for errors), a text
    environment or None stays as it is."""
    if not is_tool_env(task.env):
        return task.env
    return tool_env(task.env, parser, limits, max_turns, task, source)


def stop_ids(tok, env_cls=None) -> tuple[int, ...]:
    """The ids a model turn stops at: EOS, and for a tool environment (a ToolEpisode class) the STOP_TOKENS of its
    format that the tokenizer has."""
    extra = STOP_TOKENS[env_cls.parser] if getattr(env_cls, "tools", None) is not None else ()
    vocab = tok.get_vocab() if extra else {}
    ids = dict.fromkeys(vocab[t] for t in extra if t in vocab and vocab[t] != tok.eos_token_id)
    return (tok.eos_token_id, *ids)


class ToolEpisode:
    """One episode of a TRL-style tool environment in agent.py's text form: reset(row) -> the first user message,
    step(model text) -> (tool messages or None, reward, done). tool_env builds the subclass for one class.

    reset(row) calls the class's reset(**row) (every column but "where"); a string it returns is appended to the
    row's prompt after a blank line. A model turn with tool calls gets one {"role": "tool"} message per call: the
    tool's answer (cut to limits.output_chars), or an error message for a malformed call, an unknown tool, arguments
    the method cannot take, an exception it raised, or a call over a limit. The episode ends at the first turn with no
    tool call, or at the turn budget (max_turns): that turn's text outside tool blocks is the answer. Its reward is
    the task's reward on the answer (score(answer, row); None or no reward function counts 0) plus get_reward() when
    the class defines it. stats holds the episode's calls, errors, tool seconds and both rewards (agent.episode_metrics
    logs them). A tool's Exception is the model's to see; a tool that hangs past limits.timeout, or exits, stops the
    run with an error naming it. Each call of the class's code runs through data.rewards.call_user under its own limit:
    `timeout` (--user-timeout) for the constructor, reset, get_reward, the task's reward and the hooks, limits.timeout
    for a tool; the driver calls this class's methods with no limit of their own."""

    cls: type
    parser: str
    limits: ToolLimits
    max_turns: int
    score = None  # (answer, row) -> float | None: the task's reward
    timeout: float  # --user-timeout
    tools: list[dict]  # the schemas the first prompt is rendered with
    names: list[str]  # the tools' names, in that order

    def __init__(self):
        self.env = self._user("()", self.cls)
        self.turns = 0
        self.ran = 0
        self.stats = {"calls": 0, "errors": 0, "seconds": 0.0, "task_reward": 0.0, "env_reward": 0.0, "turn_limit": 0}

    def reset(self, row: dict) -> str:
        if not isinstance(row["prompt"], str):
            raise ValueError(
                f"a tool environment's prompts must be text (the first user message), got {type(row['prompt']).__name__}"
            )
        self.row = row
        extra = self._user(".reset", lambda: self.env.reset(**{k: v for k, v in row.items() if k != "where"}))
        if extra is not None and not isinstance(extra, str):
            raise ValueError(
                f"{self.cls.__name__}.reset returned {extra!r}; it must return a str (appended to the prompt) or None"
            )
        return row["prompt"] + (f"\n\n{extra}" if extra else "")

    def step(self, text: str):
        self.turns += 1
        answer, calls, errors = parse_tool_calls(text, self.parser, self.tools)
        if (not calls and not errors) or self.turns >= self.max_turns:
            self.stats["turn_limit"] = int(bool(calls or errors))
            return None, self._final(answer), True
        # (ran, answer)
        out = [self._call(call, i) for i, call in enumerate(calls)] + [(False, f"error: {e}") for e in errors]
        self.stats["calls"] += len(out)
        self.stats["errors"] += sum(not ok for ok, _ in out)
        return [{"role": "tool", "content": r} for _, r in out], 0.0, False

    def _user(self, method: str, fn, *args, timeout: float | None = None, flag: str = "--user-timeout"):
        from data.rewards import call_user

        return call_user(
            fn,
            *args,
            timeout=self.timeout if timeout is None else timeout,
            what=f"environment {self.cls.__name__}{method}",
            flag=flag,
        )

    def _call(self, call: ToolCall, i: int) -> tuple[bool, str]:
        """(the call ran and returned, the tool message's text) of the turn's i-th call."""
        from data.rewards import UserCodeError

        lim = self.limits
        if i >= lim.calls_per_turn:
            return False, f"error: more than {lim.calls_per_turn} tool calls in one turn; this one was not run"
        if self.ran >= lim.calls_per_episode:
            return (
                False,
                f"error: the episode's {lim.calls_per_episode} tool calls are spent; answer without a tool call",
            )
        if call.name not in self.names:
            return False, f"error: there is no tool {call.name!r} (the tools: {', '.join(self.names)})"
        self.ran += 1
        t = time.perf_counter()
        fn = getattr(self.env, call.name)
        try:  # a lambda: an argument named like call_user's own (timeout) reaches the tool
            result = self._user(
                f".{call.name} (a tool)", lambda: fn(**call.arguments), timeout=lim.timeout, flag="--tool-timeout"
            )
        except (UserCodeError, sandbox.SandboxError):  # past the time limit, sys.exit, no sandbox: the run stops
            raise
        except Exception as e:  # arguments it cannot take (TypeError) included: the model sees it
            return False, self._cut(f"error: {type(e).__name__}: {e}")
        finally:
            self.stats["seconds"] += time.perf_counter() - t
        return True, self._cut(self._text(call.name, result))

    def _cut(self, r: str) -> str:
        n = self.limits.output_chars
        return r if len(r) <= n else r[:n] + f"... ({len(r) - n} more characters cut)"

    def _text(self, name, result) -> str:
        if isinstance(result, str):
            return result
        try:
            return json.dumps(result)
        except (TypeError, ValueError):
            raise RuntimeError(
                f"tool {self.cls.__name__}.{name} returned {type(result).__name__}; a tool must return a str "
                "(or a JSON-serialisable value)"
            ) from None

    def _final(self, answer: str) -> float:
        task = 0.0
        if self.score:
            task = self.score(answer, self.row) or 0.0  # score runs the reward under its own limit
        env = 0.0
        if callable(getattr(self.env, "get_reward", None)):
            env = self._user(".get_reward", self.env.get_reward)
        if not (isinstance(env, (int, float)) and not isinstance(env, bool) and math.isfinite(env)):
            raise RuntimeError(f"{self.cls.__name__}.get_reward returned {env!r}; it must return a finite number")
        self.stats.update(task_reward=float(task), env_reward=float(env))
        return float(task) + float(env)


def tool_env(
    cls, parser: str = "hermes", limits: ToolLimits = ToolLimits(), max_turns: int = 8, task=None, where: str = "--env"
) -> type:
    """The agent.py environment class (ToolEpisode) that plays TRL-style tool environment `cls` on `task` (a
    data.tasks.Task: its reward_fn scores the answers, its user_timeout limits the class's code): its tools' schemas
    checked, its optional reseed and critic_context passed through. A class with no get_reward on a task with no
    reward function would give every episode 0: a ValueError naming `where`."""
    from data.rewards import DEFAULT_USER_TIMEOUT, score as score_batch

    score = None
    if task is not None and task.reward_fn is not None:

        def score(answer: str, row: dict):  # the task's reward on one answer, as on a single-turn completion
            sc = score_batch(task, [answer], {k: [v] for k, v in row.items() if k != "where"})
            return sc.rewards[0].item() if sc.rewarded[0] else None

    if parser not in PARSERS:
        raise ValueError(f"--tool-parser {parser!r}: expected one of {list(PARSERS)}")
    schemas = tool_schemas(cls, where)
    if score is None and not callable(getattr(cls, "get_reward", None)):
        raise ValueError(
            f"{where}: {cls.__name__} has no get_reward() and the task has no reward function, so every episode "
            "would score 0: define get_reward(self) -> float, or use a task with a reward (--reward)"
        )
    attrs = {
        "cls": cls,
        "parser": parser,
        "limits": limits,
        "max_turns": max_turns,
        "score": staticmethod(score) if score else None,
        "timeout": task.user_timeout if task is not None else DEFAULT_USER_TIMEOUT,
        "tools": schemas,
        "names": [s["function"]["name"] for s in schemas],
        "__doc__": cls.__doc__,
    }

    def passed_on(hook):  # the ToolEpisode method that calls the class's hook through _user
        def method(self, *args):
            return self._user(f".{hook}", getattr(self.env, hook), *args)

        return method

    for hook in ("reseed", "critic_context"):
        if callable(getattr(cls, hook, None)):
            attrs[hook] = passed_on(hook)
    return type(cls.__name__, (ToolEpisode,), attrs)


# ----------------------------------------------------------------------------- built-in tools

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION = 200  # characters
MAX_POWER = 64  # the largest exponent calculator takes (2 ** 10 ** 9 would not finish)
MAX_BITS = 1024  # the largest intermediate integer, in bits (nested powers stay fast)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.

    Args:
        expression: the arithmetic expression, e.g. "12 * (3 + 4)".
    """
    if not isinstance(expression, str) or len(expression) > MAX_EXPRESSION:
        raise ValueError(f"calculator takes an expression of at most {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {e.msg}") from None
    value = _arith(tree.body)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("the result is not a finite number")
        return str(int(value)) if value.is_integer() and abs(value) < 2**53 else repr(value)
    return str(value)


def _arith(node):
    """The value of an arithmetic AST node: constants (int, float), the binary and unary operators above; anything
    else (names, calls, attributes, strings) is refused."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_arith(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _arith(node.left), _arith(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_POWER:
            raise ValueError(f"exponents above {MAX_POWER} are refused")
        try:
            value = _OPS[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        except OverflowError:
            raise ValueError("the result is too large") from None
        if isinstance(value, int) and value.bit_length() > MAX_BITS:
            raise ValueError(f"the result is too large (over {MAX_BITS} bits)")
        return value
    raise ValueError(f"only numbers and + - * / // % ** ( ) are allowed, not {type(node).__name__}")


@dataclass(frozen=True)
class PythonLimits(sandbox.Limits):
    """The python tool's limits (per call): sandbox.Limits (wall clock, CPU, memory and processes of the whole program,
    its tmpfs, open files, file size), the output, and the one way to run it without the sandbox.

    unsandboxed=True runs the program as a plain subprocess of the trainer, the way this tool did before it had a
    sandbox, where bwrap or a writable cgroup is missing. It keeps the per-process rlimits (CPU, address space, open
    files, file size), the wall clock, the empty environment, isolated mode and a fresh temporary working folder, and
    protects nothing else: the program runs as the trainer's user, reads and writes what that user can (the
    checkout, the run folder, the venv's site-packages, the home folder), reads the trainer's environment through
    /proc, uses the network, and a child that calls setsid outlives the call; memory and processes are bounded per
    process only, and the disk not at all. Only for code you trust."""

    output_chars: int = 2000  # stdout + stderr, cut beyond this
    unsandboxed: bool = False  # run without the sandbox: not a security boundary (see above)


def python(code: str, limits: PythonLimits = PythonLimits()) -> str:
    """Run a Python program and return what it printed (stdout, then stderr), cut at limits.output_chars.

    A security boundary (sandbox.py, bubblewrap): the program sees the system (/usr, /etc without its secrets) and
    this Python's base install read-only, no home folder, checkout, run folder or venv, its own PID namespace, no
    network, an empty environment, and a private tmpfs (64 MiB) as its working folder, the only place it can write.
    Memory (512 MiB) and processes (32) bound the whole program, with CPU time, open files and file size per process
    and a 5 s wall clock; every process it started is dead when the call returns, and output past the limit is never
    read (the program is stopped). It runs the base interpreter in isolated mode (python -I). Where the sandbox
    cannot run (no bwrap, no namespaces, no writable cgroup) it raises sandbox.SandboxError (a RuntimeError) naming
    what is missing, unless limits.unsandboxed (not a security boundary, see PythonLimits).

    Args:
        code: the Python source to run, e.g. "print(2 ** 10)".
    """
    if not isinstance(code, str):
        raise ValueError(f"python takes the source code as a string, got {type(code).__name__}")
    if limits.unsandboxed:
        argv, paths = [sys.executable, "-I"], []
    else:
        argv, paths = sandbox.interpreter()
    keep = 4 * limits.output_chars + 16  # bytes: enough for output_chars characters of UTF-8 in either stream
    r = sandbox.run(
        [*argv, "main.py"],
        {"main.py": code},
        limits,
        keep_bytes=keep,
        read_only=paths,
        sandboxed=not limits.unsandboxed,
    )
    if r.timed_out:
        raise ValueError(f"the program ran past the {limits.timeout:g} s time limit and was stopped")
    text = r.stdout.decode("utf-8", "replace") + r.stderr.decode("utf-8", "replace")
    if r.cut or len(text) > limits.output_chars:
        stopped = "; the program was stopped there" if r.returncode < 0 and r.cut else ""
        return text[: limits.output_chars] + f"\n(output cut at {limits.output_chars} characters{stopped})"
    if r.returncode < 0:
        text += f"\n(killed by signal {signal.Signals(-r.returncode).name}: a resource limit)"
    elif r.returncode:
        text += f"\n(exit code {r.returncode})"
    return text
