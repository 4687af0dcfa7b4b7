"""tools.py: the hermes and glm tool-call parsers on hand-written model turns (well-formed, several calls, no call,
malformed: an error string, never an exception, never an eval), the calculator's AST walk, and the python tool's
isolation and limits."""

import time
import uuid

import pytest

from test_sandbox import marked, require_sandbox
from tools import PythonLimits, ToolCall, calculator, parse_tool_calls, python, tool_methods, tool_schemas

SCHEMAS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    },
    {
        "type": "function",
        "function": {"name": "guess", "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}}},
    },
]


def test_hermes_calls_text_and_errors():
    turn = (
        'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "guess", "arguments": "{\\"n\\": 7}"}\n</tool_call>'
    )
    text, calls, errors = parse_tool_calls(turn, "hermes")
    assert text == "Let me compute." and errors == []
    assert calls == [
        ToolCall("calculator", {"expression": "2+3"}),
        ToolCall("guess", {"n": 7}),
    ]  # string arguments decoded
    assert parse_tool_calls("The answer is 5.", "hermes") == ("The answer is 5.", [], [])
    assert parse_tool_calls('<tool_call>{"name": "noargs"}</tool_call>', "hermes")[1] == [ToolCall("noargs", {})]
    for bad, why in (
        ('<tool_call>{"name": calculator}</tool_call>', "not valid JSON"),
        ("<tool_call>[1, 2]</tool_call>", 'with a "name" string'),
        ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', '"arguments" must be an object'),
        ('<tool_call>{"name": "f", "arguments": "x("}</tool_call>', "not a JSON object"),
        ('ok <tool_call>{"name": "f"', "not closed"),
    ):
        text, calls, errors = parse_tool_calls(bad, "hermes")
        assert calls == [] and len(errors) == 1 and why in errors[0], (bad, errors)
    assert parse_tool_calls('ok <tool_call>{"name": "f"', "hermes")[0] == "ok"
    # a good call beside a bad one: both reported
    _, calls, errors = parse_tool_calls('<tool_call>{"name": "a"}</tool_call><tool_call>nope</tool_call>', "hermes")
    assert calls == [ToolCall("a")] and len(errors) == 1


def test_glm_calls_argument_types_and_observation_stop():
    turn = (
        "I will guess.<tool_call>guess\n<arg_key>n</arg_key>\n<arg_value>42</arg_value>\n</tool_call>"
        "<tool_call>calculator<arg_key>expression</arg_key><arg_value>12</arg_value></tool_call><|observation|>"
    )
    text, calls, errors = parse_tool_calls(turn, "glm", SCHEMAS)
    # the schema types n as an integer (JSON-decoded) and expression as a string (kept as text)
    assert (text, errors) == ("I will guess.", []) and calls == [
        ToolCall("guess", {"n": 42}),
        ToolCall("calculator", {"expression": "12"}),
    ]
    assert parse_tool_calls("<tool_call>now</tool_call>", "glm")[1] == [ToolCall("now", {})]  # no arguments
    assert parse_tool_calls("<tool_call>f<arg_key>x</arg_key><arg_value>[1, 2]</arg_value></tool_call>", "glm")[1] == [
        ToolCall("f", {"x": [1, 2]})
    ]
    assert parse_tool_calls(
        "<tool_call>f<arg_key>x</arg_key><arg_value>os.system('ls')</arg_value></tool_call>", "glm"
    )[1] == [ToolCall("f", {"x": "os.system('ls')"})]  # not JSON: the text itself, never evaluated
    for bad, why in (
        ("<tool_call><arg_key>x</arg_key><arg_value>1</arg_value></tool_call>", "no function name"),
        ("<tool_call>f<arg_key>x</arg_key>1</tool_call>", "not <arg_key>k</arg_key><arg_value>v</arg_value> pairs"),
    ):
        _, calls, errors = parse_tool_calls(bad, "glm")
        assert calls == [] and len(errors) == 1 and why in errors[0], errors
    with pytest.raises(ValueError, match="unknown tool parser 'xml'"):
        parse_tool_calls("", "xml")


