"""A scripted rollout engine for agent-loop tests: fixed token streams per question and turn (no model)."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerFast

from xtl.data.tiny import tiny_assets_dir
from xtl.rl import Rollout, RolloutEngine, SamplingSettings
from xtl.rl.agent import ChatFormat
from xtl.train.generation import stop_token_ids

CALL = '<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def tiny_chat(template: str = "qwen3") -> ChatFormat:
    """The tiny tokenizer's chat format in ``template``."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tiny_assets_dir())
    return ChatFormat(tokenizer, template, None, stop_token_ids(tokenizer, template))


def call(name: str, arguments: str) -> str:
    """A turn's text calling ``name`` with ``arguments`` (JSON text) in the Hermes syntax."""
    return CALL.format(name=name, arguments=arguments)


class ScriptedEngine(RolloutEngine):
    """Answers the ``k``-th assistant turn of a conversation about ``question`` with ``script[question][k]`` (text,
    encoded, or one character at a time with ``by_character``; then the stop token), each token's log-probability
    ``-(k + 1) / 100 - i / 1000``.

    A turn's ``question`` is the script key found in the decoded prompt; ``k`` counts the assistant turns the
    prompt already holds. A turn past the script's end repeats its last one.
    """

    def __init__(
        self, chat: ChatFormat, script: dict[str, list[str]], logprobs: bool = True, by_character: bool = False
    ) -> None:
        self.chat = chat
        self.script = script
        self.logprobs = logprobs
        self.by_character = by_character  # one token per character: ids that encoding the text would not give
        self.calls = 0
        self.end = _id(chat, "<|im_end|>")  # ChatML templates (qwen3, chatml, qwen2.5)

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingSettings, stop_token_ids=()):
        self.calls += 1
        out = []
        for prompt in prompts:
            ids, logprobs = self.turn(list(prompt))
            out.append(Rollout(list(prompt), ids, "stop", logprobs if self.logprobs else None, seconds=0.01))
        return out

    def turn(self, prompt: list[int]) -> tuple[list[int], list[float]]:
        """The scripted ids and log-probabilities of the turn that continues ``prompt``."""
        text = self.chat.tokenizer.decode(prompt)
        question = next(q for q in self.script if q in text)
        k = text.count("<|im_start|>assistant") - 1
        turns = self.script[question]
        text = turns[min(k, len(turns) - 1)]
        pieces = list(text) if self.by_character else [text]
        ids = [*(t for piece in pieces for t in self.chat.encode(piece)), self.end]
        return ids, [-(k + 1) / 100 - i / 1000 for i in range(len(ids))]


def _id(chat: ChatFormat, token: str) -> int:
    return chat.tokenizer.convert_tokens_to_ids(token)
