"""Unpaired preference data (KTO): ``kind: unpaired_preference`` rows are one response judged good or bad.

A row is one of (TRL's unpaired preference layouts):

- conversational: ``{"prompt": [messages], "completion": [messages], "label": true}``;
- standard (strings): ``{"prompt": "...", "completion": "...", "label": false}``: the prompt becomes one user
  message, the completion one assistant message;
- a preference pair (:mod:`xtl.data.preference`, any of its layouts) is unpaired, as TRL does: its chosen response
  becomes a desirable row (``label: true``), its rejected one an undesirable row.

``label`` is ``true`` for a desirable completion and ``false`` for an undesirable one. KTO compares each completion
with a reference point, an estimate of the KL divergence between the policy and the reference model, made from
*mismatched* prompt and completion pairs: each row's prompt with the completion of the row before it (TRL rotates the
completions by one within a batch; here within each block of rows tokenized together, the first row taking the
block's last). So every row yields two samples kept together as a pair: its own prompt and completion (the sample
the loss trains) and the mismatched one (only read for the KL estimate), both tagged with the row's label (the
cache's ``tags.npy``). Pairs pack, mix and split as preference pairs do (``pairs=True``): a micro-batch holds
documents matched, mismatched, matched, mismatched, ... and :attr:`xtl.data.collate.MicroBatch.doc_tags` their
labels.

Images: for a vision-language model the prompts may hold image parts, as in preference rows
(:mod:`xtl.data.preference`); both samples of a row (its own and its mismatched completion) hold the row's prompt,
so each carries its own copy of the prompt's images. A completion that holds an image is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from xtl.data.item import DataError
from xtl.data.multimodal import SampleImages
from xtl.data.preference import FIX, BadRowError, PreferenceTokenizeFn, parse_preference_row, unsupervised_prompt
from xtl.data.tokenize import Locator, SampleArrays

UNPAIRED_KIND = "unpaired_preference"
SIDES = ("matched", "mismatched")

_LAYOUTS = (
    "unpaired preference rows need {'prompt': [messages], 'completion': [messages], 'label': true|false}, "
    "'prompt' and 'completion' strings with a 'label', or a preference pair ('chosen' and 'rejected')"
)


@dataclass
class UnpairedRow:
    """One judged response in message form.

    Attributes:
        prompt (list[dict]): Messages before the response.
        completion (list[dict]): The response (one or more messages).
        label (bool): ``True``: desirable; ``False``: undesirable.
        tools (list | None): Tool definitions of the row.
    """

    prompt: list[Any]
    completion: list[Any]
    label: bool
    tools: list[Any] | None = None


def parse_unpaired_row(row: dict[str, Any], location: str = "<row>") -> list[UnpairedRow]:
    """Read an unpaired preference row in any of its layouts (module docstring).

    Args:
        row (dict): The raw record.
        location (str): ``file:line`` of the record, for error messages.

    Returns:
        list[UnpairedRow]: One row; two (chosen desirable, rejected undesirable) for a preference pair.

    Raises:
        BadRowError: A missing or empty prompt or completion, or a label that is not ``true``/``false``.
        DataError: A row in none of the layouts (wrong types).
    """
    if "chosen" in row or "rejected" in row:
        pair = parse_preference_row(row, location)
        return [
            UnpairedRow(pair.prompt, pair.chosen, True, pair.tools),
            UnpairedRow(pair.prompt, pair.rejected, False, pair.tools),
        ]
    tools = row.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise DataError(f"{location}: 'tools' must be a list of tool definitions")
    for name in ("prompt", "completion", "label"):
        if row.get(name) is None:
            raise BadRowError(f"{location}: no {name!r} (keys: {sorted(row)}); {_LAYOUTS}: {FIX}")
    prompt, completion, label = row["prompt"], row["completion"], row["label"]
    if not isinstance(label, bool):
        raise BadRowError(f"{location}: 'label' is {label!r}; it must be true (desirable) or false: {FIX}")
    if isinstance(prompt, str) and isinstance(completion, str):
        prompt, completion = [{"role": "user", "content": prompt}], [{"role": "assistant", "content": completion}]
    elif not (isinstance(prompt, list) and isinstance(completion, list)):
        raise DataError(
            f"{location}: 'prompt' is a {type(prompt).__name__} and 'completion' a {type(completion).__name__}; "
            f"{_LAYOUTS}"
        )
    if not completion:
        raise BadRowError(f"{location}: 'completion' is empty; the row needs a response: {FIX}")
    return [UnpairedRow(prompt, completion, label, tools)]


class UnpairedPreferenceTokenizeFn(PreferenceTokenizeFn):
    """Unpaired preference rows: each yields its matched sample and its mismatched (KL) sample, tagged with its label.

    The settings are :class:`~xtl.data.preference.PreferenceTokenizeFn`'s. Both samples are encoded by one
    :class:`~xtl.data.tokenize.ChatTokenizeFn` (same template, same mask rules), the prompt's assistant turns with
    ``"loss": false``: only the completion's assistant tokens are supervised. The mismatched sample is the row's
    prompt with the completion of the previous row of the same tokenize call that is kept (the first row takes the
    last row's; a call with one row pairs it with its own completion).

    Args:
        tokenizer (PreTrainedTokenizerBase): Fast tokenizer carrying the template's special tokens.
        template (str): Chat template (as for ``ChatTokenizeFn``).
        template_kwargs (dict | None): Template overrides (as for ``ChatTokenizeFn``).
        bad_rows (str): ``"error"`` raises :class:`~xtl.data.preference.BadRowError` naming the row's ``file:line``
            for a row that cannot be used (a missing or empty prompt or completion, a label that is not a boolean, a
            completion without a supervised token); ``"drop"`` yields no sample for it.
        image_processor (ImageProcessorConfig | None): A vision-language model's image settings: the prompts may
            hold image parts. ``None``: text only.
        image_root (str | Path | None): Folder of relative image paths (default: the JSONL file's folder).
    """

    tagged = True

    def batch_arrays(self, rows: list[dict[str, Any] | None], locate: Locator) -> list[list[SampleArrays]]:
        out: list[list[SampleArrays]] = [[] for _ in rows]
        bad: dict[int, BadRowError] = {}  # raised for the first bad row in file order (policy "error")
        items: list[tuple[int, UnpairedRow]] = []
        for i, row in enumerate(rows):
            if row is None:
                continue
            try:
                parsed = parse_unpaired_row(row, locate(i))
            except BadRowError as err:
                bad[i] = err
                continue
            names = ("chosen", "rejected") if len(parsed) == 2 else ("completion",)  # a pair, or one row
            self._check_response_images({n: it.completion for n, it in zip(names, parsed)}, locate(i))
            items.extend((i, item) for item in parsed)
        own = self.chat.batch_arrays(
            [{"messages": unsupervised_prompt(it.prompt) + list(it.completion), "tools": it.tools} for _, it in items],
            lambda j: f"{locate(items[j][0])} ({SIDES[0]})",
        )
        for (i, _), (matched,) in zip(items, own):
            if not matched[1].any():
                bad[i] = BadRowError(f"{locate(i)}: the completion has no supervised token (no assistant turn): {FIX}")
        kept = [k for k, (i, _) in enumerate(items) if i not in bad]
        mismatched = self.chat.batch_arrays(  # each row's prompt with the completion of the row kept before it
            [
                {
                    "messages": unsupervised_prompt(items[k][1].prompt) + list(items[kept[n - 1]][1].completion),
                    "tools": items[k][1].tools,
                }
                for n, k in enumerate(kept)
            ],  # fmt: skip
            lambda n: f"{locate(items[kept[n]][0])} ({SIDES[1]})",
        )
        for k, (other,) in zip(kept, mismatched):
            i, item = items[k]
            (matched,) = own[k]
            tag = int(item.label)
            out[i] += [(matched[0], matched[1], tag), (other[0], other[1], tag)]
        for i in bad:
            out[i] = []
        if bad and self.bad_rows == "error":
            raise bad[min(bad)]
        return out

    def image_index(self, row: dict[str, Any], location: str) -> SampleImages:
        """The images of each sample of a row: its prompt's (its own and its mismatched sample hold them; a
        preference pair's two rows share the prompt).

        Args:
            row (dict): The raw record.
            location (str): ``file:line`` of the record.

        Returns:
            SampleImages: The prompt's images, in order.

        Raises:
            DataError: The function reads no images (no ``image_processor``).
        """
        return self._prompt_images(parse_unpaired_row(row, location)[0].prompt, location)


def row_labels(tags: np.ndarray | None) -> np.ndarray:
    """The label of every pair of an unpaired preference set from its per-sample tags (``True``: desirable).

    Args:
        tags (np.ndarray | None): Per-sample tags of a mixed unpaired set (samples ``2k``, ``2k + 1`` are pair ``k``).

    Returns:
        np.ndarray: bool ``(num_pairs,)``.
    """
    return np.zeros(0, dtype=bool) if tags is None else np.asarray(tags[0::2], dtype=bool)
