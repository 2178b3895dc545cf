"""Images in chat data (Qwen-VL style): placeholder expansion, the image sidecar, and image loading in workers.

A record's message ``content`` may be a list of parts, as in transformers' chat format::

    {"messages": [{"role": "user", "content": [{"type": "image", "image": "shapes/0001.png"},
                                              {"type": "text", "text": "What color is the square?"}]},
                  {"role": "assistant", "content": "red"}]}

- Tokenization (:class:`VisionChatTokenizeFn`) reads only the image *header* (its size), computes the patch grid
  the image processor will produce (``smart_resize`` with ``min_pixels`` / ``max_pixels``) and writes
  ``<|vision_start|>`` + ``num_tokens`` x ``<|image_pad|>`` + ``<|vision_end|>`` in place of each image. Image tokens
  are never supervised. The cache stores token ids only; pixels are never cached.
- The sidecar ``images.json`` in the cache entry (:func:`load_image_index`) lists, per sample, its ``file:line``
  and its images (absolute path and grid ``(t, h, w)``), so a warm start opens no image.
- :class:`VisionPackedDataset` wraps a :class:`~xtl.data.packing.PackedDataset`: its ``__getitem__`` (run in the
  dataloader workers) loads and processes the images of every document of a pack, in order, and returns a
  :class:`VisionPack` whose ``extras`` (``pixel_values``, ``image_grid_thw``) collate puts into
  ``SequenceContext.extras``. An image is never split: a document cut inside an image raises :class:`DataError`.

Relative image paths are relative to the folder of the JSONL file. A missing or unreadable image raises
:class:`DataError` naming ``file:line`` and the image path.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from xtl.data.item import DataError
from xtl.data.packing import Pack, PackedDataset
from xtl.data.tokenize import ChatTokenizeFn, Locator, SampleArrays
from xtl.utils import atomic_write_bytes

IMAGE_TOKEN = "<|image_pad|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
SIDECAR = "images.json"


@dataclass
class ImageProcessorConfig:
    """Settings of the Qwen2/3-VL image processor (transformers' ``Qwen2VLImageProcessorPil``, no torchvision).

    Attributes:
        patch_size: Vision patch size in pixels (Qwen3-VL: 16, Qwen2/2.5-VL: 14).
        merge_size: Spatial merge size (patches per LM token along each axis).
        temporal_patch_size: Frames per temporal patch (an image is repeated).
        min_pixels: Smallest ``height * width`` after resizing.
        max_pixels: Largest ``height * width`` after resizing.
        image_mean: Normalization mean (``None``: the processor default).
        image_std: Normalization std (``None``: the processor default).
    """

    patch_size: int = 16
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 64 * 64
    max_pixels: int = 1024 * 1024
    image_mean: list[float] | None = None
    image_std: list[float] | None = None

    def __post_init__(self) -> None:
        if self.min_pixels > self.max_pixels:
            raise DataError(f"image_processor: min_pixels {self.min_pixels} > max_pixels {self.max_pixels}")

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this (``patch_size * merge_size``)."""
        return self.patch_size * self.merge_size

    def grid(self, height: int, width: int) -> tuple[int, int, int]:
        """The ``(t, h, w)`` patch grid of an image of ``height x width`` pixels.

        Args:
            height: Image height.
            width: Image width.

        Returns:
            tuple[int, int, int]: Grid in patches (``t`` is 1 for an image).
        """
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        h, w = smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)
        return 1, h // self.patch_size, w // self.patch_size

    def num_tokens(self, grid: tuple[int, int, int] | list[int]) -> int:
        """LM placeholder tokens of an image with patch grid ``grid``."""
        t, h, w = grid
        return t * h * w // (self.merge_size**2)

    def build(self) -> Any:
        """The transformers image processor (``Qwen2VLImageProcessorPil``) with these settings."""
        from transformers import Qwen2VLImageProcessorPil

        kwargs: dict[str, Any] = {
            "patch_size": self.patch_size,
            "merge_size": self.merge_size,
            "temporal_patch_size": self.temporal_patch_size,
            "size": {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels},
        }
        if self.image_mean is not None:
            kwargs["image_mean"] = list(self.image_mean)
        if self.image_std is not None:
            kwargs["image_std"] = list(self.image_std)
        return Qwen2VLImageProcessorPil(**kwargs)

    @classmethod
    def from_any(cls, value: ImageProcessorConfig | dict[str, Any] | None) -> ImageProcessorConfig | None:
        """Accept a config, a mapping of its fields (YAML), or ``None``."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            try:
                return cls(**value)
            except TypeError as exc:
                raise DataError(f"image_processor: {exc}; fields: {[f for f in asdict(cls())]}") from None
        raise DataError(f"image_processor must be a mapping of {cls.__name__} fields, got {type(value).__name__}")


@dataclass
class ImageRef:
    """One image of a sample: its resolved path and patch grid."""

    path: str
    grid: tuple[int, int, int]


@dataclass
class SampleImages:
    """The images of one sample and where the sample comes from (``file:line``)."""

    where: str
    images: list[ImageRef] = field(default_factory=list)


class VisionChatTokenizeFn(ChatTokenizeFn):
    """Chat records whose message contents may hold images (``{"type": "image", "image": path}`` parts).

    Each image becomes ``<|vision_start|>`` + N x ``<|image_pad|>`` + ``<|vision_end|>`` in the rendered text
    (N = the merged patch count of the resized image); text parts are concatenated in order. Image tokens are
    never supervised. Everything else is :class:`~xtl.data.tokenize.ChatTokenizeFn`.

    Args:
        tokenizer: Fast tokenizer with the three vision tokens.
        image_processor: Resizing settings (decide the placeholder count).
        image_root: Folder that relative image paths are relative to (default: the JSONL file's folder, from the
            record location).
        template: Chat template name.
        messages_key: Field holding the messages.
        template_kwargs: Template overrides.
    """

    def __init__(
        self,
        tokenizer: Any,
        image_processor: ImageProcessorConfig,
        image_root: str | Path | None = None,
        template: str = "qwen3",
        messages_key: str = "messages",
        template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(tokenizer, template=template, messages_key=messages_key, template_kwargs=template_kwargs)
        vocab = tokenizer.get_added_vocab()
        missing = [t for t in (VISION_START, IMAGE_TOKEN, VISION_END) if t not in vocab]
        if missing:
            raise DataError(
                f"the tokenizer lacks the vision tokens {missing}; image chat data needs a Qwen-VL tokenizer "
                "(or add them as special tokens)"
            )
        self.image_processor = image_processor
        self.image_root = None if image_root is None else str(Path(image_root).resolve())
        self.vision_ids = np.asarray([vocab[t] for t in (VISION_START, IMAGE_TOKEN, VISION_END)], dtype=np.int64)
        self.image_token_id = int(vocab[IMAGE_TOKEN])

    def config(self) -> dict[str, Any]:
        return {**super().config(), "image_processor": asdict(self.image_processor), "image_root": self.image_root}

    def batch_arrays(self, rows: list[dict[str, Any] | None], locate: Locator) -> list[list[SampleArrays]]:
        flat, counts = [], []
        for i, row in enumerate(rows):
            if row is None:
                flat.append(None)
                counts.append(0)
                continue
            text_row, images = self.expand(row, locate(i))
            flat.append(text_row)
            counts.append(sum(self.image_processor.num_tokens(im.grid) for im in images.images))
        out = super().batch_arrays(flat, locate)
        for i, samples in enumerate(out):
            for ids, mask in samples:
                found = int((ids == self.image_token_id).sum())
                if found != counts[i]:
                    raise DataError(
                        f"{locate(i)}: {found} {IMAGE_TOKEN} tokens after tokenization but the images need "
                        f"{counts[i]}; do not write {IMAGE_TOKEN} in the text, use an image content part"
                    )
                mask &= ~np.isin(ids, self.vision_ids)
        return out

    def expand(self, row: dict[str, Any], location: str) -> tuple[dict[str, Any], SampleImages]:
        """Replace image parts by placeholder text; return the text-only record and the sample's images.

        Args:
            row: The record.
            location: ``file:line`` of the record.

        Returns:
            tuple[dict, SampleImages]: The record with string contents, and its images in order.
        """
        messages = row.get(self.messages_key)
        images = SampleImages(location)
        if not isinstance(messages, list):
            return row, images  # ChatTokenizeFn reports the problem
        new_messages = []
        for m in messages:
            if isinstance(m, dict) and isinstance(m.get("content"), list):
                m = {**m, "content": self._content_text(m["content"], location, images)}
            new_messages.append(m)
        return {**row, self.messages_key: new_messages}, images

    def encode(self, row: dict[str, Any], location: str = "<row>", add_generation_prompt: bool = False) -> Any:
        """Render and tokenize one record with its image placeholders (e.g. a prompt for generation).

        Args:
            row: Record with ``messages``.
            location: Record location for error messages.
            add_generation_prompt: Append the (masked) assistant header.

        Returns:
            DataItem: Ids and labels (image tokens unsupervised).
        """
        text_row, _ = self.expand(row, location)
        item = super().encode(text_row, location, add_generation_prompt)
        item["labels"] = [-100 if t in self.vision_ids else lab for t, lab in zip(item["input_ids"], item["labels"])]
        return item

    def image_index(self, row: dict[str, Any], location: str) -> SampleImages:
        """The images of one record (paths resolved, grids from the image headers)."""
        return self.expand(row, location)[1]

    def _content_text(self, parts: list[Any], location: str, images: SampleImages) -> str:
        pieces = []
        for part in parts:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                pieces.append(str(part.get("text", "")))
            elif kind == "image":
                ref = self._image_ref(part.get("image", part.get("path")), location)
                images.images.append(ref)
                n = self.image_processor.num_tokens(ref.grid)
                pieces.append(VISION_START + IMAGE_TOKEN * n + VISION_END)
            else:
                raise DataError(
                    f"{location}: content part {part!r} is not {{'type': 'text', 'text': ...}} or "
                    "{'type': 'image', 'image': path}"
                )
        return "".join(pieces)

    def _image_ref(self, value: Any, location: str) -> ImageRef:
        if not isinstance(value, str) or not value:
            raise DataError(f"{location}: an image part needs 'image': a file path, got {value!r}")
        path = Path(value).expanduser()
        if not path.is_absolute():
            root = Path(self.image_root) if self.image_root else Path(location.rsplit(":", 1)[0]).parent
            path = root / path
        width, height = read_image_size(path, location)
        return ImageRef(str(path), self.image_processor.grid(height, width))


def read_image_size(path: Path, location: str) -> tuple[int, int]:
    """``(width, height)`` from the image header.

    Raises:
        DataError: The file is missing or not an image (message names ``location`` and ``path``).
    """
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            return image.size
    except FileNotFoundError:
        raise DataError(
            f"{location}: image {path} does not exist; fix the path (relative to the JSONL file)"
        ) from None
    except (UnidentifiedImageError, OSError) as exc:
        raise DataError(f"{location}: cannot read image {path}: {exc}") from None


def load_image(path: str | Path, location: str) -> Any:
    """Decode an image as RGB (``PIL.Image``).

    Raises:
        DataError: The file is missing or unreadable (message names ``location`` and ``path``).
    """
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except FileNotFoundError:
        raise DataError(f"{location}: image {path} does not exist (it existed when the cache was built)") from None
    except (UnidentifiedImageError, OSError) as exc:
        raise DataError(f"{location}: cannot read image {path}: {exc}") from None


def load_image_index(cache: Any, source: Any, fn: VisionChatTokenizeFn) -> list[SampleImages]:
    """Per sample of ``cache``, its location and images; read from (or written to) the sidecar ``images.json``.

    Args:
        cache: The loaded :class:`~xtl.data.cache.TokenizedCache` (its ``rows`` map samples to source rows).
        source: The source the cache was built from.
        fn: The tokenize function that built it.

    Returns:
        list[SampleImages]: One entry per sample.
    """
    sidecar = Path(cache.directory) / SIDECAR
    if sidecar.is_file():
        raw = json.loads(sidecar.read_text(encoding="utf-8"))
        return [SampleImages(w, [ImageRef(p, tuple(g)) for p, g in ims]) for w, ims in raw]
    index = []
    for row_index in np.asarray(cache.rows).tolist():
        row = source.rows(row_index, row_index + 1)[0]
        where = source.location(row_index)
        index.append(fn.image_index(row, where) if row is not None else SampleImages(where))
    data = [[s.where, [[im.path, list(im.grid)] for im in s.images]] for s in index]
    atomic_write_bytes(sidecar, json.dumps(data).encode("utf-8"))
    return index


@dataclass
class VisionPack(Pack):
    """A pack with the processed images of its documents (``extras``: ``pixel_values``, ``image_grid_thw``)."""

    extras: dict[str, torch.Tensor] = field(default_factory=dict)


class VisionPackedDataset:
    """Packs with images: loads and processes every image of a pack (in the dataloader worker that reads it).

    Args:
        packs: The text packs.
        indexes: Per source of the mix, :func:`load_image_index` of its cache.
        image_processor: Processor settings.
        image_token_id: Id of ``<|image_pad|>``.
    """

    def __init__(
        self,
        packs: PackedDataset,
        indexes: list[list[SampleImages]],
        image_processor: ImageProcessorConfig,
        image_token_id: int,
    ) -> None:
        self.packs = packs
        self.indexes = indexes
        self.settings = image_processor
        self.image_token_id = image_token_id
        self._processor: Any = None

    def __len__(self) -> int:
        return len(self.packs)

    @property
    def plan(self) -> Any:
        """The pack plan of the wrapped dataset."""
        return self.packs.plan

    def __getitem__(self, index: int) -> VisionPack:
        pack = self.packs[index]
        plan, data = self.packs.plan, self.packs.data
        refs: list[tuple[ImageRef, str]] = []
        for s in range(int(plan.pack_offsets[index]), int(plan.pack_offsets[index + 1])):
            sample = int(plan.seg_sample[s])
            entry = self.indexes[int(data.source_ids[sample])][int(data.sample_ids[sample])]
            if not entry.images:
                continue
            start, end = int(plan.seg_start[s]), int(plan.seg_end[s])
            refs.extend((im, entry.where) for im in self._images_in(sample, start, end, entry))
        extras: dict[str, torch.Tensor] = {}
        if refs:
            if self._processor is None:
                self._processor = self.settings.build()
            images = [load_image(ref.path, where) for ref, where in refs]
            out = self._processor(images=images, return_tensors="pt")
            grid = out["image_grid_thw"]
            for (ref, where), got in zip(refs, grid.tolist()):
                if tuple(got) != tuple(ref.grid):
                    raise DataError(
                        f"{where}: image {ref.path} has patch grid {tuple(got)} but {tuple(ref.grid)} when the cache "
                        "was built (the file changed); delete the cache entry to re-tokenize"
                    )
            extras = {"pixel_values": out["pixel_values"], "image_grid_thw": grid}
        return VisionPack(pack.index, pack.input_ids, pack.labels, pack.lengths, extras, tags=pack.tags)

    def _images_in(self, sample: int, start: int, end: int, entry: SampleImages) -> list[ImageRef]:
        """The images of ``sample`` inside its token range ``[start, end)``; refuse an image cut in two."""
        full = int(self.packs.data.num_tokens[sample])
        if start == 0 and end == full:
            return entry.images
        ids, _ = self.packs.data.tokens(sample)
        is_image = ids == self.image_token_id
        counts = [self.settings.num_tokens(im.grid) for im in entry.images]
        bounds = np.cumsum([0, *counts])
        before, inside = int(is_image[:start].sum()), int(is_image[start:end].sum())
        first = int(np.searchsorted(bounds, before, side="left"))
        last = int(np.searchsorted(bounds, before + inside, side="left"))
        if bounds[min(first, len(counts))] != before or bounds[min(last, len(counts))] != before + inside:
            raise DataError(
                f"{entry.where}: the sample is cut inside an image (tokens [{start}, {end}) of {full}); raise "
                "pack_max_length, or set overlong: drop (packing: best_fit)"
            )
        return entry.images[first:last]
