"""Preference (pairwise) data: ``kind: preference`` rows become a chosen and a rejected sample, kept together.

A row is one of (TRL's dataset layouts):

- explicit prompt, conversational: ``{"prompt": [messages], "chosen": [messages], "rejected": [messages]}``;
- implicit prompt, conversational: ``{"chosen": [conversation], "rejected": [conversation]}``: the prompt is the
  longest common prefix of the two message lists, the rest of each is its response;
- standard (strings): ``{"prompt": "...", "chosen": "...", "rejected": "..."}``: the prompt becomes one user
  message, each response one assistant message.

Each side (prompt + response) is rendered and masked by :class:`xtl.data.tokenize.ChatTokenizeFn`, with the prompt's
own assistant turns marked ``"loss": false``, so exactly the response's assistant tokens are supervised. A row yields
two consecutive samples in the cache, chosen then rejected (``rows.npy`` holds the row twice); a row that cannot form a
pair yields an error or, with ``bad_rows: drop``, no sample. Mixing (:class:`xtl.data.dataset.MixedDataset` with
``pairs=True``) and packing (:func:`xtl.data.packing.best_fit_pack` with ``pairs=True``) keep every pair whole, so a
preference micro-batch holds documents chosen, rejected, chosen, rejected, ... (pair ``k`` = documents ``2k`` and
``2k + 1``).

Images: for a vision-language model (``image_processor`` given) the prompt's messages may hold image parts
(``{"type": "image", "image": path}``, as ``kind: chat`` rows of :mod:`xtl.data.multimodal`); both sides are encoded by
:class:`~xtl.data.multimodal.VisionChatTokenizeFn`, so each sample of the pair holds its own copy of the image
placeholders, and :meth:`PreferenceTokenizeFn.image_index` gives both samples the prompt's images (the sidecar of
:func:`~xtl.data.multimodal.load_image_index`). A response that holds an image is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase

import xtl.data.templates as _templates_module
from xtl.data.cache import TokenizedCache
from xtl.data.item import DataError
from xtl.data.multimodal import ImageProcessorConfig, SampleImages, VisionChatTokenizeFn
from xtl.data.packing import PackPlan
from xtl.data.sources import BadRowPolicy
from xtl.data.tokenize import ChatTokenizeFn, Locator, SampleArrays, TokenizeFn

PREFERENCE_KIND = "preference"
BAD_ROW_POLICIES: tuple[str, ...] = ("error", "drop")
SIDES = ("chosen", "rejected")

_LAYOUTS = (
    "preference rows need {'prompt': [messages], 'chosen': [messages], 'rejected': [messages]}, "
    "{'chosen': [messages], 'rejected': [messages]} (the prompt is their common prefix), or 'prompt', 'chosen' and "
    "'rejected' strings"
)
FIX = "fix or remove the row, or set bad_rows: drop on this source to skip such rows"


class BadRowError(DataError):
    """A preference row that cannot form a pair; ``bad_rows: drop`` skips such rows instead of raising."""


@dataclass
class PreferenceRow:
    """A preference row in message form: the shared prompt and the two responses.

    Attributes:
        prompt (list[dict]): Messages both sides start with (may be empty for the implicit layout).
        chosen (list[dict]): The preferred response (one or more messages).
        rejected (list[dict]): The dispreferred response.
        tools (list | None): Tool definitions of the row, given to both sides.
    """

    prompt: list[Any]
    chosen: list[Any]
    rejected: list[Any]
    tools: list[Any] | None = None

    def side(self, name: str) -> list[Any]:
        """The message list of one side: the prompt (its assistant turns unsupervised) and the response.

        Args:
            name (str): ``"chosen"`` or ``"rejected"``.

        Returns:
            list[dict]: Messages for :class:`~xtl.data.tokenize.ChatTokenizeFn`.
        """
        return unsupervised_prompt(self.prompt) + list(getattr(self, name))


def unsupervised_prompt(prompt: list[Any]) -> list[Any]:
    """A prompt's messages with its assistant turns marked ``"loss": false`` (only the response is supervised).

    Args:
        prompt (list[dict]): Messages before the response.

    Returns:
        list[dict]: The messages, assistant turns copied with ``"loss": False``.
    """
    return [{**m, "loss": False} if isinstance(m, dict) and m.get("role") == "assistant" else m for m in prompt]


def parse_preference_row(row: dict[str, Any], location: str = "<row>") -> PreferenceRow:
    """Read a preference row in any of the three layouts (module docstring).

    Args:
        row (dict): The raw record.
        location (str): ``file:line`` of the record, for error messages.

    Returns:
        PreferenceRow: Prompt and responses as messages.

    Raises:
        BadRowError: A missing or empty side, chosen identical to rejected, or an empty response (implicit layout).
        DataError: A row in none of the layouts (wrong types, string responses without a string prompt).
    """
    tools = row.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise DataError(f"{location}: 'tools' must be a list of tool definitions")
    sides = {name: row.get(name) for name in SIDES}
    for name, value in sides.items():
        if value is None:
            raise BadRowError(f"{location}: no {name!r} (keys: {sorted(row)}); {_LAYOUTS}: {FIX}")
    for name, value in sides.items():
        if not isinstance(value, (str, list)):
            raise DataError(f"{location}: {name!r} is a {type(value).__name__}; {_LAYOUTS}")
        if not value:
            raise BadRowError(f"{location}: {name!r} is empty; both responses need content: {FIX}")
    chosen, rejected = sides["chosen"], sides["rejected"]
    prompt = row.get("prompt")
    if prompt is None:
        if isinstance(chosen, str) or isinstance(rejected, str):
            raise DataError(
                f"{location}: string 'chosen'/'rejected' need a 'prompt' string (keys: {sorted(row)}); {_LAYOUTS}"
            )
        if chosen == rejected:
            raise BadRowError(f"{location}: 'chosen' and 'rejected' are identical: nothing to prefer: {FIX}")
        common = _common_prefix(chosen, rejected)
        for name, messages in (("chosen", chosen), ("rejected", rejected)):
            if len(messages) == common:
                raise BadRowError(
                    f"{location}: {name!r} adds no message after the prompt (the messages it shares with the other "
                    f"side); each side needs a response: {FIX}"
                )
        return PreferenceRow(chosen[:common], chosen[common:], rejected[common:], tools)
    if isinstance(prompt, str):
        if not (isinstance(chosen, str) and isinstance(rejected, str)):
            raise DataError(f"{location}: a string 'prompt' needs string 'chosen' and 'rejected'; {_LAYOUTS}")
        user = [{"role": "user", "content": prompt}]
        return PreferenceRow(
            user, [{"role": "assistant", "content": chosen}], [{"role": "assistant", "content": rejected}], tools
        )
    if isinstance(prompt, list):
        if not (isinstance(chosen, list) and isinstance(rejected, list)):
            raise DataError(f"{location}: a message-list 'prompt' needs message lists as responses; {_LAYOUTS}")
        return PreferenceRow(prompt, chosen, rejected, tools)
    raise DataError(f"{location}: 'prompt' is a {type(prompt).__name__}; {_LAYOUTS}")


class PreferenceTokenizeFn(TokenizeFn):
    """Preference pairs: every row yields two samples, chosen then rejected, masked as chat SFT.

    Both sides are encoded by one :class:`~xtl.data.tokenize.ChatTokenizeFn` (same template, same mask rules), the
    prompt's assistant turns with ``"loss": false``: only the response's assistant tokens are supervised.

    Args:
        tokenizer (PreTrainedTokenizerBase): Fast tokenizer carrying the template's special tokens.
        template (str): Chat template (as for ``ChatTokenizeFn``).
        template_kwargs (dict | None): Template overrides (as for ``ChatTokenizeFn``).
        bad_rows (str): ``"error"`` raises :class:`BadRowError` naming the row's ``file:line`` for a row that cannot
            form a pair (a missing or empty side, identical sides, a response without a supervised token, a missing
            or non-numeric margin); ``"drop"`` yields no sample for it.
        margin_key (str | None): The row field holding the pair's margin (a number: reward modelling's
            ``-log sigmoid(r_chosen - r_rejected - margin)``, TRL's ``margin`` column); both samples carry it as their
            tag (``float32``). ``None``: no margin.
        image_processor (ImageProcessorConfig | None): A vision-language model's image settings: the prompts may
            hold image parts (placeholders expanded as :class:`~xtl.data.multimodal.VisionChatTokenizeFn` does).
            ``None``: text only.
        image_root (str | Path | None): Folder of relative image paths (default: the JSONL file's folder).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        template: str = "qwen3",
        template_kwargs: dict[str, Any] | None = None,
        bad_rows: BadRowPolicy = "error",
        margin_key: str | None = None,
        image_processor: ImageProcessorConfig | None = None,
        image_root: str | Path | None = None,
    ) -> None:
        super().__init__(tokenizer)
        if bad_rows not in BAD_ROW_POLICIES:
            raise DataError(f"bad_rows must be 'error' or 'drop', got {bad_rows!r}")
        self.bad_rows = bad_rows
        self.margin_key = margin_key
        if margin_key is not None:
            self.tagged, self.tag_dtype = True, np.float32
        self.images = image_processor is not None
        if image_processor is None:
            self.chat = ChatTokenizeFn(tokenizer, template=template, template_kwargs=template_kwargs)
        else:
            self.chat = VisionChatTokenizeFn(
                tokenizer, image_processor, image_root, template=template, template_kwargs=template_kwargs
            )

    def config(self) -> dict[str, Any]:
        config = {"chat": self.chat.config(), "bad_rows": self.bad_rows}
        if self.margin_key is not None:  # keys of caches without margins stay as they were
            config["margin_key"] = self.margin_key
        return config

    def batch_arrays(self, rows: list[dict[str, Any] | None], locate: Locator) -> list[list[SampleArrays]]:
        out: list[list[SampleArrays]] = [[] for _ in rows]
        bad: dict[int, BadRowError] = {}  # raised for the first bad row in file order (policy "error")
        owners: list[int] = []
        sides: list[dict[str, Any]] = []
        margins: dict[int, float] = {}
        for i, row in enumerate(rows):
            if row is None:
                continue
            try:
                pair = parse_preference_row(row, locate(i))
                self._check_response_images({name: getattr(pair, name) for name in SIDES}, locate(i))
                if self.margin_key is not None:
                    margins[i] = _margin(row, self.margin_key, locate(i))
            except BadRowError as err:
                bad[i] = err
                continue
            for name in SIDES:
                sides.append({"messages": pair.side(name), "tools": pair.tools})
            owners.append(i)
        encoded = self.chat.batch_arrays(sides, lambda j: f"{locate(owners[j // 2])} ({SIDES[j % 2]})")
        for k, i in enumerate(owners):
            (chosen,), (rejected,) = encoded[2 * k], encoded[2 * k + 1]
            problem = _pair_problem(chosen, rejected)
            if problem is None:
                out[i] = [chosen, rejected] if i not in margins else [(*chosen, margins[i]), (*rejected, margins[i])]
            else:
                bad[i] = BadRowError(f"{locate(i)}: {problem}: {FIX}")
        if bad and self.bad_rows == "error":
            raise bad[min(bad)]
        return out

    def image_index(self, row: dict[str, Any], location: str) -> SampleImages:
        """The images of each sample of a row: its prompt's (both samples hold them), paths resolved and grids read
        from the image headers (:func:`~xtl.data.multimodal.load_image_index` calls it per sample).

        Args:
            row (dict): The raw record.
            location (str): ``file:line`` of the record.

        Returns:
            SampleImages: The prompt's images, in order.

        Raises:
            DataError: The function reads no images (no ``image_processor``).
        """
        return self._prompt_images(parse_preference_row(row, location).prompt, location)

    # ---- private ---------------------------------------------------------------------------------------------

    def _prompt_images(self, prompt: list[Any], location: str) -> SampleImages:
        if not isinstance(self.chat, VisionChatTokenizeFn):
            raise DataError(
                f"{location}: image index of a text-only preference tokenize function (no image_processor)"
            )
        return self.chat.expand({"messages": prompt}, location)[1]

    def _check_response_images(self, responses: dict[str, list[Any]], location: str) -> None:
        """Refuse an image in a response: the samples of a row carry their prompt's images only."""
        if not self.images:
            return  # a text model: the chat template refuses any non-string content
        for name, messages in responses.items():
            if holds_image(messages):
                raise DataError(
                    f"{location}: the {name!r} response holds an image part; images go in the prompt (the messages "
                    "before the responses): move it there"
                )

    def _extra_modules(self) -> set[str]:
        if self.images:  # the placeholder expansion's code is part of the cache key too
            return {_templates_module.__name__, VisionChatTokenizeFn.__module__}
        return {_templates_module.__name__}


