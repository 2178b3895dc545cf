"""Chat-template parity with ``apply_chat_template`` and loss masks checked against a slow independent oracle."""

from __future__ import annotations

import copy

import pytest

from xtl.data import ChatTokenizeFn, DataError, get_template
from xtl.data.item import IGNORE_INDEX

from .conftest import FIXTURES

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "description": "Local time", "parameters": {}}}


def _call(name: str, args: dict) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": args}}


CONVERSATIONS: dict[str, tuple[list[dict], list | None]] = {
    "single": ([{"role": "user", "content": "What is 37+45?"}, {"role": "assistant", "content": "82"}], None),
    "system_multi_turn": (
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Reverse abc"},
            {"role": "assistant", "content": "cba"},
        ],
        None,
    ),
    "repeated_assistant_text": (
        [
            {"role": "user", "content": "OK"},
            {"role": "assistant", "content": "OK"},
            {"role": "user", "content": "OK"},
            {"role": "assistant", "content": "OK"},
        ],
        None,
    ),
    "unicode": (
        [
            {"role": "user", "content": "你好，世界！ café 🙂"},
            {"role": "assistant", "content": "Ünïcödé ∑ x² ≤ 10 🙂 naïve"},
        ],
        None,
    ),
    "unicode_edges": (
        [
            {"role": "user", "content": "é"},
            {"role": "assistant", "content": "🙂🙂 ünï 𝔘"},
            {"role": "user", "content": "\n  spaced  \n"},
            {"role": "assistant", "content": " 你好 "},
        ],
        None,
    ),
    "reasoning": (
        [
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "2 plus 2 makes 4."},
            {"role": "user", "content": "And 3+3?"},
            {"role": "assistant", "content": "6", "reasoning_content": "\nthree and three\n"},
        ],
        None,
    ),
    "reasoning_inline_think": (
        [
            {"role": "user", "content": "Uppercase hi"},
            {"role": "assistant", "content": "<think>\nupper it\n</think>\n\nHI"},
        ],
        None,
    ),
    "no_reasoning_last_turn": (
        [{"role": "user", "content": "Say yes"}, {"role": "assistant", "content": "yes"}],
        None,
    ),
    "loss_false_middle": (
        [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "bad answer", "loss": False},
            {"role": "user", "content": "b"},
            {"role": "assistant", "content": "good answer"},
        ],
        None,
    ),
    "loss_false_end": (
        [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "good"},
            {"role": "user", "content": "b"},
            {"role": "assistant", "content": "skip me", "loss": False},
        ],
        None,
    ),
    "tools_single_call": (
        [
            {"role": "system", "content": "Use tools."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [_call("get_weather", {"city": "Paris"})]},
            {"role": "tool", "content": '{"temp": 21}'},
            {"role": "assistant", "content": "It is 21 degrees."},
        ],
        [WEATHER_TOOL, TIME_TOOL],
    ),
    "tools_no_system": (
        [
            {"role": "user", "content": "Time?"},
            {"role": "assistant", "content": "", "tool_calls": [_call("get_time", {})]},
            {"role": "tool", "content": "12:00"},
            {"role": "assistant", "content": "Noon."},
        ],
        [TIME_TOOL],
    ),
}

# Multi-call turns and consecutive tool results: ChatML family only (llama3 allows one call per turn).
CHATML_ONLY: dict[str, tuple[list[dict], list | None]] = {
    "tools_multi_call": (
        [
            {"role": "user", "content": "Weather in Paris and time?"},
            {
                "role": "assistant",
                "content": "Checking both.",
                "tool_calls": [_call("get_weather", {"city": "Paris"}), _call("get_time", {})],
            },
            {"role": "tool", "content": '{"temp": 21}'},
            {"role": "tool", "content": "12:00"},
            {"role": "assistant", "content": "21 degrees at noon.", "reasoning_content": "combine"},
        ],
        [WEATHER_TOOL, TIME_TOOL],
    ),
    "tool_response_as_user": (
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
            {"role": "user", "content": "<tool_response>\nx\n</tool_response>"},
            {"role": "assistant", "content": "a2", "reasoning_content": "r2"},
        ],
        None,
    ),
}

