"""Collate packs into micro-batches: a ``SequenceContext`` plus labels shifted per document."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from xtl.batch import SequenceContext
from xtl.data.item import IGNORE_INDEX
from xtl.data.multimodal import VisionPack
from xtl.data.packing import Pack


@dataclass
class MicroBatch:
    """One packed micro-batch of shape ``(1, T)``.

    ``labels[0, t]`` is the target of position ``t`` (already shifted inside each document; -100 at every
    document's last token, on unsupervised tokens and on padding). Padding at the end of a pack is its own
    pseudo-document (``seq_ctx.num_padding`` tokens, labels -100).

    Args:
        seq_ctx (SequenceContext): Packed ids, ``cu_seq_lens``, per-document ``position_ids``.
        labels (torch.Tensor): Shifted targets, int64 ``(1, T)``.
        num_tokens (int): Supervised targets (``labels != -100``).
        num_real_tokens (int): Non-padding tokens.
        pack_index (int): Index of the pack in its dataset.
        doc_tags (tuple[int, ...] | None): The tag of every (non-padding) document, for tagged data (the labels of
            unpaired preference rows); ``None`` otherwise.
    """

    seq_ctx: SequenceContext
    labels: torch.Tensor
    num_tokens: int
    num_real_tokens: int
    pack_index: int = -1
    doc_tags: tuple[int, ...] | None = None

    def to(self, device: torch.device | str, non_blocking: bool | None = None) -> MicroBatch:
        """Move tensors to ``device`` (Lightning's batch transfer calls this, without ``non_blocking``).

        Args:
            device (torch.device | str): Target device.
            non_blocking (bool | None): Asynchronous copy where possible; ``None``: when the batch is in pinned
                memory (a loader with ``pin_memory``), so the copy overlaps the step that is still running.

        Returns:
            MicroBatch: A moved copy.
        """
        if non_blocking is None:
            non_blocking = self.labels.is_pinned()
        seq_ctx = self.seq_ctx.to(device)
        if seq_ctx.extras:  # images of a vision pack (pixel_values, image_grid_thw)
            seq_ctx.extras = {
                k: v.to(device, non_blocking=non_blocking) if isinstance(v, torch.Tensor) else v
                for k, v in seq_ctx.extras.items()
            }
        return MicroBatch(
            seq_ctx,
            self.labels.to(device, non_blocking=non_blocking),
            self.num_tokens,
            self.num_real_tokens,
            self.pack_index,
            self.doc_tags,
        )

    def pin_memory(self) -> MicroBatch:
        """A copy in page-locked host memory (a loader with ``pin_memory=True`` calls this in its pinning thread).

        Returns:
            MicroBatch: The pinned copy; host-side ``doc_bounds`` and counts are kept.
        """
        seq_ctx = self.seq_ctx.map_tensors(torch.Tensor.pin_memory)
        return replace(self, seq_ctx=seq_ctx, labels=self.labels.pin_memory())


class StepCollator:
    """Turn a list of packs (one rank's share of a step) into a list of ``MicroBatch``.

    Args:
        pad_token_id (int): Id written into padding positions.
        pad_to (int | None): Pad every pack to this length (fixed shapes); ``None`` keeps each pack's length.
    """

    def __init__(self, pad_token_id: int = 0, pad_to: int | None = None) -> None:
        self.pad_token_id = pad_token_id
        self.pad_to = pad_to

    def __call__(self, packs: list[Pack]) -> list[MicroBatch]:
        return [collate_pack(p, self.pad_token_id, self.pad_to) for p in packs]


def collate_pack(pack: Pack, pad_token_id: int = 0, pad_to: int | None = None) -> MicroBatch:
    """Build one micro-batch from a pack.

    Args:
        pack (Pack): Unshifted ids/labels and document lengths.
        pad_token_id (int): Padding id.
        pad_to (int | None): Target length (padding appended as one masked pseudo-document).

    Returns:
        MicroBatch: The micro-batch.
    """
    ids, labels, lengths = pack.input_ids, pack.labels, list(pack.lengths)
    real = len(ids)
    shifted = np.full(real, IGNORE_INDEX, dtype=np.int64)
    if real:
        shifted[:-1] = labels[1:]
        shifted[np.cumsum(lengths) - 1] = IGNORE_INDEX
    num_padding = 0
    if pad_to is not None and real < pad_to:
        num_padding = pad_to - real
        ids = np.concatenate([ids, np.full(num_padding, pad_token_id, dtype=np.int64)])
        shifted = np.concatenate([shifted, np.full(num_padding, IGNORE_INDEX, dtype=np.int64)])
        lengths.append(num_padding)
    input_ids = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64)).unsqueeze(0)
    ctx = SequenceContext.from_lengths(input_ids, lengths, num_padding=num_padding)
    if isinstance(pack, VisionPack) and pack.extras:  # the pack's processed images
        ctx.extras = dict(pack.extras)
    supervised = np.flatnonzero(shifted != IGNORE_INDEX)
    rows = loss_rows(supervised, shifted.size)
    if rows is not None:  # the head and loss then run on these positions only
        ctx.loss_positions = torch.from_numpy(rows)
    return MicroBatch(
        seq_ctx=ctx,
        labels=torch.from_numpy(shifted).unsqueeze(0),
        num_tokens=int(supervised.size),
        num_real_tokens=real,
        pack_index=pack.index,
        doc_tags=None if pack.tags is None else tuple(pack.tags),
    )


LOSS_ROW_MULTIPLE = 128


def loss_rows(supervised: np.ndarray, total: int, multiple: int = LOSS_ROW_MULTIPLE) -> np.ndarray | None:
    """The positions the head and loss run on: the supervised ones, topped up with unsupervised positions (they add
    nothing to the loss) to a multiple of ``multiple``, so the head sees few distinct shapes (a new shape per step
    fragments the host allocator); ``None`` when that would be every position or none is supervised.
    """
    count = -(-supervised.size // multiple) * multiple
    if supervised.size == 0 or count >= total:
        return None
    unsupervised = np.setdiff1d(np.arange(total), supervised, assume_unique=True)
    return np.sort(np.concatenate([supervised, unsupervised[: count - supervised.size]]))


def split_for_context_parallel(batch: MicroBatch, rank: int, size: int, pad_token_id: int = 0) -> MicroBatch:
    """The share of a host-side micro-batch that context-parallel rank ``rank`` of ``size`` trains.

    The pack is first padded to a multiple of ``size`` tokens (the padding joins the trailing padding
    pseudo-document, or becomes one; labels -100), then cut into ``size`` equal runs of consecutive tokens; rank
    ``r`` keeps run ``r``. Positions are those of the whole pack (computed before the cut), labels are cut the same
    way, so the supervised tokens of all shares are exactly those of the pack. The document boundaries
    (``cu_seq_lens``, ``doc_bounds``, ``max_seq_len``) stay those of the whole pack: attention gathers the whole
    sequence (:class:`xtl.ops.ulysses.UlyssesAttention`). The share keeps its offset (``share_start``), the whole
    pack's ids and labels (``pack_input_ids``, ``pack_labels``), and a vision pack's images whole: a vision-language
    model computes M-RoPE positions over the whole pack and keeps the image features of its own placeholders, and
    multi-token prediction reads the tokens and labels just past the share's end.

    Args:
        batch (MicroBatch): A collated micro-batch, on the host.
        rank (int): This rank's place in its context-parallel group.
        size (int): Ranks in the group.
        pad_token_id (int): Id of padding tokens.

    Returns:
        MicroBatch: This rank's share (``num_tokens``, ``num_real_tokens`` and ``seq_ctx.num_padding`` count its own
        tokens).
    """
    ctx, labels = batch.seq_ctx, batch.labels
    total = ctx.seq_len
    extra = -total % size
    lengths, num_padding = ctx.lengths, ctx.num_padding
    input_ids, position_ids = ctx.input_ids, ctx.position_ids
    if extra:
        lengths = [*lengths[:-1], lengths[-1] + extra] if num_padding else [*lengths, extra]
        num_padding += extra
        pad = input_ids.new_full((1, extra), pad_token_id)
        whole = SequenceContext.from_lengths(torch.cat([input_ids, pad], dim=1), lengths, num_padding)
        input_ids, position_ids = whole.input_ids, whole.position_ids
        labels = torch.cat([labels, labels.new_full((1, extra), IGNORE_INDEX)], dim=1)
        ctx = replace(ctx, cu_seq_lens=whole.cu_seq_lens, doc_bounds=whole.doc_bounds, num_padding=num_padding)
    share = (total + extra) // size
    start, end = rank * share, (rank + 1) * share
    local_labels = labels[:, start:end]
    supervised = np.flatnonzero(local_labels[0].numpy() != IGNORE_INDEX)
    rows = loss_rows(supervised, share)
    real = min(max(batch.num_real_tokens - start, 0), share)
    padding_start = total + extra - num_padding  # padding ends the pack: each share holds its overlap with it
    local = replace(
        ctx,
        num_padding=max(0, end - max(start, padding_start)),
        input_ids=input_ids[:, start:end],
        position_ids=position_ids[..., start:end],
        loss_positions=torch.from_numpy(rows) if rows is not None else None,
        share_start=start,
        pack_input_ids=input_ids,
        pack_labels=labels,
    )
    return MicroBatch(local, local_labels, int(supervised.size), real, batch.pack_index, batch.doc_tags)