def holds_image(messages: list[Any] | str) -> bool:
    """Whether any message's content holds an image part (``{"type": "image", ...}``).

    Args:
        messages (list[dict] | str): Messages (a string holds none).

    Returns:
        bool: ``True`` when an image part is found.
    """
    if not isinstance(messages, list):
        return False
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "image" for p in content):
            return True
    return False


def pair_rows(cache: TokenizedCache, where: str | None = None) -> np.ndarray:
    """The source row of every pair of a preference cache entry, checking that it holds whole pairs.

    Args:
        cache (TokenizedCache): An entry built by :class:`PreferenceTokenizeFn`.
        where (str | None): The source, for error messages (default: the entry's source path).

    Returns:
        np.ndarray: int64 ``(num_samples // 2,)``; pair ``k`` is samples ``2k`` (chosen) and ``2k + 1`` (rejected).

    Raises:
        DataError: When samples ``2k`` and ``2k + 1`` do not come from one row (not a preference entry).
    """
    rows = np.asarray(cache.rows, dtype=np.int64)
    where = where or str(cache.meta.get("source_path", cache.directory))
    if len(rows) % 2 or not np.array_equal(rows[0::2], rows[1::2]):
        raise DataError(
            f"{where}: cache entry {cache.directory} does not hold chosen/rejected pairs (two consecutive samples per "
            "row); preference sets need kind: preference on every source"
        )
    return rows[0::2]


