"""`--task calc`: arithmetic the tiny model can do reliably only with a tool. The prompt is a product of two 3-digit
numbers; the model may call the calculator tool (a tool environment, TRL's environment_factory form, played by
tools.ToolEpisode with the hermes parser) and then answer; the reward is exact match of the answer.

    user: 417*382    assistant: <tool_call>{"name": "calculator", "arguments": {"expression": "417*382"}}</tool_call>
    tool: 159294     assistant: 159294   -> reward 1          (or: assistant: 158114  -> reward 0, no call)

A 1M-parameter model cannot multiply 3-digit numbers, but it can copy: the call copies the prompt, the answer copies
the tool's. The warm-up (data/tiny.py's calc_warmup) starts from the addition model and imitates `demo_move`: first
demonstrations that always call the calculator, which teach the copy, then ones that call it in P_TOOL of episodes and
otherwise write the product straight away (a computation it does not learn). So RL starts from a policy that uses the
tool some of the time (about a quarter of its sampled episodes) and copies well when it does, and raising that rate is
the way to raise its success. Train and test rows use disjoint pairs of factors.
"""

from __future__ import annotations

import random
import re

import tools

LO, HI = 100, 999  # the factors
P_TOOL = 0.3  # the demonstrations' share of episodes that call the calculator
MAX_TURNS = 3  # a call, the answer, and one turn of slack
_MESSAGE = re.compile(r"<\|im_start\|>(\w+)\n(.*?)(?:<\|im_end\|>|$)", re.S)


class CalcTools:
    """The calculator as a tool (tools.calculator: an AST walk over numbers and operators, never eval)."""

    def reset(self, **row) -> None:
        return None

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.

        Args:
            expression: the arithmetic expression, e.g. "12 * (3 + 4)".
        """
        return tools.calculator(expression)


def calc_rows(seed: int = 0, n_train: int = 20000, n_test: int = 1000) -> tuple[list, list]:
    """(train, test) rows (prompt "a*b", answer the product); no (a, b) pair is in both."""
    rng = random.Random(seed)
    pairs = set()
    while len(pairs) < n_train + n_test:
        pairs.add((rng.randint(LO, HI), rng.randint(LO, HI)))
    pairs = sorted(pairs)
    rng.shuffle(pairs)
    rows = [(f"{a}*{b}", str(a * b)) for a, b in pairs]
    return rows[n_test:], rows[:n_test]


def demo_move(conversation: str, rng: random.Random, p_tool: float = P_TOOL) -> str:
    """The warm-up's demonstrator (data/tiny.py's demo_engine), on the conversation in ChatML text: after a tool's
    answer, that answer; on the first turn, with probability p_tool the calculator call on the prompt, else the product."""
    msgs = [m for m in _MESSAGE.findall(conversation) if m[1]]
    if msgs[-1][0] == "tool":
        return msgs[-1][1]
    expression = msgs[0][1]
    if rng.random() < p_tool:
        return f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}</tool_call>'
    return tools.calculator(expression)
