"""Exact tokens across tool turns (issue 24, section 3): the ids a tool episode is assembled from (the first prompt with
the tools' schemas, each model turn's sampled ids and stop token, each tool turn's delta from the chat template) equal
the chat template's render of the whole conversation, for a ChatML/Hermes template (Qwen2.5's shape: the tools in the
system message, consecutive tool results in one user block) and a GLM-style one (<|observation|> both ends a turn
that calls tools and opens the tool results). Written here, since no hub is reachable; the tokenizer is the tiny
byte-level one, plus GLM's role tokens."""

import copy

import pytest
from transformers.utils import get_json_schema

from agent import check_chat_template, first_prompt_ids, observation_ids
from data.tiny import build_tokenizer

HERMES = (
    "{%- if tools %}<|im_start|>system\nYou may call functions.\n<tools>\n{%- for t in tools %}\n{{ t | tojson }}{%- endfor %}\n</tools>\n"
    'Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n{%- endif %}'
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{%- endif %}"
    "{{ '\n<tool_response>\n' + m.content + '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\n' }}{%- endif %}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)
GLM = (
    "[gMASK]<sop>{%- if tools %}<|system|>\n# Tools\n{%- for t in tools %}\n{{ t | tojson }}{%- endfor %}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}{{ '<|user|>\n' + m.content }}"
    "{%- elif m.role == 'assistant' %}{{ '<|assistant|>\n' + m.content }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if messages[loop.index0 - 1].role != 'tool' %}{{ '<|observation|>' }}{%- endif %}"
    "{{ '\n<tool_response>\n' + m.content + '\n</tool_response>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|assistant|>\n' }}{%- endif %}"
)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: the expression, e.g. "2 + 3".
    """
    return expression


def tokenizer(template: str, extra=()):
    tok = build_tokenizer()
    if extra:
        tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", *extra]})
    tok.chat_template = template
    return tok


CASES = {  # template, its extra special tokens, the stop token of a turn that calls tools, of the final answer
    "hermes": (HERMES, (), "<|im_end|>", "<|im_end|>"),
    "glm": (GLM, ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"), "<|observation|>", "<|user|>"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_assembled_tool_episode_equals_the_template_render(name):
    template, extra, call_stop, answer_stop = CASES[name]
    tok = tokenizer(template, extra)
    tools = [get_json_schema(calculator)]
    enc = lambda s: tok(s, add_special_tokens=False).input_ids  # noqa: E731  (the test's stand-in for sampled ids)
    call = ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>' if name == "hermes"
            else "<tool_call>calculator<arg_key>expression</arg_key><arg_value>2+3</arg_value></tool_call>")
    turns = [(call, call_stop, [{"role": "tool", "content": "5"}, {"role": "tool", "content": "ok"}]),
             ("Again." + call, call_stop, [{"role": "tool", "content": "5"}]),
             ("The answer is 5.", answer_stop, None)]
    ids = first_prompt_ids(tok, "What is 2+3?", tools)
    messages = [{"role": "user", "content": "What is 2+3?"}]
    for text, stop, results in turns:
        ids += enc(text) + [tok.convert_tokens_to_ids(stop)]  # the engine's sampled ids, stop token included
        messages.append({"role": "assistant", "content": text})
        if results is not None:
            ids += observation_ids(tok, results, stop=stop, tools=tools)
            messages += copy.deepcopy(results)
    whole = enc(tok.apply_chat_template(messages, tools=tools, tokenize=False))
    # the render of the finished conversation: ChatML writes a newline after the last <|im_end|> (never sampled);
    # GLM writes no stop after the last turn (the model's <|user|> ended it)
    assert ids == (whole[:-1] if name == "hermes" else whole + [tok.convert_tokens_to_ids(answer_stop)])
    assert tok.decode(observation_ids(tok, [{"role": "tool", "content": "5"}], stop=call_stop, tools=tools)).startswith(
        "\n<|im_start|>user\n<tool_response>\n5" if name == "hermes" else "\n<tool_response>\n5")


def test_a_template_that_rewrites_earlier_turns_is_refused():
    """Qwen3-like: an assistant turn's <think> block is dropped once a later message follows; refused by
    check_chat_template (run_episodes calls it). The tiny model's and both templates above keep earlier turns."""
    rewrites = ("{%- for m in messages %}{%- set c = m.content %}"
                "{%- if m.role == 'assistant' and loop.index0 < messages|length - 1 %}{%- set c = c.split('</think>')[-1].lstrip() %}{%- endif %}"
                "{{ '<|im_start|>' + m.role + '\n' + c + '<|im_end|>\n' }}{%- endfor %}"
                "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}")
    with pytest.raises(ValueError, match="rewrites an earlier assistant turn once a user message follows it"):
        check_chat_template(tokenizer(rewrites))
    for template, extra in ((HERMES, ()), (GLM, CASES["glm"][1])):
        check_chat_template(tokenizer(template, extra), [get_json_schema(calculator)])
    check_chat_template(build_tokenizer())
    glm = tokenizer(GLM, CASES["glm"][1])
    with pytest.raises(ValueError, match=r"does not end an assistant turn with its stop token '<\|im_end\|>'"):
        observation_ids(glm, [{"role": "tool", "content": "5"}])  # GLM's tool turn ends at <|observation|>, not EOS
