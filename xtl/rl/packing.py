"""Rollout packing: prompt + completion sequences as packed micro-batches with what the policy loss needs of them.

:func:`pack_sequences` lays sequences end to end in one packed ``(1, T)`` batch labelled on the completions and
indexes their completion tokens as padded ``(B, T)`` rows, masked where an agent loop appended tokens (tool results,
observations: in the context, not in the loss); :func:`cut_micro_batches` deals the samples of one update into its
micro-batches (each segment of a multi-segment trajectory is a sequence with the trajectory's advantage), each with
its share of the loss normalizer (:func:`xtl.rl.loss.loss_normalizer`). A sequence of a prompt with images (a
vision-language policy) brings them into its micro-batch: the pack carries the ``pixel_values`` and ``image_grid_thw``
of its sequences' images in order (as an SFT pack does), so the update's forwards see the vision tokens as the
rollout's prefill did; a checkpoint keeps the image paths, and a restored micro-batch processes them again. Under
sharded parameters a micro-batch without images carries the image filler (:meth:`~xtl.rl.vision.PromptVision.filler`),
so that every rank's forward and backward run the vision tower.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from xtl.batch import SequenceContext
from xtl.data.collate import MicroBatch, collate_pack
from xtl.data.item import IGNORE_INDEX
from xtl.data.multimodal import VisionPack
from xtl.data.packing import Pack
from xtl.rl.buffer import Sample
from xtl.rl.loss import loss_normalizer
from xtl.rl.vision import PromptImages, PromptVision, concat_images


@dataclass
class RLMicroBatch:
    """A packed micro-batch of prompt + completion sequences and what the policy loss needs of it.

    Attributes:
        batch: The packed sequences (labels on completion tokens only).
        positions: ``(N,)`` packed positions whose next token is a completion token.
        rows: ``(B, T)`` index into ``positions`` of each sequence's completion tokens (0 where ``mask`` is 0).
        mask: ``(B, T)`` 1 on completion tokens the engine sampled (0 on padding and appended tokens).
        advantages: ``(B,)`` per sequence.
        old_logps: ``(B, T)`` the sampling policy's log-probabilities (set when the batch is produced, or by the
            forward of its first update).
        ref_logps: ``(B, T)`` the reference's (with a KL term).
        num_items: This micro-batch's share of the loss normalizer.
        sampling_logps: ``(B, T)`` the rollout engine's log-probabilities (engines that return them, e.g. vLLM).
        routed_experts: Per MoE layer, the ``(N, k)`` experts its tokens went to when the old log-probabilities were
            computed (routing replay).
        sequences: ``(prompt ids, completion ids)`` of each sequence (what a checkpoint keeps).
        loss_masks: Each sequence's completion mask when an agent loop appended tokens (``None``: all sampled).
        images: Each sequence's image paths (``None`` for a text sequence) when some sequence has images (``None``:
            none has).
        filled: The pack ends with the image filler (a document that is neither a sequence nor scored).
        share: The part of ``batch`` this rank forwards under context parallelism (its share, cut on the host), set
            when the micro-batch is put on the device; ``None``: the whole batch.
    """

    batch: MicroBatch
    positions: torch.Tensor
    rows: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor
    old_logps: torch.Tensor | None = None
    ref_logps: torch.Tensor | None = None
    num_items: float = 0.0
    sampling_logps: torch.Tensor | None = None
    routed_experts: list[torch.Tensor] | None = None
    sequences: list[tuple[list[int], list[int]]] | None = None
    share: MicroBatch | None = None
    loss_masks: list[list[int]] | None = None
    images: list[list[str] | None] | None = None
    filled: bool = False

    @property
    def forwarded(self) -> MicroBatch:
        """What this rank forwards: its context-parallel share, or the whole batch."""
        return self.batch if self.share is None else self.share

    @property
    def seq_ctx(self) -> SequenceContext:
        """The forwarded batch's sequence context."""
        return self.forwarded.seq_ctx

    @property
    def num_real_tokens(self) -> int:
        """Tokens of the forwarded batch."""
        return self.forwarded.num_real_tokens

    def to(self, device: torch.device | str, share: MicroBatch | None = None) -> RLMicroBatch:
        """This micro-batch on ``device``, with ``share`` (a host-side share of ``batch``) as what it forwards."""
        move = {k: None if v is None else v.to(device) for k, v in self._tensors().items()}
        routed = None if self.routed_experts is None else [ids.to(device) for ids in self.routed_experts]
        share = None if share is None else share.to(device)
        return replace(self, batch=self.batch.to(device), routed_experts=routed, share=share, **move)

    def state(self) -> dict[str, Any]:
        """Plain data for a checkpoint: the sequences, advantages, log-probabilities and normalizer share."""
        return {
            "sequences": self.sequences or [],
            "advantages": self.advantages.cpu(),
            "old_logps": None if self.old_logps is None else self.old_logps.cpu(),
            "ref_logps": None if self.ref_logps is None else self.ref_logps.cpu(),
            "sampling_logps": None if self.sampling_logps is None else self.sampling_logps.cpu(),
            "routed_experts": None if self.routed_experts is None else [ids.cpu() for ids in self.routed_experts],
            "num_items": self.num_items,
            "loss_masks": self.loss_masks,
            "images": self.images,
            "filled": self.filled,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any], vision: PromptVision | None = None) -> RLMicroBatch:
        """Rebuild a micro-batch from :meth:`state` (``vision`` processes its sequences' images again).

        Raises:
            ValueError: The state holds images but no ``vision`` is given.
        """
        paths, filled = state.get("images"), state.get("filled", False)
        if (paths is not None or filled) and vision is None:
            raise ValueError("the micro-batch holds images: rebuilding it needs the policy's PromptVision")
        images = None if paths is None else [vision.images(p) for p in paths]
        filler = vision.filler() if filled else None
        mb = pack_sequences(state["sequences"], state["advantages"].tolist(), state.get("loss_masks"), images, filler)
        mb.old_logps, mb.ref_logps, mb.num_items = state["old_logps"], state["ref_logps"], float(state["num_items"])
        mb.sampling_logps, mb.routed_experts = state.get("sampling_logps"), state.get("routed_experts")
        return mb

    def _tensors(self) -> dict[str, torch.Tensor | None]:
        names = ("positions", "rows", "mask", "advantages", "old_logps", "ref_logps", "sampling_logps")
        return {k: getattr(self, k) for k in names}