TEMPLATE_FILES = {"qwen3": "qwen3.jinja", "chatml": "chatml.jinja", "qwen2.5": "qwen2.5.jinja", "llama3": None}
HEADERS = {
    "qwen3": ("<|im_start|>assistant\n", "<|im_end|>"),
    "chatml": ("<|im_start|>assistant\n", "<|im_end|>"),
    "qwen2.5": ("<|im_start|>assistant\n", "<|im_end|>"),
    "llama3": ("<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"),
}
LLAMA_DATE = "26 Jul 2024"


def _cases(template: str) -> list[tuple[str, list[dict], list | None]]:
    cases = dict(CONVERSATIONS)
    if template != "llama3":
        cases.update(CHATML_ONLY)
    return [(name, msgs, tools) for name, (msgs, tools) in cases.items()]


def _tokenizer_for(template: str, qwen_tokenizer, llama_tokenizer):
    if template == "llama3":
        return llama_tokenizer
    tok = copy.deepcopy(qwen_tokenizer)
    tok.chat_template = (FIXTURES / TEMPLATE_FILES[template]).read_text()
    return tok


def _official(tok, template: str, messages: list[dict], tools, add_generation_prompt: bool = False, tokenize=True):
    kwargs = {"date_string": LLAMA_DATE} if template == "llama3" else {}
    clean = [{k: v for k, v in m.items() if k != "loss"} for m in messages]
    out = tok.apply_chat_template(
        clean, tools=tools, tokenize=tokenize, add_generation_prompt=add_generation_prompt, **kwargs
    )
    return list(out["input_ids"]) if tokenize else out


def _byte_decoder() -> dict[str, int]:
    bs = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _oracle_mask(tok, template: str, messages: list[dict], tools) -> list[bool]:
    """Slow oracle: spans found by string search in the official rendering, token extents from token bytes."""
    text = _official(tok, template, messages, tools, tokenize=False)
    ids = _official(tok, template, messages, tools)
    header, stop = HEADERS[template]
    spans, pos = [], 0
    for message in [m for m in messages if m["role"] == "assistant"]:
        start = text.index(header, pos) + len(header)
        end = text.index(stop, start) + len(stop)
        pos = end
        if message.get("loss", True):
            spans.append((len(text[:start].encode()), len(text[:end].encode())))
    decoder = _byte_decoder()
    added = {v: k for k, v in tok.get_added_vocab().items()}
    mask, cursor = [], 0
    for token_id in ids:
        if token_id in added:
            width = len(added[token_id].encode())
        else:
            width = len(tok.convert_ids_to_tokens(token_id))
            assert all(ch in decoder for ch in tok.convert_ids_to_tokens(token_id))
        mask.append(any(a < cursor + width and cursor < b for a, b in spans))
        cursor += width
    assert cursor == len(text.encode())
    return mask


