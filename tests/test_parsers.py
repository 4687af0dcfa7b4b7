"""tools.parse_tool_calls on hostile model turns: whatever the text, a malformed call is an error string (never an
exception), every call has a name and a dict of arguments, the results agree with the former regex parsers (kept
below as the slow reference), and the time grows linearly with the turn's length."""

import json
import re
import time
from datetime import timedelta

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tools import MAX_DEPTH, PARSERS, ToolCall, parse_tool_calls, tool_env

SCHEMAS = [
    {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {"s": {"type": "string"}}}},
    }
]
# Per example, generous: a linear parse of the longest turn below takes a few ms; the former regexes took seconds.
DEADLINE = timedelta(milliseconds=200)
UNCLOSED = "a <tool_call> block is not closed with </tool_call>"


# ----------------------------------------------------------------------------- the former parsers, the reference

_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
_UNCLOSED = re.compile(r"<tool_call>(?!.*</tool_call>)", re.DOTALL)


def reference(text, parser, schemas=None):
    calls, errors = [], []
    if parser == "glm":
        text = text.replace("<|observation|>", "")
    for body in _BLOCK.findall(text):
        call = _ref_hermes(body) if parser == "hermes" else _ref_glm(body, schemas or [])
        if isinstance(call, ToolCall):
            calls.append(call)
        else:
            errors.append(call)
    rest = _BLOCK.sub("", text)
    if _UNCLOSED.search(rest):
        errors.append("a <tool_call> block is not closed with </tool_call>")
        rest = rest[: rest.index("<tool_call>")]
    return rest.strip(), calls, errors


def _ref_hermes(body):
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return f"the tool call is not valid JSON ({e.msg} at character {e.pos}): {body.strip()[:200]!r}"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return f'the tool call must be a JSON object with a "name" string: {body.strip()[:200]!r}'
    args = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return f"the tool call's arguments are a string that is not a JSON object: {args[:200]!r}"
    if not isinstance(args, dict):
        return f'the tool call\'s "arguments" must be an object, got {type(args).__name__}'
    return ToolCall(obj["name"], args)


def _ref_glm(body, schemas):
    name, _, rest = body.partition("<arg_key>")
    name = name.strip()
    if not name or any(c.isspace() for c in name):
        return f"the tool call has no function name before its arguments: {body.strip()[:200]!r}"
    rest = "<arg_key>" + rest if rest else ""
    pairs = _GLM_ARG.findall(rest)
    if _GLM_ARG.sub("", rest).strip():
        return f"the tool call's arguments are not <arg_key>k</arg_key><arg_value>v</arg_value> pairs: {body.strip()[:200]!r}"
    props = {}
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
        try:
            args[k] = json.loads(v)
        except json.JSONDecodeError:
            args[k] = v
    return ToolCall(name, args)


# ----------------------------------------------------------------------------- turns: random, adversarial, well-formed

MARKERS = ["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "<|observation|>"]
PIECES = MARKERS + ["<tool_", "call>", "{", "}", "[", "]", '"', ":", ",", "\\", "0", "7", "123", "-1e5", " ", "\n"]
PIECES += ['"name"', '"arguments"', '"f"', "f", "s", "null", "true", " " * 150, "a" * 150]  # past the 200 shown

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=8,
)
hermes_blocks = st.builds(
    lambda name, args, as_string: (
        "<tool_call>\n"
        + json.dumps({"name": name, "arguments": json.dumps(args) if as_string else args})
        + "\n</tool_call>"
    ),
    st.sampled_from(["f", "calculator", ""]) | st.text(max_size=4),
    st.dictionaries(st.sampled_from(["s", "x"]) | st.text(max_size=3), json_values, max_size=3),
    st.booleans(),
)
glm_values = st.text(max_size=4) | json_values.map(json.dumps) | st.sampled_from(PIECES)
glm_pairs = st.tuples(st.sampled_from(["s", "x", " s "]) | st.text(max_size=3), st.sampled_from(["", "\n", " x"]))
glm_blocks = st.builds(
    lambda name, pairs, end: (
        "<tool_call>"
        + name
        + "".join(f"<arg_key>{k}</arg_key>{gap}<arg_value>{v}</arg_value>\n" for (k, gap), v in pairs)
        + "</tool_call>"
        + end
    ),
    st.sampled_from(["f", " f\n", "g", "", "a b"]),
    st.lists(st.tuples(glm_pairs, glm_values), max_size=3),
    st.sampled_from(["", "<|observation|>"]),
)
adversarial = st.lists(st.sampled_from(PIECES) | st.text(max_size=3), max_size=40).map("".join)
turns = st.lists(adversarial | hermes_blocks | glm_blocks | st.text(max_size=20), max_size=5).map("".join)


