"""Images in RL prompts (vision-language policies): the placeholders a prompt is rendered with and the pixels its
rollouts and updates feed the vision tower.

A prompt row with images (``kind: prompt`` sources, :mod:`xtl.data.prompts`) keeps its ``{"type": "image", "image":
path}`` parts, paths resolved, and lists them under ``images``. :class:`PromptVision` does what the SFT path does with
the same code (:class:`~xtl.data.multimodal.VisionChatTokenizeFn`): each image part becomes ``<|vision_start|>`` + N x
``<|image_pad|>`` + ``<|vision_end|>`` in the rendered text (N from the image's size and the image settings), and the
image processor turns the files into :class:`PromptImages` (``pixel_values``, ``image_grid_thw``). A sample keeps the
paths of its prompt's images: every forward of its tokens (the rollout's prefill, a continued partial rollout, the
next turn of a tool loop, the old, reference and policy log-probabilities of the update) sees the same images.

Under sharded parameters every rank must run the vision tower in the same forwards (its blocks gather their
parameters from every rank, forward and backward). A forward whose sequences hold no image (an idle rank's filler, an
empty micro-batch, text prompts) then carries :meth:`PromptVision.filler`: a document of one blank image that nothing
reads or scores.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from xtl.data.multimodal import IMAGE_TOKEN, ImageProcessorConfig, VisionChatTokenizeFn, load_image
from xtl.data.templates import TEMPLATES


@dataclass(frozen=True)
class PromptImages:
    """The processed images of one prompt, in order of appearance.

    Attributes:
        paths: The image files.
        pixel_values: ``(patches, C * temporal_patch * patch * patch)`` of every image, concatenated.
        image_grid_thw: ``(images, 3)`` patch grid of each image.
    """

    paths: tuple[str, ...]
    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor

    @property
    def inputs(self) -> dict[str, torch.Tensor]:
        """What the model reads with the prompt's ids (``pixel_values``, ``image_grid_thw``)."""
        return {"pixel_values": self.pixel_values, "image_grid_thw": self.image_grid_thw}


def concat_images(images: Sequence[PromptImages | None]) -> dict[str, torch.Tensor]:
    """The images of several sequences laid end to end (a pack, a prefill), in order (``{}``: none has images)."""
    present = [entry for entry in images if entry is not None]
    if not present:
        return {}
    return {
        "pixel_values": torch.cat([entry.pixel_values for entry in present]),
        "image_grid_thw": torch.cat([entry.image_grid_thw for entry in present]),
    }


class PromptVision:
    """Placeholders and pixels of prompt images for one tokenizer and image settings.

    Args:
        tokenizer: The tokenizer with the vision tokens.
        settings: The image settings (``data.image_processor``).
        template: The run's built-in template (``None`` or ``hf``: the tokenizer's own); the expansion renders no
            template, this only names one the tokenizer has the tokens of.
        cache_size: Prompts whose processed images are kept (a group's completions and the update that trains them
            read the same prompt's images).

    Raises:
        DataError: The tokenizer lacks the vision tokens.
    """

    def __init__(
        self, tokenizer: Any, settings: ImageProcessorConfig, template: str | None = None, cache_size: int = 256
    ) -> None:
        self.settings = settings
        known = template if template in TEMPLATES else "chatml"  # a template whose tokens the tokenizer has
        self.expander = VisionChatTokenizeFn(tokenizer, settings, template=known)
        self.image_token_id = int(tokenizer.convert_tokens_to_ids(IMAGE_TOKEN))
        self._filler: tuple[list[int], PromptImages] | None = None
        self.cache_size = cache_size
        self._processor: Any = None
        self._cache: OrderedDict[tuple[str, ...], PromptImages] = OrderedDict()
        self._lock = threading.Lock()  # an asynchronous producer and the evaluation may ask at once

    def text_messages(self, messages: list[dict[str, Any]], where: str = "<prompt>") -> list[dict[str, Any]]:
        """``messages`` with every image part replaced by its placeholder text (contents as strings).

        Raises:
            DataError: An image that is missing or unreadable, a content part that is neither text nor an image.
        """
        if not any(isinstance(m.get("content"), list) for m in messages):
            return messages
        return self.expander.expand({"messages": messages}, where)[0]["messages"]

    def images(self, paths: Sequence[str] | None, where: str = "<prompt>") -> PromptImages | None:
        """The processed images of ``paths`` (``None`` for none), kept for the next calls with the same paths.

        Raises:
            DataError: An image that is missing or unreadable.
        """
        if not paths:
            return None
        key = tuple(paths)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            if self._processor is None:
                self._processor = self.settings.build()
            out = self._processor(images=[load_image(path, where) for path in key], return_tensors="pt")
            entry = PromptImages(key, out["pixel_values"], out["image_grid_thw"])
            self._cache[key] = entry
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return entry

    def filler(self) -> tuple[list[int], PromptImages]:
        """A document of one blank image (the smallest grid: one placeholder token) and its pixels: what a sharded
        forward without images carries so that every rank runs the vision tower (module docstring)."""
        if self._filler is None:
            settings = self.settings
            grid = (1, settings.merge_size, settings.merge_size)
            width = 3 * settings.temporal_patch_size * settings.patch_size**2
            start, pad, end = (int(t) for t in self.expander.vision_ids)
            pixels = torch.zeros(grid[1] * grid[2], width)
            ids = [start, *[pad] * settings.num_tokens(grid), end]
            self._filler = (ids, PromptImages((), pixels, torch.tensor([grid])))
        return self._filler


def collapse_placeholders(ids: Sequence[int], image_token_id: int) -> list[int]:
    """``ids`` with each run of ``image_token_id`` cut to one token: a prompt as an engine that expands the
    placeholders against the images itself (vLLM) expects it."""
    out: list[int] = []
    for token in ids:
        if token == image_token_id and out and out[-1] == image_token_id:
            continue
        out.append(int(token))
    return out


__all__ = ["PromptImages", "PromptVision", "collapse_placeholders", "concat_images"]