@pytest.mark.parametrize("template", ["qwen3", "chatml", "qwen2.5", "llama3"])
class TestTemplateParity:
    def test_ids_equal_apply_chat_template(self, template, qwen_tokenizer, llama_tokenizer):
        tok = _tokenizer_for(template, qwen_tokenizer, llama_tokenizer)
        fn = ChatTokenizeFn(tok, template=template)
        for name, messages, tools in _cases(template):
            row = {"messages": messages, "tools": tools}
            item = fn(row)
            assert item[0]["input_ids"] == _official(tok, template, messages, tools), name
            assert fn.render(row).text == _official(tok, template, messages, tools, tokenize=False), name

    def test_generation_prompt_ids_and_mask(self, template, qwen_tokenizer, llama_tokenizer):
        tok = _tokenizer_for(template, qwen_tokenizer, llama_tokenizer)
        fn = ChatTokenizeFn(tok, template=template)
        for name, messages, tools in _cases(template):
            prompt = messages[:-1] if messages[-1]["role"] == "assistant" else messages
            item = fn.encode({"messages": prompt, "tools": tools}, add_generation_prompt=True)
            expected = _official(tok, template, prompt, tools, add_generation_prompt=True)
            assert item["input_ids"] == expected, name
            without = fn.encode({"messages": prompt, "tools": tools})
            n = len(without["input_ids"])
            assert all(label == IGNORE_INDEX for label in item["labels"][n:]), name

    def test_loss_mask_matches_oracle(self, template, qwen_tokenizer, llama_tokenizer):
        tok = _tokenizer_for(template, qwen_tokenizer, llama_tokenizer)
        fn = ChatTokenizeFn(tok, template=template)
        for name, messages, tools in _cases(template):
            item = fn({"messages": messages, "tools": tools})[0]
            oracle = _oracle_mask(tok, template, messages, tools)
            got = [label != IGNORE_INDEX for label in item["labels"]]
            assert got == oracle, name
            for label, token in zip(item["labels"], item["input_ids"]):
                assert label in (IGNORE_INDEX, token)

    def test_stop_token_supervised_and_scaffolding_masked(self, template, qwen_tokenizer, llama_tokenizer):
        tok = _tokenizer_for(template, qwen_tokenizer, llama_tokenizer)
        fn = ChatTokenizeFn(tok, template=template)
        messages, tools = CONVERSATIONS["loss_false_middle"]
        item = fn({"messages": messages, "tools": tools})[0]
        ids, labels = item["input_ids"], item["labels"]
        stop_id = tok.convert_tokens_to_ids(HEADERS[template][1])
        stops = [i for i, t in enumerate(ids) if t == stop_id]
        # system (llama3 only), user a, assistant(loss false), user b, assistant
        assistant_stops = stops[-3::2]
        assert labels[assistant_stops[0]] == IGNORE_INDEX  # loss: false removes its stop token
        assert labels[assistant_stops[1]] == stop_id
        for i in stops:
            if i + 1 < len(ids):
                assert labels[i + 1] == IGNORE_INDEX  # the newline/header after a stop is scaffolding
        supervised = tok.decode([t for t, lab in zip(ids, labels) if lab != IGNORE_INDEX])
        assert "good answer" in supervised and "bad answer" not in supervised
        assert "a" not in supervised.replace("good answer", "")


class TestHFTemplateMode:
    def test_generation_blocks_give_the_same_mask_as_llama3(self, llama_tokenizer):
        tok = copy.deepcopy(llama_tokenizer)
        tok.chat_template = (FIXTURES / "llama3.2_with_generation.jinja").read_text()
        hf = ChatTokenizeFn(tok, template="hf", template_kwargs={"date_string": LLAMA_DATE})
        builtin = ChatTokenizeFn(llama_tokenizer, template="llama3")
        for name, messages, tools in _cases("llama3"):
            row = {"messages": messages, "tools": tools}
            assert hf(row) == builtin(row), name

    def test_template_without_generation_blocks_is_rejected(self, llama_tokenizer):
        with pytest.raises(DataError, match=r"generation %\} \.\.\. \{% endgeneration"):
            ChatTokenizeFn(llama_tokenizer, template="hf")


class TestTemplateErrors:
    def test_unknown_template_name(self, qwen_tokenizer):
        with pytest.raises(DataError, match="unknown chat template 'qwen9'; available: chatml, llama3"):
            ChatTokenizeFn(qwen_tokenizer, template="qwen9")

    def test_tokenizer_without_template_tokens(self, qwen_tokenizer):
        with pytest.raises(DataError, match="lacks special tokens .*<\\|eot_id\\|>"):
            ChatTokenizeFn(qwen_tokenizer, template="llama3")

    def test_unknown_role(self, qwen_tokenizer):
        fn = ChatTokenizeFn(qwen_tokenizer, template="qwen3")
        row = {"messages": [{"role": "user", "content": "x"}, {"role": "bot", "content": "y"}]}
        with pytest.raises(DataError, match=r"a.jsonl:7: message 1 has unknown role 'bot'; template 'qwen3' accepts"):
            fn(row, "a.jsonl:7")

    def test_missing_messages_key(self, qwen_tokenizer):
        fn = ChatTokenizeFn(qwen_tokenizer, template="qwen3")
        with pytest.raises(DataError, match=r"b.jsonl:3: no 'messages' key \(keys: \['conversation'\]\)"):
            fn({"conversation": []}, "b.jsonl:3")

    def test_get_template_overrides(self):
        assert get_template("llama3", date_string="01 Jan 2025").date_string == "01 Jan 2025"
