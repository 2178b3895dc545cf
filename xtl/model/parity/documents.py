"""The input of a parity check: :class:`ParityDocuments`, documents of token ids, their shifted labels and, for a
vision-language model, their images (:class:`DocumentImages`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from xtl.batch import SequenceContext
from xtl.ops.cross_entropy import IGNORE_INDEX


@dataclass
class DocumentImages:
    """The images of one document, in order of their placeholders.

    Attributes:
        pixel_values: ``(sum(t*h*w), C * tp * p * p)`` flattened patches of the images.
        grid_thw: ``(n_images, 3)`` patch grid of every image.
    """

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor


@dataclass
class ParityDocuments:
    """The documents one check runs on.

    Attributes:
        input_ids: One 1-D int64 tensor per document.
        labels: Each document's shifted targets (``labels[t]`` is the target of position ``t``; -100: no loss).
        images: Per document its images (``None``: text only); empty for a text model's documents.
    """

    input_ids: list[torch.Tensor]
    labels: list[torch.Tensor]
    images: list[DocumentImages | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.input_ids:
            raise ValueError("a parity check needs at least one document")
        if [t.numel() for t in self.input_ids] != [t.numel() for t in self.labels]:
            raise ValueError("every document needs one label per token")
        if self.images and len(self.images) != len(self.input_ids):
            raise ValueError("images: one entry (or None) per document")

    @classmethod
    def from_packed(
        cls,
        seq_ctx: SequenceContext,
        labels: torch.Tensor,
        max_tokens: int | None = None,
        image_token_id: int | None = None,
        spatial_merge_size: int = 1,
    ) -> ParityDocuments:
        """The documents of a packed micro-batch: trailing padding dropped, cut after ``max_tokens`` tokens.

        A vision pack's images (``seq_ctx.extras``: ``pixel_values``, ``image_grid_thw``, in order of appearance)
        go to the documents whose ``image_token_id`` placeholders they fill (an image is ``t*h*w /
        spatial_merge_size**2`` placeholders); a cut never splits an image: it moves back to the image's first
        placeholder.

        Args:
            seq_ctx: The packed batch (``input_ids`` ``(1, T)``, ``cu_seq_lens``, ``num_padding``, ``extras``).
            labels: Its shifted labels ``(1, T)``.
            max_tokens: Keep at most this many tokens (a cut document loses its last target).
            image_token_id: Id of the image placeholder (needed when the pack has images).
            spatial_merge_size: Patches merged into one placeholder per side.
        """
        if seq_ctx.input_ids is None:
            raise ValueError("a parity check needs token ids, not inputs_embeds")
        ids, targets = seq_ctx.input_ids.reshape(-1).cpu(), labels.reshape(-1).cpu()
        bounds = seq_ctx.cu_seq_lens.tolist()
        limit = bounds[-1] - seq_ctx.num_padding
        if max_tokens is not None:
            limit = min(limit, max_tokens)
        pixels = seq_ctx.extras.get("pixel_values") if seq_ctx.extras else None
        if pixels is not None and image_token_id is None:
            raise ValueError("the pack has images: pass its image_token_id")
        images = _PackImages(seq_ctx.extras, spatial_merge_size) if pixels is not None else None
        docs, doc_labels, doc_images = [], [], []
        for start, end in zip(bounds[:-1], bounds[1:]):
            if images is not None:
                end = images.uncut_end(ids, start, min(end, limit), end, image_token_id)
            end = min(end, limit)
            if end <= start:
                break
            docs.append(ids[start:end].clone())
            doc_labels.append(targets[start:end].clone())
            doc_labels[-1][-1] = IGNORE_INDEX  # the target after a document's (or the cut's) last token is unseen
            if images is not None:
                doc_images.append(images.take(int((docs[-1] == image_token_id).sum())))
        return cls(docs, doc_labels, doc_images if any(im is not None for im in doc_images) else [])

    @classmethod
    def from_token_lists(cls, documents: Sequence[Sequence[int]], max_tokens: int | None = None) -> ParityDocuments:
        """Documents of token ids, every next token supervised, cut after ``max_tokens`` tokens in all."""
        ids: list[torch.Tensor] = []
        left = math.inf if max_tokens is None else max_tokens
        for doc in documents:
            doc = list(doc)[: int(min(left, len(doc)))]
            if doc:
                ids.append(torch.tensor(doc, dtype=torch.long))
                left -= len(doc)
            if left <= 0:
                break
        return cls(ids, [_next_token_labels(t) for t in ids])

    @classmethod
    def random(cls, vocab_size: int, num_tokens: int, num_documents: int = 2, seed: int = 0) -> ParityDocuments:
        """``num_documents`` documents of uniformly random token ids, ``num_tokens`` in all."""
        if num_tokens < num_documents or num_documents < 1:
            raise ValueError(f"cannot split {num_tokens} tokens into {num_documents} documents")
        generator = torch.Generator().manual_seed(seed)
        sizes = [num_tokens // num_documents + (i < num_tokens % num_documents) for i in range(num_documents)]
        ids = [torch.randint(0, vocab_size, (n,), generator=generator) for n in sizes]
        return cls(ids, [_next_token_labels(t) for t in ids])

    def with_probe_image(self, config: Any, seed: int = 0) -> ParityDocuments:
        """These documents and one more: text, one random ``(1, 2m, 3m)``-patch image, text (``m``: the merge size).

        The probe puts a vision-language model's vision tower into a check whose documents have no image.

        Args:
            config: The xtl vision-language config (``image_token_id``, ``vision_start_token_id``,
                ``vision_end_token_id``, ``vocab_size``, ``vision_config``).
            seed: Seed of the pixels and the text tokens.
        """
        vision = config.vision_config
        merge = vision.spatial_merge_size
        grid = torch.tensor([[1, 2 * merge, 3 * merge]])
        patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        generator = torch.Generator().manual_seed(seed)
        pixel_values = torch.randn(int(grid.prod()), patch, generator=generator)
        specials = {config.image_token_id, config.vision_start_token_id, config.vision_end_token_id}
        words = torch.tensor([t for t in range(config.vocab_size) if t not in specials])
        text = words[torch.randint(0, len(words), (6,), generator=generator)].tolist()
        image = [config.vision_start_token_id, *[config.image_token_id] * 6, config.vision_end_token_id]
        ids = torch.tensor([*text[:3], *image, *text[3:]], dtype=torch.long)
        images = self.images or [None] * len(self.input_ids)
        return ParityDocuments(
            [*self.input_ids, ids],
            [*self.labels, _next_token_labels(ids)],
            [*images, DocumentImages(pixel_values, grid)],
        )

    @property
    def has_images(self) -> bool:
        """Some document has an image."""
        return self.num_images > 0

    @property
    def num_images(self) -> int:
        """Images in all documents."""
        return sum(len(im.grid_thw) for im in self.images if im is not None)

    @property
    def lengths(self) -> list[int]:
        """Tokens per document."""
        return [t.numel() for t in self.input_ids]

    @property
    def num_tokens(self) -> int:
        """Tokens in all documents."""
        return sum(self.lengths)

    @property
    def num_supervised(self) -> int:
        """Supervised targets in all documents."""
        return sum(int((t != IGNORE_INDEX).sum()) for t in self.labels)

    def max_token_id(self) -> int:
        """The largest token id (to check it against a vocabulary)."""
        return max(int(t.max()) for t in self.input_ids)


class _PackImages:
    """The images of a pack, handed out in order to its documents."""

    def __init__(self, extras: dict[str, torch.Tensor], merge: int) -> None:
        self.pixel_values = extras["pixel_values"].cpu()
        self.grid = extras["image_grid_thw"].cpu()
        self.tokens = [t * h * w // merge**2 for t, h, w in self.grid.tolist()]
        self.next = 0  # the next image to hand out
        self.row = 0  # its first pixel row

    def uncut_end(self, ids: torch.Tensor, start: int, cut: int, end: int, image_token_id: int) -> int:
        """``end``, or ``cut`` moved back to the first placeholder of the image it would split."""
        if cut >= end:
            return end
        placeholders = (ids[start:cut] == image_token_id).nonzero().reshape(-1).tolist()
        position, image, left = start, self.next, 0  # walk the document's images to the one the cut falls in
        for index in placeholders:
            if left == 0:  # the first placeholder of the next image (more placeholders than images: take raises)
                position, left = start + index, self.tokens[image] if image < len(self.tokens) else 1
                image += 1
            left -= 1
        return position if left else cut

    def take(self, placeholders: int) -> DocumentImages | None:
        """The next images, ``placeholders`` placeholders in all (``None`` for none)."""
        first, count = self.next, 0
        while count < placeholders:
            if self.next >= len(self.tokens):
                raise ValueError(f"the pack's image_grid_thw has fewer images than its {placeholders} placeholders")
            count, self.next = count + self.tokens[self.next], self.next + 1
        if count != placeholders:
            raise ValueError(f"{placeholders} image placeholders do not fill whole images of the pack")
        if first == self.next:
            return None
        rows = sum(int(t * h * w) for t, h, w in self.grid[first : self.next].tolist())
        pixels = self.pixel_values[self.row : self.row + rows].clone()
        self.row += rows
        return DocumentImages(pixels, self.grid[first : self.next].clone())


def _next_token_labels(ids: torch.Tensor) -> torch.Tensor:
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[:-1] = ids[1:]
    return labels