def test_calculator():
    assert calculator("2 + 3 * 4") == "14" and calculator("(2 + 3) * 4") == "20" and calculator("-7 // 2") == "-4"
    assert (
        calculator("7 / 2") == "3.5"
        and calculator("6 / 3") == "2"
        and calculator("2 ** 10") == "1024"
        and calculator("17 % 5") == "2"
    )
    assert calculator("1.5 * 2") == "3" and calculator(" 0.1 + 0.2 ") == "0.30000000000000004"
    for bad, why in (
        ("__import__('os').system('ls')", "only numbers"),
        ("x + 1", "only numbers"),
        ("'a' * 3", "only numbers"),
        ("1 / 0", "division by zero"),
        ("2 ** 100", "exponents above 64"),
        ("(2 ** 64) ** 64 * 2 ** 64", "too large"),
        ("1 +", "not an arithmetic expression"),
        ("1" * 300, "at most 200 characters"),
        ("10.0 ** 65", "exponents above"),
    ):
        with pytest.raises(ValueError, match=why):
            calculator(bad)


def test_python_tool_runs_isolated_with_limits():
    require_sandbox()
    assert python("print(sum(range(10)))") == "45\n"
    env, cwd, isolated = python(
        "import os, sys; print(sorted(os.environ)); print(os.getcwd()); print(sys.flags.isolated)"
    ).splitlines()
    assert "PATH" not in env and "HOME" not in env and cwd == "/tmp" and isolated == "1"  # /tmp: the sandbox's tmpfs
    assert "ZeroDivisionError" in python("1 / 0") and python("1 / 0").endswith("(exit code 1)")
    assert "MemoryError" in python("x = bytearray(2 ** 31)")  # RLIMIT_AS, 512 MiB
    assert "OSError: [Errno 27] File too large" in python(
        "open('big', 'wb').write(b'0' * 2 ** 21)"
    )  # RLIMIT_FSIZE, 1 MiB
    out = python("print('a' * 5000)")
    assert out == "a" * 2000 + "\n(output cut at 2000 characters)"
    assert "Too many open files" in python("fs = [open('f%d' % i, 'w') for i in range(100)]")
    # the wall clock: every process goes, the program's own children too
    marker = f"icepop-tool-test-{uuid.uuid4().hex}"
    code = f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)', {marker!r}])\ntime.sleep(30)"
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="ran past the 1 s time limit"):
        python(code, PythonLimits(timeout=1))
    assert time.monotonic() - t0 < 10
    assert marked(marker) == []
    assert python("while True: pass", PythonLimits(timeout=20, cpu_seconds=1)).endswith(
        "(killed by signal SIGXCPU: a resource limit)"
    )


class Guess:
    """A TRL-style tool environment (environment_factory): reset(**row), typed public methods as tools, get_reward."""

    def reset(self, **row):
        self.secret = int(row["answer"])

    def guess(self, n: int) -> str:
        """Guess the secret number.

        Args:
            n: the number guessed.
        """
        return "higher" if n < self.secret else "lower" if n > self.secret else "found"

    def get_reward(self) -> float:
        return 1.0

    def _helper(self):
        pass


class MoreTools(Guess):
    def give_up(self) -> str:
        """Stop guessing."""
        return "gave up"


def test_tool_schemas_of_an_environment_class():
    assert tool_methods(Guess) == ["guess"] and tool_methods(MoreTools) == ["give_up", "guess"]
    (schema,) = tool_schemas(Guess)
    assert schema["function"]["name"] == "guess" and schema["function"]["description"] == "Guess the secret number."
    assert schema["function"]["parameters"] == {
        "type": "object",
        "properties": {"n": {"type": "integer", "description": "the number guessed."}},
        "required": ["n"],
    }
    assert [s["function"]["name"] for s in tool_schemas(MoreTools)] == ["give_up", "guess"]

    class Untyped(Guess):
        def look(self, where):
            """Look.

            Args:
                where: the place.
            """

    class Undocumented(Guess):
        def look(self, where: str) -> str:
            return where

    class NoTools:
        def reset(self, **row):
            pass

    for cls, why in (
        (Untyped, "Untyped.look cannot be a tool"),
        (Undocumented, "Undocumented.look cannot be a tool"),
        (NoTools, "offers no tool"),
    ):
        with pytest.raises(ValueError, match=why):
            tool_schemas(cls, "--env x.py:C")
