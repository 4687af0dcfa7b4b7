"""`--task guess`: a multi-turn task the tiny model can learn. The prompt names a range, each model turn is a number, the
environment answers; reward 1 when the secret is found within the turn budget (--max-turns, default 6).

    user: guess 23-87          assistant: 55      user: <      assistant: 39      user: >      assistant: 47  -> reward 1

Observations: "<" the secret is below the guess, ">" above it, "?" the turn is not a number in [1, 99]; "=" is not
sent: a correct guess ends the episode. Ranges are 9 to 41 numbers wide, so bisection always finds the secret in 6
turns. The interval left is an exact summary of an episode, which makes compaction testable: asked for a summary
(SUMMARY_REQUEST), the policy answers with it ("41-60"), and the next row starts from "guess 23-87\nso far: 41-60".

This module is the environment and its rows; data/tasks.py's guess_task makes them a Task. The tiny model's warm-up
(data/tiny.py) imitates noisy bisection (`demo_engine` there: the midpoint of the interval left half of the time, a
uniform draw from it otherwise, and the exact interval when asked to summarise, read off the conversation by `interval`
here), trained on model tokens only, so RL starts from a policy that wins some of the time and has room to improve.
"""

from __future__ import annotations

import random
import re

LO, HI = 1, 99
MIN_WIDTH, MAX_WIDTH = 8, 40  # hi - lo
MAX_TURNS = 6
SUMMARY_REQUEST = "range?"
_MESSAGE = re.compile(r"<\|im_start\|>(user|assistant)\n(.*?)(?:<\|im_end\|>|$)", re.S)


class GuessEnv:
    """The secret is the row's answer. turn_cost: subtracted on every turn that does not find it (default 0)."""

    summary_request = SUMMARY_REQUEST
    turn_cost = 0.0

    def reseed(self, seed: int) -> None:
        """No randomness of its own (the secret is the row's): nothing to seed. Defined for --algo vine, whose
        continuations reseed their copies of the environment."""

    def reset(self, row: dict) -> str:
        self.secret = int(row["answer"])
        return row["prompt"]

    def step(self, text: str):
        t = text.strip()
        if not (t.isascii() and t.isdigit() and LO <= int(t) <= HI):
            return "?", -self.turn_cost, False
        if int(t) == self.secret:
            return None, 1.0, True
        return ("<" if self.secret < int(t) else ">"), -self.turn_cost, False


class GuessTools:
    """`guess` as a tool environment (TRL's environment_factory form, tools.ToolEpisode): the model calls guess(n),
    which answers "<", ">" or "="; the episode ends at a turn with no tool call (its answer), and get_reward() is 1
    once a call has found the secret. The same guesses give the same observations as GuessEnv, plus that last turn, so
    its turn budget is one more (MAX_TURNS + 1)."""

    def reset(self, **row) -> None:
        self.secret = int(row["answer"])
        self.found = False

    def guess(self, n: int) -> str:
        """Guess the secret number.

        Args:
            n: the guess, a whole number in the range the prompt names.
        """
        if not (isinstance(n, int) and not isinstance(n, bool) and LO <= n <= HI):
            return "?"
        self.found |= n == self.secret
        return "=" if n == self.secret else "<" if self.secret < n else ">"

    def get_reward(self) -> float:
        return float(self.found)


def guess_rows(seed: int = 0, n_train: int = 20000, n_test: int = 1000, test_ranges: float = 0.15) -> tuple[list, list]:
    """(train, test) rows (prompt "guess lo-hi", answer the secret); the test ranges are disjoint from the train ranges (a
    seeded test_ranges share of all ranges), the secret is uniform in the range."""
    rng = random.Random(seed)
    ranges = [(lo, lo + w) for w in range(MIN_WIDTH, MAX_WIDTH + 1) for lo in range(LO, HI - w + 1)]
    rng.shuffle(ranges)
    cut = int(len(ranges) * test_ranges)

    def rows(pool, n):
        return [(f"guess {lo}-{hi}", str(rng.randint(lo, hi))) for lo, hi in (rng.choice(pool) for _ in range(n))]

    # the test rows draw from rng first, then the train rows
    test = rows(ranges[:cut], n_test)
    train = rows(ranges[cut:], n_train)
    return train, test


def interval(conversation: str) -> tuple[int, int, bool]:
    """(lo, hi, asked for a summary) of the secret's interval left after a conversation in ChatML text."""
    msgs = [m for m in _MESSAGE.findall(conversation) if m[1]]  # not the open assistant header at the end
    first = msgs[0][1]
    lo, hi = map(int, re.findall(r"(\d+)-(\d+)", first)[-1])  # the range, or the summary after "so far: "
    for (_, guess), (_, obs) in zip(msgs[1::2], msgs[2::2]):
        g = int(guess) if guess.strip().isdigit() else None
        if g is not None and obs.startswith("<"):
            hi = min(hi, g - 1)
        elif g is not None and obs.startswith(">"):
            lo = max(lo, g + 1)
    return lo, hi, msgs[-1][1].rstrip().endswith(SUMMARY_REQUEST)
