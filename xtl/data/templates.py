"""Chat templates rendered in Python with their loss spans.

Each renderer reproduces one official Jinja chat template character for character and marks, at the same time,
which characters are assistant output. Tokenizing the rendered text once gives the same ids as
``tokenizer.apply_chat_template(..., tokenize=True)``; a token receives loss when it overlaps a loss span.

Mask convention (all templates):

- supervised: everything an assistant turn generates after its role header, including reasoning
  (``<think>...</think>``), tool calls, and the stop token that ends the turn (``<|im_end|>``, ``<|eot_id|>``);
- masked: role headers (``<|im_start|>assistant\\n``, ``<|start_header_id|>assistant<|end_header_id|>\\n\\n``),
  the newline that follows ``<|im_end|>``, system/user/tool text, tool definitions, BOS, and the generation prompt;
- an assistant message with ``"loss": false`` is masked entirely, stop token included.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from xtl.data.item import DataError

QWEN25_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

_TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call><|im_end|>\n"
)


@dataclass
class Rendered:
    """A rendered conversation: its text and the ``[start, end)`` character spans that receive loss."""

    text: str
    loss_spans: list[tuple[int, int]] = field(default_factory=list)


class ChatTemplate(ABC):
    """A chat template that renders messages together with their loss spans."""

    name: str = ""
    roles: tuple[str, ...] = ("system", "user", "assistant", "tool")
    required_tokens: tuple[str, ...] = ()
    stop_token: str = ""

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        location: str = "<conversation>",
    ) -> Rendered:
        """Validate and render a conversation.

        Args:
            messages (list[dict]): OpenAI-style messages (``role``, ``content``, optional ``tool_calls``,
                ``reasoning_content``, ``loss``).
            tools (list[dict] | None): Tool (function) definitions.
            add_generation_prompt (bool): Append the assistant header that prompts a reply (masked).
            location (str): Where the conversation comes from, for error messages.

        Returns:
            Rendered: Text and loss spans.
        """
        normalized = normalize_messages(messages, self.roles, location, self.name)
        out = _Builder()
        self._render(out, normalized, tools, add_generation_prompt, location)
        return out.result()

    @abstractmethod
    def _render(
        self,
        out: _Builder,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
        location: str,
    ) -> None: ...


class Qwen3Template(ChatTemplate):
    """Qwen3 ChatML with thinking blocks (reasoning kept only after the last user query)."""

    name = "qwen3"
    required_tokens = ("<|im_start|>", "<|im_end|>")
    stop_token = "<|im_end|>"

    def _render(self, out, messages, tools, add_generation_prompt, location) -> None:
        _chatml_system_block(out, messages, tools, default_system=None)
        last_query = len(messages) - 1
        for idx in range(len(messages) - 1, -1, -1):
            m = messages[idx]
            content = m.get("content")
            if m["role"] == "user" and isinstance(content, str):
                if not (content.startswith("<tool_response>") and content.endswith("</tool_response>")):
                    last_query = idx
                    break
        for i, m in enumerate(messages):
            role = m["role"]
            content = m["content"] if isinstance(m.get("content"), str) else ""
            if role == "user" or (role == "system" and i > 0):
                out.add(f"<|im_start|>{role}\n{content}<|im_end|>\n")
            elif role == "assistant":
                reasoning = ""
                if isinstance(m.get("reasoning_content"), str):
                    reasoning = m["reasoning_content"]
                elif "</think>" in content:
                    reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
                    content = content.split("</think>")[-1].lstrip("\n")
                if i > last_query and (i == len(messages) - 1 or reasoning):
                    body = "<think>\n" + reasoning.strip("\n") + "\n</think>\n\n" + content.lstrip("\n")
                else:
                    body = content
                for j, call in enumerate(m.get("tool_calls") or []):
                    if (j == 0 and content) or j > 0:
                        body += "\n"
                    fn = _tool_function(call, location)
                    args = fn.get("arguments")
                    args_text = args if isinstance(args, str) else tojson(args)
                    body += '<tool_call>\n{"name": "' + str(fn.get("name")) + '", "arguments": ' + args_text
                    body += "}\n</tool_call>"
                out.add("<|im_start|>assistant\n")
                out.add(body + "<|im_end|>", loss=m.get("loss", True))
                out.add("\n")
            elif role == "tool":
                _chatml_tool_turn(out, messages, i, content)
        if add_generation_prompt:
            out.add("<|im_start|>assistant\n<think>\n")


class ChatMLTemplate(ChatTemplate):
    """ChatML as in Qwen2.5 (``default_system`` set) or plain ChatML without a default system prompt.

    Args:
        default_system (str | None): System prompt rendered when the conversation has none (Qwen2.5); ``None``
            renders no system block then.
        name (str): Registry name.
    """

    required_tokens = ("<|im_start|>", "<|im_end|>")
    stop_token = "<|im_end|>"

    def __init__(self, default_system: str | None = None, name: str = "chatml") -> None:
        self.default_system = default_system
        self.name = name

    def _render(self, out, messages, tools, add_generation_prompt, location) -> None:
        _chatml_system_block(out, messages, tools, default_system=self.default_system)
        for i, m in enumerate(messages):
            role = m["role"]
            calls = m.get("tool_calls")
            if role == "user" or (role == "system" and i > 0) or (role == "assistant" and not calls):
                content = _require_str(m, i, location, self.name)
                if role == "assistant":
                    out.add("<|im_start|>assistant\n")
                    out.add(content + "<|im_end|>", loss=m.get("loss", True))
                    out.add("\n")
                else:
                    out.add(f"<|im_start|>{role}\n{content}<|im_end|>\n")
            elif role == "assistant":
                content = m.get("content")
                body = "\n" + str(content) if content else ""
                for call in calls:
                    fn = _tool_function(call, location)
                    body += '\n<tool_call>\n{"name": "' + str(fn.get("name")) + '", "arguments": '
                    body += tojson(fn.get("arguments")) + "}\n</tool_call>"
                # The newline right after the role is the header's (the generation prompt ends with it).
                out.add("<|im_start|>assistant\n")
                out.add(body[1:] + "<|im_end|>", loss=m.get("loss", True))
                out.add("\n")
            elif role == "tool":
                _chatml_tool_turn(out, messages, i, _require_str(m, i, location, self.name))
        if add_generation_prompt:
            out.add("<|im_start|>assistant\n")


class Llama3Template(ChatTemplate):
    """Llama 3.1/3.2 Instruct: dated system block, tools in the first user message, ``ipython`` tool turns.

    Args:
        date_string (str): The "Today Date" written in the system block (fixed so samples are reproducible).
        bos_token (str): Text of the beginning-of-text token.
    """

    name = "llama3"
    roles = ("system", "user", "assistant", "tool", "ipython")
    required_tokens = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
    stop_token = "<|eot_id|>"

    def __init__(self, date_string: str = "26 Jul 2024", bos_token: str = "<|begin_of_text|>") -> None:
        self.date_string = date_string
        self.bos_token = bos_token

    def _render(self, out, messages, tools, add_generation_prompt, location) -> None:
        out.add(self.bos_token)
        system_message = ""
        if messages and messages[0]["role"] == "system":
            system_message = str(messages[0].get("content", "")).strip()
            messages = messages[1:]
        out.add("<|start_header_id|>system<|end_header_id|>\n\n")
        if tools is not None:
            out.add("Environment: ipython\n")
        out.add("Cutting Knowledge Date: December 2023\n")
        out.add(f"Today Date: {self.date_string}\n\n")
        out.add(system_message + "<|eot_id|>")
        if tools is not None:
            if not messages:
                raise DataError(
                    f"{location}: template 'llama3' puts tools in the first user message, but there is none"
                )
            first_user = str(messages[0].get("content", "")).strip()
            messages = messages[1:]
            out.add("<|start_header_id|>user<|end_header_id|>\n\n")
            out.add(
                "Given the following functions, please respond with a JSON for a function call with its proper "
                "arguments that best answers the given prompt.\n\n"
            )
            out.add(
                'Respond in the format {"name": function name, "parameters": dictionary of argument name and its '
                "value}.Do not use variables.\n\n"
            )
            for tool in tools:
                out.add(tojson(tool, indent=4) + "\n\n")
            out.add(first_user + "<|eot_id|>")
        for m in messages:
            role = m["role"]
            loss = role == "assistant" and m.get("loss", True)
            if role not in ("ipython", "tool") and "tool_calls" not in m:
                out.add(f"<|start_header_id|>{role}<|end_header_id|>\n\n")
                out.add(str(m.get("content", "")).strip() + "<|eot_id|>", loss=loss)
            elif "tool_calls" in m:
                if len(m["tool_calls"]) != 1:
                    raise DataError(f"{location}: template 'llama3' supports exactly one tool call per assistant turn")
                fn = _tool_function(m["tool_calls"][0], location)
                out.add("<|start_header_id|>assistant<|end_header_id|>\n\n")
                call = '{"name": "' + str(fn.get("name")) + '", "parameters": ' + tojson(fn.get("arguments")) + "}"
                out.add(call + "<|eot_id|>", loss=m.get("loss", True))
            else:
                content = m.get("content", "")
                text = tojson(content) if isinstance(content, (str, list, dict)) else str(content)
                out.add("<|start_header_id|>ipython<|end_header_id|>\n\n" + text + "<|eot_id|>")
        if add_generation_prompt:
            out.add("<|start_header_id|>assistant<|end_header_id|>\n\n")


TEMPLATES: dict[str, ChatTemplate] = {
    "qwen3": Qwen3Template(),
    "chatml": ChatMLTemplate(None, name="chatml"),
    "qwen2.5": ChatMLTemplate(QWEN25_DEFAULT_SYSTEM, name="qwen2.5"),
    "llama3": Llama3Template(),
}
HF_TEMPLATE = "hf"


def get_template(name: str, **kwargs: Any) -> ChatTemplate:
    """Look up a built-in template by name.

    Args:
        name (str): One of ``qwen3``, ``chatml``, ``qwen2.5``, ``llama3``.
        **kwargs: Constructor overrides (e.g. ``date_string`` for ``llama3``); they build a fresh instance.

    Returns:
        ChatTemplate: The renderer.
    """
    if name not in TEMPLATES:
        raise DataError(
            f"unknown chat template {name!r}; available: {', '.join(sorted(TEMPLATES))}, or {HF_TEMPLATE!r} to use "
            "the tokenizer's own chat_template (it needs {% generation %} blocks)"
        )
    template = TEMPLATES[name]
    if kwargs:
        if isinstance(template, ChatMLTemplate):
            return ChatMLTemplate(**{"default_system": template.default_system, "name": template.name, **kwargs})
        return type(template)(**kwargs)
    return template


def normalize_messages(
    messages: Any, roles: tuple[str, ...], location: str, template: str = "template"
) -> list[dict[str, Any]]:
    """Check an OpenAI-style message list and drop ``None``-valued keys (as ``apply_chat_template`` does).

    Args:
        messages (Any): The raw ``messages`` value of a sample.
        roles (tuple[str, ...]): Roles the template renders.
        location (str): ``file:line`` of the sample, for error messages.
        template (str): Template name, for error messages.

    Returns:
        list[dict]: Messages with ``None`` values removed.
    """
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{location}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
    normalized = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise DataError(f"{location}: message {i} is a {type(m).__name__}, expected an object with role/content")
        m = {k: v for k, v in m.items() if v is not None}
        role = m.get("role")
        if role not in roles:
            raise DataError(
                f"{location}: message {i} has unknown role {role!r}; template {template!r} accepts "
                f"{', '.join(roles)}: map your roles to these"
            )
        if "loss" in m and not isinstance(m["loss"], bool):
            raise DataError(f"{location}: message {i} has 'loss': {m['loss']!r}; use true or false")
        content = m.get("content")
        if content is not None and not isinstance(content, str) and role not in ("tool", "ipython"):
            raise DataError(f"{location}: message {i} ({role}) content must be a string, got {type(content).__name__}")
        normalized.append(m)
    return normalized


def tojson(value: Any, indent: int | None = None) -> str:
    """``tojson`` exactly as transformers' chat-template sandbox defines it (no ASCII escaping).

    Args:
        value (Any): JSON-serializable value.
        indent (int | None): Indentation.

    Returns:
        str: JSON text.
    """
    return json.dumps(value, ensure_ascii=False, indent=indent)


class _Builder:
    def __init__(self) -> None:
        self.parts: list[str] = []
        self.spans: list[tuple[int, int]] = []
        self.pos = 0

    def add(self, text: str, loss: bool = False) -> None:
        if not text:
            return
        if loss:
            if self.spans and self.spans[-1][1] == self.pos:
                self.spans[-1] = (self.spans[-1][0], self.pos + len(text))
            else:
                self.spans.append((self.pos, self.pos + len(text)))
        self.parts.append(text)
        self.pos += len(text)

    def result(self) -> Rendered:
        return Rendered("".join(self.parts), self.spans)


def _chatml_system_block(
    out: _Builder, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, default_system: str | None
) -> None:
    has_system = messages[0]["role"] == "system"
    system = messages[0].get("content", "") if has_system else default_system
    if tools:
        out.add("<|im_start|>system\n")
        if default_system is None:
            if has_system:
                out.add(str(system) + "\n\n")
            out.add(_TOOLS_PREAMBLE)
        else:
            out.add(str(system) + "\n\n" + _TOOLS_PREAMBLE)
        for tool in tools:
            out.add("\n" + tojson(tool))
        out.add(_TOOLS_POSTAMBLE)
    elif system is not None:
        out.add(f"<|im_start|>system\n{system}<|im_end|>\n")


def _tool_function(call: Any, location: str) -> dict[str, Any]:
    if not isinstance(call, dict):
        raise DataError(f"{location}: each tool call must be an object like {{'function': {{'name', 'arguments'}}}}")
    fn = call.get("function") or call
    if not isinstance(fn, dict) or "name" not in fn:
        raise DataError(f"{location}: tool call {call!r} has no function name")
    return fn


def _require_str(m: dict[str, Any], index: int, location: str, template: str) -> str:
    content = m.get("content")
    if not isinstance(content, str):
        raise DataError(
            f"{location}: message {index} ({m['role']}) has no text content; template {template!r} needs a string "
            "'content' here (only assistant turns with tool_calls may omit it)"
        )
    return content


def _chatml_tool_turn(out, messages: list[dict], i: int, content: str) -> None:  # noqa: ANN001
    """Consecutive tool results share one ``user`` turn, each wrapped in ``<tool_response>`` (Qwen ChatML)."""
    if i == 0 or messages[i - 1]["role"] != "tool":
        out.add("<|im_start|>user")
    out.add("\n<tool_response>\n" + content + "\n</tool_response>")
    if i == len(messages) - 1 or messages[i + 1]["role"] != "tool":
        out.add("<|im_end|>\n")
