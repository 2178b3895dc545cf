"""Multi-token prediction (DeepSeek-V3): extra depths that predict tokens further ahead than the next one.

Depth ``k`` (1-based) reads, at position ``t``, the previous depth's hidden state (the main model's final, normed
hidden state for ``k = 1``) and the embedding of token ``t + k``, and predicts token ``t + k + 1`` through the
model's own LM head. Inside a packed batch neither the shifted embedding nor the target crosses a document boundary
(:func:`shift_within_documents`). A context-parallel share of a pack reads the tokens and labels past its end from the
whole pack's, which the share carries (:func:`shift_in_pack`, :func:`shifted_targets`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from xtl.batch import SequenceContext
from xtl.module.decoder_layer import DecoderLayer
from xtl.module.moe_block import MoEDecoderLayer
from xtl.module.norm import RMSNorm
from xtl.module.router import RouterOutput
from xtl.ops.attention import AttentionMaskSpec
from xtl.ops.cross_entropy import IGNORE_INDEX


class MTPBlock(nn.Module):
    """One prediction depth: ``norm(layer(eh_proj([enorm(embedding), hnorm(hidden)])))``.

    The order of the concatenation (embedding first) and the norms follow DeepSeek-V3's checkpoints as transformers
    and vLLM read them. The output is normed (DeepSeek-V3's ``shared_head.norm``) and feeds both the LM head and the
    next depth.

    Args:
        layer: The depth's decoder layer, built by the model family like its other layers (dense or MoE).
        hidden_size: Model width.
        rms_norm_eps: Epsilon of the three norms.
        norm_class: The RMSNorm variant of the family.
    """

    def __init__(
        self, layer: DecoderLayer, hidden_size: int, rms_norm_eps: float, norm_class: type[RMSNorm] = RMSNorm
    ) -> None:
        super().__init__()
        self.enorm = norm_class(hidden_size, rms_norm_eps)
        self.hnorm = norm_class(hidden_size, rms_norm_eps)
        self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.layer = layer
        self.norm = norm_class(hidden_size, rms_norm_eps)

    @property
    def routed(self) -> bool:
        """Whether the depth's decoder layer routes tokens to experts."""
        return isinstance(self.layer, MoEDecoderLayer)

    def forward(
        self,
        hidden: torch.Tensor,
        embeds: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        mask: AttentionMaskSpec,
    ) -> tuple[torch.Tensor, RouterOutput | None]:
        """Run the depth on ``(B, T, C)`` hidden states and shifted embeddings.

        Returns:
            The normed output and the routing of the decoder layer (``None`` for a dense layer).
        """
        projected = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        if self.routed:
            out, routing = self.layer(projected, position_embeddings, mask)
            return self.norm(out), routing
        return self.norm(self.layer(projected, position_embeddings, mask)), None


def shift_within_documents(
    values: torch.Tensor, position_ids: torch.Tensor, shift: int, fill: float | int = 0
) -> torch.Tensor:
    """``values[:, t + shift]`` at every position ``t`` whose document still holds ``t + shift``, else ``fill``.

    Documents are read from the positions, which restart at 0 with every document (packed batches) and run
    ``0..T-1`` in a plain ``(B, T)`` batch: ``t + shift`` is in ``t``'s document exactly when its position is
    ``position_ids[t] + shift``. Nothing is read back on the host.

    Args:
        values: ``(B, T, ...)`` tensor (token ids, embeddings, targets).
        position_ids: ``(B, T)`` or ``(1, T)`` per-document positions.
        shift: Positions to look ahead (>= 1).
        fill: Value where ``t + shift`` is in another document or past the end.

    Returns:
        The shifted tensor, shaped like ``values``.
    """
    batch, length = values.shape[:2]
    positions = position_ids.expand(batch, length)
    ahead = F.pad(positions[:, shift:], (0, min(shift, length)), value=-1)
    same_doc = ahead == positions + shift
    padding = values.new_full((batch, min(shift, length), *values.shape[2:]), fill)
    shifted = torch.cat([values[:, shift:], padding], dim=1)
    same_doc = same_doc.view(batch, length, *([1] * (values.dim() - 2)))
    return torch.where(same_doc, shifted, padding.new_full((), fill))


def shift_in_pack(
    pack_values: torch.Tensor, seq_ctx: SequenceContext, shift: int, fill: float | int = 0
) -> torch.Tensor:
    """A context-parallel share's :func:`shift_within_documents` of the whole pack's ``pack_values``.

    At the share's position ``t`` (position ``g = seq_ctx.share_start + t`` of the pack): ``pack_values[:, g + shift]``
    when the pack's document of ``g`` still holds ``g + shift``, else ``fill``. The last ``shift`` positions of a
    share read the next share's values, so the result equals the whole pack's shift cut to the share. Documents are
    the pack's (``seq_ctx.cu_seq_lens``, which a share keeps whole); nothing is read back on the host.

    Args:
        pack_values: ``(1, pack_len)`` tensor of the whole pack (its token ids or shifted labels).
        seq_ctx: The share (:func:`xtl.data.collate.split_for_context_parallel`).
        shift: Positions to look ahead (>= 1).
        fill: Value where ``g + shift`` is in another document or past the pack's end.

    Returns:
        ``(1, seq_ctx.seq_len)``, on ``pack_values``' device.
    """
    device, total = pack_values.device, pack_values.shape[1]
    here = torch.arange(seq_ctx.share_start, seq_ctx.share_start + seq_ctx.seq_len, device=device)
    ahead = here + shift
    bounds = seq_ctx.cu_seq_lens.to(device=device, dtype=torch.long)
    same_doc = torch.searchsorted(bounds, here, right=True) == torch.searchsorted(bounds, ahead, right=True)
    same_doc &= ahead < total
    values = pack_values[:, ahead.clamp(max=total - 1)]
    return torch.where(same_doc[None], values, values.new_full((), fill))


def shifted_targets(
    targets: torch.Tensor, position_ids: torch.Tensor, shift: int, seq_ctx: SequenceContext | None = None
) -> torch.Tensor:
    """The target ``shift`` positions later in the same document (``-100`` where there is none): what MTP depth
    ``shift`` is scored on at each position.

    Args:
        targets: Shifted targets ``(B, T)`` (``-100`` where no loss).
        position_ids: Per-document positions ``(B, T)`` or ``(1, T)``.
        shift: The depth (>= 1).
        seq_ctx: The packed batch, if any; a context-parallel share (``pack_input_ids`` set) reads the targets past
            its end from the whole pack's labels (``pack_labels``).

    Raises:
        ValueError: ``seq_ctx`` is a context-parallel share without the pack's labels.
    """
    if seq_ctx is not None and seq_ctx.pack_input_ids is not None:
        if seq_ctx.pack_labels is None:
            raise ValueError(
                "multi-token prediction on a context-parallel share needs the whole pack's labels (seq_ctx."
                "pack_labels); cut shares with xtl.data.collate.split_for_context_parallel"
            )
        return shift_in_pack(seq_ctx.pack_labels.to(targets.device), seq_ctx, shift, IGNORE_INDEX)
    return shift_within_documents(targets, position_ids.to(targets.device), shift, IGNORE_INDEX)


def mtp_target_counts(
    targets: torch.Tensor, position_ids: torch.Tensor, depths: int, seq_ctx: SequenceContext | None = None
) -> torch.Tensor:
    """How many positions each MTP depth scores: ``(depths,)`` int64, on ``targets``' device.

    Depth ``k`` scores position ``t`` when the target ``k`` positions later is supervised and in ``t``'s document
    (what :class:`~xtl.model.moe.DeepSeekV3` scores; :func:`shifted_targets`), so a training step can normalize
    each depth's loss by its count over all micro-batches and ranks before the first backward.

    Args:
        targets: Shifted targets ``(B, T)`` (``-100`` where no loss).
        position_ids: Per-document positions ``(B, T)`` or ``(1, T)``.
        depths: MTP depths.
        seq_ctx: The packed batch, if any (a context-parallel share counts the targets past its end).
    """
    counts = [(shifted_targets(targets, position_ids, k, seq_ctx) != IGNORE_INDEX).sum() for k in range(1, depths + 1)]
    return torch.stack(counts) if counts else torch.zeros(0, dtype=torch.int64, device=targets.device)


__all__ = ["MTPBlock", "mtp_target_counts", "shift_in_pack", "shift_within_documents", "shifted_targets"]
