"""The chat template as token ids: the prompts and observations of multi-turn rows, without encoding model text.

A multi-turn row (agent.run_episodes) is the engine's sampled ids with the environment's messages between them. Model
text is never decoded and encoded back (the ids could change), so every piece the driver adds comes from the
tokenizer's chat template:

- `first_prompt_ids`: the first user message (after the tools' schemas, where the template prints them) and the
  assistant header;
- `observation_ids`: what follows a model turn's stop token (the end of the assistant turn, the next message(s), the
  next assistant header), taken as a delta: the template rendered with and without the new message, with a
  placeholder for the model's turn;
- `summary_prompt`: a compacted episode's next row, the summary's own sampled ids spliced into the rendered template;
- `check_chat_template`: refuses a template under which these deltas would not be the rendered conversation (one
  that rewrites earlier assistant turns once a message follows them).
"""

from __future__ import annotations

SUMMARY_JOIN = "\nso far: "  # the new row's first user message: the task's, SUMMARY_JOIN, the summary
THINK_PROBE = "<think>\nprobe\n</think>\n\nanswer"  # an assistant turn as reasoning models write it
_SLOT = "\x00slot\x00"  # a placeholder content for chat-template renders
_CHECKED: set[tuple] = set()  # (chat template, tools) pairs check_chat_template has passed


def _render(tok, messages, generation_prompt: bool, tools: list[dict] | None = None) -> str:
    """The chat template's text for `messages` (with the assistant header after them where generation_prompt), the
    tools' schemas passed as the template's `tools`; not tokenized, so that renders can be compared as text."""
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
    if isinstance(message, str):
        following = [{"role": "user", "content": message}]
    else:
        following = list(message)
    before = _render(tok, base, False, tools)
    after = _render(tok, base + following, True, tools)
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
