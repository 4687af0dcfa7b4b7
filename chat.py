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

The environment's and the tools' text is encoded as text: a special-token string inside it (ChatML's
`<|im_end|>\n<|im_start|>system`, GLM's `<|observation|>` or `<|user|>`) never becomes a special id, so a tool's
output, a page it fetched or a reset text cannot forge a turn or a system message. The template is rendered with a
unique placeholder as each such message's content (`_layout`), and checked to print the content as it is: the render
with the real contents must equal the placeholder render filled in. A template that trims the whitespace at a
content's ends (Llama 3's, Gemma's) is followed, the text encoded as printed; one that rewrites a content or renders
differently on it is refused with a ValueError. Then (`_encode`) the template text is encoded as before, its own
special tokens special, and each text by one rule: a text that holds no special-token string (tok.all_special_tokens
and the added tokens marked special), nor forms one with the template text beside it, is encoded together with its
surroundings, so ordinary text gets exactly the ids of the whole render, as before this rule (encoding a text on its
own would change the tokens at its edges on a tokenizer that merges across them, e.g. Qwen2's "\n\n" after a tool
result ending in "\n"); a text that holds one is encoded on its own with split_special_tokens=True, the template text
on either side on its own, so the ids at its edges may differ from a whole-text encoding (they decode to the same
text). Limits: added tokens not marked special (Qwen2.5's `<tool_response>`) are still their own ids inside a text, as
Hugging Face tokenizers always match them; the tools' schemas come from the environment's code, not from its output,
and are template text.
"""

from __future__ import annotations

import re

SUMMARY_JOIN = "\nso far: "  # the new row's first user message: the task's, SUMMARY_JOIN, the summary
THINK_PROBE = "<think>\nprobe\n</think>\n\nanswer"  # an assistant turn as reasoning models write it
_SLOT = "\x00slot\x00"  # the model's turn in observation_ids' renders (never encoded)
_TEXT = "\x00text {}\x00"  # the i-th environment text's placeholder in a render
_TEXT_RE = re.compile("\x00text (\\d+)\x00")
_CHECKED: set[tuple] = set()  # (chat template, tools) pairs check_chat_template has passed


def _render(tok, messages, generation_prompt: bool, tools: list[dict] | None = None) -> str:
    """The chat template's text for `messages` (with the assistant header after them where generation_prompt), the
    tools' schemas passed as the template's `tools`; not tokenized, so that renders can be compared as text."""
    return tok.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=False)


def _fill(text: str, texts: list[str]) -> str:
    """text with each placeholder _TEXT.format(i) replaced by texts[i]."""
    return _TEXT_RE.sub(lambda m: texts[int(m.group(1))], text)


def _layout(tok, messages, texts: list[str], generation_prompt: bool, tools: list[dict] | None = None):
    """The render of `messages`, whose contents hold placeholders _TEXT.format(i) for the environment's texts[i],
    and the texts as the template prints them: verbatim, or with the whitespace at their message's ends trimmed (as
    Llama 3's and Gemma's templates do). Checked: the render with the real contents equals the placeholder render
    filled in, so the template neither rewrites the texts nor renders differently on them. Returns (render with
    placeholders, the printed texts); a template that alters a text otherwise is a ValueError naming the message."""
    shown = _render(tok, messages, generation_prompt, tools)
    real_messages = [{**m, "content": _fill(m["content"], texts)} for m in messages]
    real = _render(tok, real_messages, generation_prompt, tools)
    trimmed = list(texts)
    for m in messages:
        for k in map(int, _TEXT_RE.findall(m["content"])):
            if m["content"].startswith(_TEXT.format(k)):
                trimmed[k] = trimmed[k].lstrip()
            if m["content"].endswith(_TEXT.format(k)):
                trimmed[k] = trimmed[k].rstrip()
    for printed in (texts, trimmed):
        if real == _fill(shown, printed):
            return shown, printed
    m = next((m for m in real_messages if m["content"] not in real), real_messages[-1])
    raise ValueError(
        f"the chat template does not print a {m['role']} message's content as it is (content "
        f"{m['content'][:40]!r}): it rewrites it or renders differently on it (beyond trimming the whitespace at its "
        "ends), so the environment's text cannot be encoded as text"
    )


def _specials(tok) -> re.Pattern:
    """A pattern matching tok's special-token strings (all_special_tokens and the added tokens marked special),
    longest first; one that never matches for a tokenizer without any."""
    names = set(tok.all_special_tokens) | {t.content for t in tok.added_tokens_decoder.values() if t.special}
    return re.compile("|".join(map(re.escape, sorted(names, key=len, reverse=True))) or "(?!)")


def _as_text(tok, text: str) -> list[int]:
    """text's ids with its special-token strings encoded as text (split_special_tokens); a ValueError where the
    tokenizer still gives a special id (one that ignores the option)."""
    ids = tok(text, add_special_tokens=False, split_special_tokens=True).input_ids
    if set(ids) & set(tok.all_special_ids):
        raise ValueError(
            f"the tokenizer ({type(tok).__name__}) ignores split_special_tokens=True: the environment's text "
            f"{text[:40]!r} would become special tokens"
        )
    return ids


def _encode(tok, shown: str, texts: list[str]) -> list[int]:
    """The ids of `shown` (template text with placeholders for texts) filled with texts, each text encoded as text.
    A text that spells no special token (nor forms one with the template text beside it) is encoded with its
    surroundings in one call, exactly as the whole render would be; one that does is encoded on its own (_as_text),
    the template text on either side on its own (its special tokens stay special)."""
    parts = _TEXT_RE.split(shown)  # template text, text index, template text, ...
    pieces = [texts[int(p)] if j % 2 else p for j, p in enumerate(parts)]
    special = _specials(tok)
    found = [m.span() for m in special.finditer("".join(pieces))]
    ids, run, at = [], "", 0
    for j, piece in enumerate(pieces):
        a, b = at, at + len(piece)
        at = b
        own = j % 2 and piece and (special.search(piece) or any(s < b and e > a for s, e in found))
        if not own:
            run += piece
            continue
        ids += tok(run, add_special_tokens=False).input_ids if run else []
        ids += _as_text(tok, piece)
        run = ""
    return ids + (tok(run, add_special_tokens=False).input_ids if run else [])


def observation_ids(
    tok, message: str | list[dict], stop: str | None = None, tools: list[dict] | None = None
) -> list[int]:
    """Token ids that follow a model turn's stop token: the end of the assistant turn (what the template writes after
    the stop token, e.g. ChatML's newline), the next message(s), and the next assistant header. Taken from the chat
    template as a delta, with a placeholder for the model's turn, so no model text is encoded; the messages' contents
    (the environment's or the tools' text) are encoded as text (_encode). message: a user message, or a list of
    messages (a tool turn's {"role": "tool", "content": ...} results). stop: the text of the stop token the turn
    ended with (default EOS); where the template opens the next message with it (GLM's <|observation|>, which ends a
    turn that calls tools), that sampled token is the delta's start and is not repeated; any other stop token stands
    in for the template's EOS, which the delta then starts after.
    tools: the schemas the first prompt was rendered with (a template may print them)."""
    base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _SLOT}]
    following = [{"role": "user", "content": message}] if isinstance(message, str) else list(message)
    texts = [m["content"] for m in following]
    slotted = [{**m, "content": _TEXT.format(i)} for i, m in enumerate(following)]
    before = _render(tok, base, False, tools)
    after, texts = _layout(tok, base + slotted, texts, True, tools)
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
    return _encode(tok, rest[len(end) :], texts)


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
    """The first prompt's ids: the user message (the task's prompt and the environment's reset text, encoded as
    text) after the tools' schemas, where the template prints them, and the assistant header."""
    shown, texts = _layout(tok, [{"role": "user", "content": _TEXT.format(0)}], [message], True, tools)
    return _encode(tok, shown, texts)


def summary_prompt(tok, first: str, summary_ids: list[int]) -> list[int]:
    """The prompt of a compacted episode's next row: the first user message (encoded as text), SUMMARY_JOIN and the
    summary's own sampled ids (without their stop token), spliced into the rendered template."""
    content = _TEXT.format(0) + SUMMARY_JOIN + _SLOT
    shown, texts = _layout(tok, [{"role": "user", "content": content}], [first], True)
    head, tail = shown.split(_SLOT)
    return _encode(tok, head, texts) + list(summary_ids) + _encode(tok, tail, texts)
