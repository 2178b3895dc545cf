"""The tokenize function of a source kind: ``text`` (pretraining), ``chat`` (messages), ``vlm_chat`` (images) or
``preference`` (chosen/rejected pairs) or ``unpaired_preference`` (labeled responses, KTO).

A module of its own so that the text tokenize functions (:mod:`xtl.data.tokenize`) and the vision one
(:mod:`xtl.data.multimodal`, built on them) stay below the one place that chooses between them.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

from xtl.data.item import DataError
from xtl.data.multimodal import ImageProcessorConfig, VisionChatTokenizeFn
from xtl.data.preference import PREFERENCE_KIND, PreferenceTokenizeFn
from xtl.data.tokenize import ChatTokenizeFn, PretrainTokenizeFn, TokenizeFn
from xtl.data.unpaired import UNPAIRED_KIND, UnpairedPreferenceTokenizeFn


def build_tokenize_fn(
    kind: str,
    tokenizer: PreTrainedTokenizerBase,
    template: str = "qwen3",
    text_key: str = "text",
    messages_key: str = "messages",
    chunk_size: int | None = None,
    chunk_overlap: int = 0,
    template_kwargs: dict[str, Any] | None = None,
    eos_token: str | None = None,
    image_processor: Any = None,
    image_root: str | None = None,
    bad_rows: str = "error",
    margin_key: str | None = None,
    images: bool = False,
) -> TokenizeFn:
    """Build the tokenize function for a source kind.

    Args:
        kind (str): ``"chat"``, ``"text"``, ``"vlm_chat"`` (chat with image content parts),
            ``"preference"`` or ``"unpaired_preference"``.
        tokenizer (PreTrainedTokenizerBase): Fast tokenizer.
        template (str): Chat template name (chat and preference).
        text_key (str): Text field (text only).
        messages_key (str): Messages field (chat only).
        chunk_size (int | None): Long-document chunking (text only).
        chunk_overlap (int): Chunk overlap (text only).
        template_kwargs (dict | None): Template overrides (chat and preference).
        eos_token (str | None): EOS override (text only).
        image_processor (Any): ``vlm_chat``, and preference kinds with ``images``:
            :class:`xtl.data.multimodal.ImageProcessorConfig` (or its fields).
        image_root (str | None): ``vlm_chat``, and preference kinds with ``images``: folder of relative image paths
            (default: the JSONL's folder).
        bad_rows (str): ``preference`` and ``unpaired_preference`` only: ``"error"`` or ``"drop"`` for rows that
            cannot be used.
        margin_key (str | None): ``preference`` only: the row field holding each pair's margin.
        images (bool): ``preference`` and ``unpaired_preference``: the model reads images, so the prompts may hold
            image parts (a vision-language model).

    Returns:
        TokenizeFn: The function.
    """
    if kind == "text":
        return PretrainTokenizeFn(
            tokenizer, text_key=text_key, chunk_size=chunk_size, chunk_overlap=chunk_overlap, eos_token=eos_token
        )
    if kind == "chat":
        return ChatTokenizeFn(tokenizer, template=template, messages_key=messages_key, template_kwargs=template_kwargs)
    if kind == "vlm_chat":
        settings = ImageProcessorConfig.from_any(image_processor) or ImageProcessorConfig()
        return VisionChatTokenizeFn(
            tokenizer,
            settings,
            image_root=image_root,
            template=template,
            messages_key=messages_key,
            template_kwargs=template_kwargs,
        )
    if kind in (PREFERENCE_KIND, UNPAIRED_KIND):
        settings = (ImageProcessorConfig.from_any(image_processor) or ImageProcessorConfig()) if images else None
        if kind == UNPAIRED_KIND:
            cls, extra = UnpairedPreferenceTokenizeFn, {}
        else:
            cls, extra = PreferenceTokenizeFn, {"margin_key": margin_key}
        return cls(
            tokenizer,
            template=template,
            template_kwargs=template_kwargs,
            bad_rows=bad_rows,  # type: ignore[arg-type]
            image_processor=settings,
            image_root=image_root,
            **extra,
        )
    raise DataError(
        f"unknown source kind {kind!r}; use 'chat' (messages), 'text' (pretraining), 'preference' (chosen/rejected "
        "pairs), 'unpaired_preference' (responses labeled good or bad) or 'vlm_chat'"
    )