def depth(value) -> int:  # nesting of lists and dicts, [] is 1: the test's values are shallow, recursion is fine
    if isinstance(value, dict):
        value = list(value.values())
    return 1 + max(map(depth, value), default=0) if isinstance(value, list) else 0


def check_shape(result):
    text, calls, errors = result
    assert isinstance(text, str) and isinstance(calls, list) and isinstance(errors, list)
    for call in calls:
        assert isinstance(call, ToolCall) and isinstance(call.name, str) and call.name, call
        assert isinstance(call.arguments, dict) and depth(call.arguments) <= MAX_DEPTH, call
    assert all(isinstance(e, str) and e for e in errors), errors


@settings(max_examples=1000, deadline=DEADLINE)
@given(text=turns, parser=st.sampled_from(PARSERS), schemas=st.sampled_from([None, SCHEMAS]))
@example(text="<tool_<tool_call>{}</tool_call>call> x <tool_call>", parser="hermes", schemas=None)
@example(
    text="<tool_call>f<arg_key>a</arg_key>b</arg_key> <arg_value>1</arg_value></tool_call>", parser="glm", schemas=None
)
def test_any_turn_parses_and_agrees_with_the_regex_parsers(text, parser, schemas):
    result = parse_tool_calls(text, parser, schemas)
    check_shape(result)
    try:
        old = reference(text, parser, schemas)
    except (RecursionError, ValueError):  # what the former parsers raised; the cases below cover it
        return
    if all(depth(c.arguments) <= MAX_DEPTH for c in old[1]):  # deeper: refused now (test_deep_arguments_are_refused)
        assert result == old


# ----------------------------------------------------------------------------- what json.loads raises on


def hermes_call(arguments: str, name: str = "f") -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {arguments}}}</tool_call>'


def glm_call(value: str) -> str:
    return f"<tool_call>f<arg_key>x</arg_key><arg_value>{value}</arg_value></tool_call>"


def nested(n: int) -> str:  # n lists inside each other
    return "[" * n + "]" * n


# what json.loads raises on: RecursionError (2,000 levels) and ValueError (5,000 digits, sys.get_int_max_str_digits)
UNREADABLE = {"deep": (nested(2000), "JSON nested too deeply"), "digits": ("1" * 5000, "cannot read (ValueError")}


@pytest.mark.parametrize("kind", sorted(UNREADABLE))
def test_hermes_json_that_json_loads_raises_on_is_an_error(kind):
    value, why = UNREADABLE[kind]
    arguments = f'{{"x": {value}}}'
    text, calls, errors = parse_tool_calls(f"before {hermes_call(arguments)} after", "hermes")
    assert (text, calls, len(errors)) == ("before  after", [], 1) and why in errors[0], errors
    # the arguments as a JSON string (some models write them so)
    _, calls, errors = parse_tool_calls(hermes_call(json.dumps(arguments)), "hermes")
    assert calls == [] and "a string that is not a JSON object" in errors[0], errors


@pytest.mark.parametrize("kind", sorted(UNREADABLE))
def test_glm_value_that_json_loads_raises_on_stays_text(kind):
    value, _ = UNREADABLE[kind]  # as any value that is not JSON: the text itself
    assert parse_tool_calls(glm_call(value) + "<|observation|>", "glm") == ("", [ToolCall("f", {"x": value})], [])


def test_deep_arguments_are_refused():
    # json.loads reads 100 levels, but code after the parser that recurses per level (copy.deepcopy of an
    # environment keeping them, json.dumps, repr) can fail on them: MAX_DEPTH bounds the arguments (the object is
    # level 1)
    deepest = {"x": json.loads(nested(MAX_DEPTH - 1))}
    assert parse_tool_calls(hermes_call(json.dumps(deepest)), "hermes") == ("", [ToolCall("f", deepest)], [])
    _, calls, errors = parse_tool_calls(hermes_call(json.dumps({"x": json.loads(nested(MAX_DEPTH))})), "hermes")
    assert calls == [] and errors == [
        f"the tool call's arguments nest lists and objects more than {MAX_DEPTH} levels deep"
    ]
    _, calls, errors = parse_tool_calls(hermes_call(json.dumps(json.dumps({"x": json.loads(nested(100))}))), "hermes")
    assert calls == [] and f"more than {MAX_DEPTH} levels" in errors[0]
    # glm: the value is one level inside the arguments object; deeper stays text
    assert parse_tool_calls(glm_call(nested(MAX_DEPTH - 1)), "glm")[1] == [ToolCall("f", deepest)]
    assert parse_tool_calls(glm_call(nested(MAX_DEPTH)), "glm")[1] == [ToolCall("f", {"x": nested(MAX_DEPTH)})]


