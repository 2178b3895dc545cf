"""The chat format of agent loops: tool calls parsed in each template's syntax, and the continuation after a
sampled turn equal to the template's rendering of what follows it."""

from __future__ import annotations

import pytest

from tests.rl.agent.scripted import call, tiny_chat
from xtl.data.templates import get_template
from xtl.rl.agent.chat import ChatFormat, tool_call

CONVERSATION = [
    {"role": "user", "content": "What is 2+3?"},
    {"role": "assistant", "content": "", "tool_calls": [tool_call("calculator", {"expression": "2+3"})]},
    {"role": "tool", "content": "5", "tool_call_id": "call_0"},
]


def _parse(text: str, template: str = "qwen3"):
    chat = tiny_chat(template) if template != "llama3" else ChatFormat(tiny_chat().tokenizer, "llama3")
    return chat.parse(chat.encode(text))


class TestParse:
    def test_hermes_calls_and_the_text_before_them(self) -> None:
        turn = _parse("Let me compute.\n" + call("calculator", '{"expression": "2+3"}') + "\n" + call("f", "{}"))
        assert turn.content == "Let me compute." and turn.error is None
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in turn.calls] == [
            ("calculator", {"expression": "2+3"}), ("f", {}),
        ]  # fmt: skip

    def test_reasoning_is_removed_before_parsing(self) -> None:
        turn = _parse("<think>\nhmm <tool_call> maybe\n</think>\n\n5")
        assert turn.content == "5" and not turn.calls and turn.error is None

    def test_arguments_given_as_a_json_string_are_read(self) -> None:
        turn = _parse('<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>')
        assert turn.calls[0]["function"]["arguments"] == {"a": 1}

    @pytest.mark.parametrize(
        ("text", "error"),
        [
            ('<tool_call>\n{"name": "f", "arguments": {}}', "a <tool_call> is not closed"),
            ("<tool_call>\nnot json\n</tool_call>", "the tool call is not JSON"),
            ('<tool_call>\n{"arguments": {}}\n</tool_call>', 'a tool call is an object with a "name"'),
            ('<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>', 'the "arguments" of f are not a JSON'),
            ("5</tool_call>", "</tool_call> without <tool_call>"),
        ],
    )
    def test_malformed_calls_say_why(self, text: str, error: str) -> None:
        assert _parse(text).error.startswith(error)

    def test_llama3_calls_are_one_json_object_with_parameters(self) -> None:
        turn = _parse('{"name": "calculator", "parameters": {"expression": "2+3"}}', "llama3")
        assert turn.calls[0]["function"] == {"name": "calculator", "arguments": {"expression": "2+3"}}
        assert _parse("The answer is 5", "llama3").calls == []
        assert _parse('{"name": "calculator", "parameters": ', "llama3").error.startswith("the tool call is not JSON")


class TestContinuation:
    @pytest.mark.parametrize("template", ["qwen3", "chatml", "qwen2.5"])
    def test_is_what_the_template_renders_after_the_sampled_turn(self, template: str) -> None:
        chat = tiny_chat(template)
        rendered = get_template(template).render(CONVERSATION, add_generation_prompt=True).text
        after = rendered[rendered.index('"2+3"}}\n</tool_call><|im_end|>') + len('"2+3"}}\n</tool_call><|im_end|>') :]
        assert after.startswith("\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n")
        assert chat.continuation_ids(CONVERSATION) == chat.encode(after)

    def test_the_tokenizers_own_template_continues_by_prefix(self) -> None:
        chat = tiny_chat("hf")
        ids = chat.continuation_ids(CONVERSATION)
        text = chat.tokenizer.decode(ids)
        assert text.startswith("\n<|im_start|>user\n<tool_response>\n5\n</tool_response>") and "assistant" in text

    def test_no_assistant_turn_has_no_continuation(self) -> None:
        assert tiny_chat().continuation_ids(CONVERSATION[:1]) is None