def pack_sequences(
    sequences: list[tuple[list[int], list[int]]],
    advantages: list[float],
    loss_masks: list[list[int]] | None = None,
    images: list[PromptImages | None] | None = None,
    filler: tuple[list[int], PromptImages] | None = None,
) -> RLMicroBatch:
    """One packed micro-batch of ``(prompt ids, completion ids)`` sequences, labelled on the completions (no
    sequences: a 2-token filler without labels, which every rank can forward when parameters are sharded).

    ``loss_masks`` (one per sequence, over its completion) zero the loss of completion tokens an agent loop appended;
    they stay labelled (scored like the others) so that every sequence's completion rows line up with its tokens.
    ``images`` (one entry per sequence, ``None`` for a text one) go into the pack's ``extras`` in sequence order;
    ``filler`` (a sharded vision-language policy's image filler) ends a pack whose sequences have no image (the empty
    one included) as a document of its own, unlabelled."""
    extras = concat_images(images or [])
    filled = filler is not None and not extras
    if not sequences and not filled:
        mb = collate_pack(Pack(-1, np.zeros(2, dtype=np.int64), np.full(2, IGNORE_INDEX, dtype=np.int64), [2]))
        empty = torch.zeros(0, 1, dtype=torch.long)
        return RLMicroBatch(mb, torch.zeros(0, dtype=torch.long), empty, empty.float(), torch.zeros(0), sequences=[])
    ids: list[int] = []
    labels: list[int] = []
    for prompt, response in sequences:
        ids += [*prompt, *response]
        labels += [IGNORE_INDEX] * len(prompt) + list(response)
    lengths = [len(p) + len(r) for p, r in sequences]
    if filled:
        filler_ids, filler_images = filler
        ids += filler_ids
        labels += [IGNORE_INDEX] * len(filler_ids)
        lengths.append(len(filler_ids))
        extras = filler_images.inputs
    pack = VisionPack(-1, np.asarray(ids, dtype=np.int64), np.asarray(labels, dtype=np.int64), lengths, extras)
    mb = collate_pack(pack)
    positions = torch.nonzero(mb.labels[0] != IGNORE_INDEX).squeeze(-1)
    width = max((len(r) for _, r in sequences), default=1)
    rows = torch.zeros(len(sequences), width, dtype=torch.long)
    mask = torch.zeros(len(sequences), width)
    offset = 0
    for i, (_, response) in enumerate(sequences):
        rows[i, : len(response)] = torch.arange(offset, offset + len(response))
        mask[i, : len(response)] = 1.0 if loss_masks is None else torch.tensor(loss_masks[i], dtype=torch.float32)
        offset += len(response)
    advantages_t = torch.tensor(advantages, dtype=torch.float32)
    kept = [(list(p), list(r)) for p, r in sequences]
    masks = None if loss_masks is None else [list(m) for m in loss_masks]
    paths = None
    if extras and not filled:  # some sequence has images: each sequence's paths (what a checkpoint keeps)
        paths = [None if entry is None else list(entry.paths) for entry in images]
    return RLMicroBatch(
        mb, positions, rows, mask, advantages_t, sequences=kept, loss_masks=masks, images=paths, filled=filled
    )