def dropped_rows(cache: TokenizedCache) -> int:
    """Rows of a preference source that yielded no pair (skipped under ``bad_rows: drop``).

    Args:
        cache (TokenizedCache): An entry built by :class:`PreferenceTokenizeFn`.

    Returns:
        int: Source rows minus the rows that have a pair in the entry.
    """
    return int(cache.meta["num_rows"]) - len(np.unique(pair_rows(cache)))


def check_pair_plan(plan: PackPlan, num_tokens: np.ndarray | None = None, where: str = "pack plan") -> None:
    """Check that a plan keeps preference pairs whole: in every pack, documents come as samples ``2k``, ``2k + 1``.

    Args:
        plan (PackPlan): A plan over a mixed preference dataset (pair ``k`` = mixed samples ``2k``, ``2k + 1``).
        num_tokens (np.ndarray | None): Tokens per mixed sample, to check that every document is a whole sample.
        where (str): What the plan is, for error messages.

    Raises:
        DataError: A pack with an odd number of documents, a document that is not a whole sample, or documents
            ``2j``, ``2j + 1`` of a pack that are not one pair's chosen then rejected.
    """
    counts = np.diff(np.asarray(plan.pack_offsets, dtype=np.int64))
    odd = np.flatnonzero(counts % 2)
    if len(odd):
        raise DataError(f"{where}: pack {int(odd[0])} holds {int(counts[odd[0]])} documents; packs hold whole pairs")
    sample = np.asarray(plan.seg_sample, dtype=np.int64)
    cut = np.asarray(plan.seg_start) != 0
    if num_tokens is not None:
        cut |= np.asarray(plan.seg_end) != np.asarray(num_tokens, dtype=np.int64)[sample]
    if cut.any():
        raise DataError(f"{where}: sample {int(sample[np.argmax(cut)])} is cut; a preference pair is never cut")
    first, second = sample[0::2], sample[1::2]
    bad = np.flatnonzero((first % 2 != 0) | (second != first + 1))
    if len(bad):
        raise DataError(
            f"{where}: documents {int(first[bad[0]])}, {int(second[bad[0]])} stand where a pair's chosen and rejected "
            "should (samples 2k, 2k + 1); preference packs keep each pair together, chosen first"
        )


def _common_prefix(a: list[Any], b: list[Any]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _pair_problem(chosen: SampleArrays, rejected: SampleArrays) -> str | None:
    if np.array_equal(chosen[0], rejected[0]):
        return "'chosen' and 'rejected' render to the same tokens, so there is nothing to prefer"
    for name, (_, mask) in zip(SIDES, (chosen, rejected)):
        if not mask.any():
            return f"the {name!r} response has no supervised token (no assistant turn with loss)"
    return None


def _margin(row: dict[str, Any], key: str, location: str) -> float:
    """The pair's margin from ``row[key]`` (a finite number)."""
    value = row.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value):
        raise BadRowError(f"{location}: margin field {key!r} is {value!r}, not a number (margin_key: {key}): {FIX}")
    return float(value)