class Echo:
    def reset(self, **row):
        return None

    def echo(self, x: list) -> str:
        """Echo the argument.

        Args:
            x: anything.
        """
        return repr(x)[:20]

    def get_reward(self) -> float:
        return 0.0


def test_a_tool_episode_answers_deep_arguments_with_an_error():
    # formerly: a RecursionError out of step (2,000 levels) that stops the run, or 100 levels handed to the tool
    play = tool_env(Echo, "hermes")()
    play.reset({"prompt": "go"})
    for n in (2000, 100):
        out, reward, done = play.step(hermes_call(f'{{"x": {nested(n)}}}', "echo"))
        assert (len(out), reward, done) == (1, 0.0, False) and out[0]["content"].startswith("error: the tool call"), out
    assert play.step(hermes_call('{"x": [[1]]}', "echo"))[0] == [{"role": "tool", "content": "[[1]]"}]


# ----------------------------------------------------------------------------- time linear in the turn's length

# Turns that made the regexes rescan to the end from every marker: openings without closings (_BLOCK, _UNCLOSED),
# <arg_key> without </arg_key> and keys without values inside a glm block (_GLM_ARG's lazy key).
QUADRATIC = {
    "openings": ("hermes", lambda n: "<tool_call>" * n),
    "keys": ("glm", lambda n: "<tool_call>f" + "<arg_key>" * n + "</tool_call>"),
    "keys without values": ("glm", lambda n: "<tool_call>f" + "<arg_key>k</arg_key>" * n + "</tool_call>"),
    "openings, glm": ("glm", lambda n: "x<|observation|><tool_call>" * n),
}


@settings(max_examples=30, deadline=DEADLINE)
@given(family=st.sampled_from(sorted(QUADRATIC)), n=st.integers(1, 10_000))
@example(family="openings", n=10_000)
@example(family="keys", n=10_000)
def test_long_hostile_turns_parse_within_the_deadline(family, n):
    parser, turn = QUADRATIC[family]
    result = parse_tool_calls("Thinking." + turn(n), parser)
    check_shape(result)
    if family.startswith("openings"):  # 10,000 openings: one error, the text from the first opening dropped
        answer = "Thinking.x" if family == "openings, glm" else "Thinking."
        assert result == (answer, [], [UNCLOSED])


def best_time(text: str, parser: str, best: float) -> float:
    """min(best, the seconds of CPU this thread spends parsing text): other processes on the machine take the CPU
    between our slices without counting here, where wall-clock time would charge them to the longer parse."""
    t = time.thread_time()
    parse_tool_calls(text, parser)
    return min(best, time.thread_time() - t)


def times(parser: str, turn) -> tuple[int, float, float]:
    """(n, the best of 5 parse times of turn(n), of turn(20 n)): n from 64 up, doubling, until one parse takes 2 ms
    or the 20x turn would pass 2**25 characters (32 MB), where the 1x parse takes about 1 ms. A longer string is fresh
    memory from the system at each copy (past glibc's largest heap block), whose page faults add a cost per character
    that the 1x turn does not pay."""
    n = 64
    while best_time(turn(n), parser, 1.0) < 0.002 and 20 * len(turn(2 * n)) <= 2**25:
        n *= 2
    small = turn(n)
    large = turn(20 * n)
    t1 = t20 = 1.0
    for _ in range(5):  # in turns: load that comes and goes slows both sizes
        t1 = best_time(small, parser, t1)
        t20 = best_time(large, parser, t20)
    return n, t1, t20


def test_parse_time_grows_linearly():
    """The parse time at 20x the length is under 60x the time at 1x: linear gives about 20x, quadratic 400x. It cannot
    flake on a loaded machine: the times are this thread's CPU time (time.thread_time), which other processes do not
    add to; the 1x size is grown until one parse takes 2 ms or the 20x turn 32 MB (1 ms and more is far above the
    clock's resolution and the call's overhead); the two sizes are timed in turns, and the best of 5 is kept, so
    what is left of a load (caches another process emptied) would have to slow every 20x run 3 times more than the
    fastest 1x run. The former regexes' quadratic work exceeds the bound 6 times over."""
    for family, (parser, turn) in QUADRATIC.items():
        n, t1, t20 = times(parser, turn)
        assert t20 < 60 * t1, f"{family}: {t20 * 1e3:.1f} ms at {20 * n} units against {t1 * 1e3:.2f} ms at {n}"