def cut_micro_batches(
    samples: Sequence[tuple[Sample, float]],
    parts: int,
    loss_type: str,
    max_new_tokens: int,
    vision: PromptVision | None = None,
    filler: tuple[list[int], PromptImages] | None = None,
) -> list[RLMicroBatch]:
    """``parts`` packed micro-batches of one update's ``(sample, advantage)`` pairs, dealt round-robin (an empty one
    is a filler), each with its share of ``loss_type``'s normalizer and the engine's log-probabilities when every
    sample has them. A sample of several segments is several sequences, dealt together.

    Args:
        samples: The update's samples with their advantages.
        parts: Micro-batches to cut (the same on every rank).
        loss_type: The objective's loss type (what the normalizer counts).
        max_new_tokens: The sampling budget (``dr_grpo``'s constant length).
        vision: Processes the samples' images (a vision-language policy; each segment of a sample holds its
            prompt's images).
        filler: The image filler of a micro-batch without images (a sharded vision-language policy).
    """
    out = []
    for part in split_round_robin(list(samples), parts):
        segments = [(segment, advantage) for sample, advantage in part for segment in sample.segments]
        masked = any(not all(segment.loss_mask) for segment, _ in segments)
        mb = pack_sequences(
            [(s.prompt_ids, s.response_ids) for s, _ in segments], [a for _, a in segments],
            [s.loss_mask for s, _ in segments] if masked else None,
            sample_images([sample for sample, _ in part for _ in sample.segments], vision), filler,
        )  # fmt: skip
        if segments and all(s.logprobs is not None for s, _ in segments):
            mb.sampling_logps = torch.zeros_like(mb.mask)
            for i, (segment, _) in enumerate(segments):
                mb.sampling_logps[i, : len(segment.logprobs)] = torch.tensor(segment.logprobs)
        mb.num_items = float(loss_normalizer(loss_type, len(segments), int(mb.mask.sum()), max_new_tokens))
        out.append(mb)
    return out


def sample_images(samples: Sequence[Sample], vision: PromptVision | None) -> list[PromptImages | None] | None:
    """The processed images of each sample's prompt (``None`` when no sample has images).

    Raises:
        ValueError: Samples with images but no ``vision``.
    """
    if not any(sample.images for sample in samples):
        return None
    if vision is None:
        raise ValueError("samples with images need the policy's PromptVision to be packed")
    return [vision.images(sample.images) for sample in samples]


def split_round_robin(items: list[Any], parts: int) -> list[list[Any]]:
    """``items`` dealt round-robin into ``parts`` lists (some may be empty)."""
    return [items[i::parts] for i in range(parts)]
