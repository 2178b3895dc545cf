"""The chat format of an agent loop: prompts rendered by the run's template, tool calls parsed from the template's
syntax, and the tokens that continue a context after a sampled turn.

The continuation is what makes trajectories token-exact. After the engine samples an assistant turn (ending with the
template's stop token), the next turn's context is the recorded ids followed by the template's rendering of whatever
comes after that turn: the newline after the stop token, the tool results (``<|im_start|>user <tool_response>...`` in
Qwen's templates, ``ipython`` turns in Llama 3's), the next generation prompt. That text is cut from a rendering of the
whole conversation at the end of the last assistant turn (its loss span in xtl's templates; after as many end-of-turn
markers as the conversation holds up to that turn in a tokenizer's own template) and tokenized alone; the sampled ids
themselves are never re-encoded. The multi-turn loop and the black-box endpoint both continue contexts this way, so one
conversation gives one token sequence through either.

With a vision-language policy (``vision``), a message's image parts are rendered as their placeholder tokens
(:class:`~xtl.rl.vision.PromptVision`, the SFT path's expansion), in prompts and in continuations alike.

Tool calls are parsed in the template's syntax: ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks
(Qwen3, Qwen2.5, ChatML; the Hermes format), or one ``{"name": ..., "parameters": ...}`` object (Llama 3). A call
that cannot be parsed is reported as malformed, with why; the loop answers it with a tool error turn.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from xtl.data.templates import HF_TEMPLATE, get_template
from xtl.train.generation import split_thinking

if TYPE_CHECKING:
    from xtl.rl.vision import PromptVision

_CALL_BLOCK = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


@dataclass
class ParsedTurn:
    """A sampled assistant turn, read.

    Attributes:
        content: The text outside tool calls, reasoning removed (the answer when there is no call).
        calls: The tool calls: ``{"id", "type": "function", "function": {"name", "arguments": dict}}``.
        error: Why a call could not be parsed (``None``: every call parsed).
    """

    content: str
    calls: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None

    def message(self) -> dict[str, Any]:
        """The turn as an assistant message (what goes into the conversation)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.calls:
            message["tool_calls"] = self.calls
        return message


class ChatFormat:
    """Renders, parses and continues conversations in one chat template.

    Args:
        tokenizer: A transformers tokenizer.
        template: A built-in xtl template name, or ``None`` / ``hf`` for the tokenizer's own.
        template_kwargs: Built-in template overrides.
        stop_token_ids: The tokens that end a turn (removed before decoding).
        vision: Renders image parts as placeholders (a vision-language policy; ``None``: text only).
    """

    def __init__(
        self,
        tokenizer: Any,
        template: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
        stop_token_ids: tuple[int, ...] = (),
        vision: PromptVision | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vision = vision
        self.template_name = None if template in (None, HF_TEMPLATE) else template
        self.template = get_template(template, **(template_kwargs or {})) if self.template_name else None
        self.stop_token_ids = tuple(stop_token_ids)
        self.llama_calls = self.template_name == "llama3"

    def prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of ``messages`` with the generation prompt (images as their placeholders)."""
        messages = self._text(messages)
        if self.template is None:
            ids = self.tokenizer.apply_chat_template(
                messages, tools=tools or None, tokenize=True, add_generation_prompt=True, return_dict=False
            )
            return list(ids)
        return self.encode(self._render(messages, tools, True)[0])

    def continuation_ids(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int] | None:
        """The ids that follow the last assistant turn of ``messages`` (which the engine sampled, ending with the
        stop token): the rendering of the messages after it and the next generation prompt. ``None`` when the
        template does not render the conversation as the sampled context followed by more text."""
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
        if last is None:
            return None
        messages = [{k: v for k, v in m.items() if k != "loss"} for m in messages]
        text, spans = self._render(messages, tools, True)
        if spans is not None:  # built-in templates: the last assistant turn's loss span ends at its stop token
            return self.encode(text[spans[-1][1] :])
        # the tokenizer's own template may rewrite earlier turns (drop reasoning): cut the whole rendering after as
        # many end-of-turn markers as the conversation up to the last assistant turn holds
        before, _ = self._render(messages[: last + 1], tools, False)
        stops = [t for t in self.tokenizer.convert_ids_to_tokens(list(self.stop_token_ids)) if t and t in before]
        if not stops:
            return None
        stop = max(stops, key=before.rfind)
        cut = -1
        for _ in range(before.count(stop)):
            cut = text.find(stop, cut + 1)
            if cut < 0:
                return None
        return self.encode(text[cut + len(stop) :])

    def parse(self, ids: list[int]) -> ParsedTurn:
        """Read a sampled turn: its answer text and tool calls."""
        _, text = split_thinking(self.decode(ids))
        if self.llama_calls:
            return _parse_llama(text)
        return _parse_hermes(text)

    def answer(self, ids: list[int]) -> str:
        """The answer of a sampled turn: its text after the reasoning, tool-call syntax left as it is."""
        return split_thinking(self.decode(ids))[1]

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` with the stop tokens removed (special tokens such as ``<tool_call>`` kept)."""
        return self.tokenizer.decode([t for t in ids if t not in self.stop_token_ids])

    def _text(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``messages`` with image parts as placeholder text (unchanged without vision)."""
        return messages if self.vision is None else self.vision.text_messages(messages)

    def _render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, generation: bool
    ) -> tuple[str, list[tuple[int, int]] | None]:
        messages = self._text(messages)
        if self.template is not None:
            rendered = self.template.render(messages, tools=tools or None, add_generation_prompt=generation)
            return rendered.text, rendered.loss_spans
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools or None, tokenize=False, add_generation_prompt=generation
        )
        return text, None


def tool_call(name: str, arguments: dict[str, Any], call_id: str = "call_0") -> dict[str, Any]:
    """An OpenAI-style tool call (the loop numbers the ids of a trajectory's calls)."""
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": arguments}}  # fmt: skip


# ---- private ---------------------------------------------------------------------------------------------------


def _parse_hermes(text: str) -> ParsedTurn:
    blocks = list(_CALL_BLOCK.finditer(text))
    if not blocks:
        if "</tool_call>" in text:
            return ParsedTurn(text.strip(), error="</tool_call> without <tool_call>")
        return ParsedTurn(text.strip())
    content = text[: blocks[0].start()].strip()
    calls = []
    for block in blocks:
        if not block.group(2):
            return ParsedTurn(content, calls, "a <tool_call> is not closed")
        call, error = _read_call(block.group(1).strip(), "arguments")
        if error:
            return ParsedTurn(content, calls, error)
        calls.append(call)
    return ParsedTurn(content, calls)


def _parse_llama(text: str) -> ParsedTurn:
    stripped = text.strip()
    if not stripped.startswith("{") or '"name"' not in stripped:
        return ParsedTurn(stripped)
    call, error = _read_call(stripped, "parameters")
    return ParsedTurn("", [call] if call else [], error)


def _read_call(body: str, arguments_key: str) -> tuple[dict[str, Any] | None, str | None]:
    try:
        value = json.loads(body)
    except json.JSONDecodeError as err:
        return None, f"the tool call is not JSON ({err.msg} at character {err.pos})"
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None, 'a tool call is an object with a "name"'
    arguments = value.get(arguments_key, value.get("arguments", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None, f'the "{arguments_key}" of {value["name"]} are not a JSON object'
    if not isinstance(arguments, dict):
        return None, f'the "{arguments_key}" of {value["name"]} are not a JSON object'
    return tool_call(value["name"], arguments), None
