"""The batch contract shared by the data and model seams: the packed batch and the model output.

Both seams import this module; it imports nothing from either (only torch), so the data pipeline never loads
model code.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

__all__ = ["ModelOutput", "SequenceContext"]


@dataclass
class SequenceContext:
    """A packed batch of shape ``(1, T)`` made of several documents laid end to end.

    Attention never crosses a document boundary: document ``i`` spans ``cu_seq_lens[i]:cu_seq_lens[i+1]``.
    ``position_ids`` restart at 0 at every document, so rotary embeddings see per-document positions.

    Attributes:
        input_ids: Token ids, shape ``(1, T)``; ``None`` when ``inputs_embeds`` is given instead.
        cu_seq_lens: Cumulative document lengths, int32, shape ``(num_docs + 1,)``, starting at 0, ending at T.
        max_seq_len: Length of the longest document.
        position_ids: Per-document positions, shape ``(1, T)``.
        inputs_embeds: Optional precomputed embeddings, shape ``(1, T, hidden)``.
        num_padding: Tokens at the end of the pack that are padding (a masked pseudo-document).
        doc_bounds: ``cu_seq_lens`` as Python ints, computed on the host when the batch is built, so attention
            never reads the device tensor back (on GPU each read is a device-to-host sync).
        loss_positions: Positions whose label is supervised, ``(N,)`` int64, found on the host by the collate
            step; a training forward runs the LM head and the loss on these rows only (``None``: every position).
        share_start: For a context-parallel share (:func:`xtl.data.collate.split_for_context_parallel`), the
            position in the whole pack of its first token; 0 otherwise.
        pack_input_ids: For a context-parallel share, the whole pack's token ids ``(1, pack_len)``, for models whose
            inputs depend on the whole sequence (M-RoPE positions, image placeholders); ``None`` otherwise.
        pack_labels: For a context-parallel share, the whole pack's shifted labels ``(1, pack_len)``, for heads that
            score tokens past the share's end (multi-token prediction); ``None`` otherwise.
    """

    input_ids: torch.Tensor | None
    cu_seq_lens: torch.Tensor
    max_seq_len: int
    position_ids: torch.Tensor
    inputs_embeds: torch.Tensor | None = None
    num_padding: int = 0
    extras: dict = field(default_factory=dict)
    doc_bounds: tuple[int, ...] | None = None
    loss_positions: torch.Tensor | None = None
    share_start: int = 0
    pack_input_ids: torch.Tensor | None = None
    pack_labels: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.doc_bounds is None and self.cu_seq_lens is not None and self.cu_seq_lens.device.type == "cpu":
            self.doc_bounds = tuple(self.cu_seq_lens.tolist())

    @classmethod
    def from_lengths(
        cls,
        input_ids: torch.Tensor,
        lengths: Sequence[int],
        num_padding: int = 0,
    ) -> SequenceContext:
        """Build a context from token ids ``(1, T)`` (or ``(T,)``) and the length of each document.

        Args:
            input_ids: Packed token ids.
            lengths: Length of every document, in order; they must sum to T.
            num_padding: How many of the final tokens are padding (already counted in ``lengths``).
        """
        if input_ids.dim() == 1:
            input_ids = input_ids.unsqueeze(0)
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"a packed batch has shape (1, T); got {tuple(input_ids.shape)}")
        lengths = [int(n) for n in lengths]
        if any(n <= 0 for n in lengths):
            raise ValueError(f"document lengths must be positive; got {lengths}")
        total = input_ids.shape[1]
        if sum(lengths) != total:
            raise ValueError(f"document lengths sum to {sum(lengths)} but the pack has {total} tokens")
        bounds = (0, *itertools.accumulate(lengths))
        cu = torch.tensor(bounds, dtype=torch.int32)
        # positions restart at every document: global index minus the start of the token's document
        starts = torch.repeat_interleave(cu[:-1].long(), torch.tensor(lengths), output_size=total)
        position_ids = (torch.arange(total) - starts).unsqueeze(0)
        device = input_ids.device
        return cls(
            input_ids=input_ids,
            cu_seq_lens=cu.to(device),
            max_seq_len=max(lengths),
            position_ids=position_ids.to(device),
            num_padding=num_padding,
            doc_bounds=bounds,
        )

    @classmethod
    def from_input_ids(cls, input_ids: torch.Tensor) -> SequenceContext:
        """A context of one document covering all of ``input_ids`` ``(1, T)``."""
        if input_ids.dim() == 1:
            input_ids = input_ids.unsqueeze(0)
        return cls.from_lengths(input_ids, [input_ids.shape[1]])

    @property
    def seq_len(self) -> int:
        """Total tokens in the pack (T)."""
        return int(self.position_ids.shape[-1])

    @property
    def pack_len(self) -> int:
        """Tokens of the whole pack: ``seq_len``, or more for a context-parallel share (whose document bounds are the
        pack's)."""
        return self.doc_bounds[-1] if self.doc_bounds is not None else self.seq_len

    @property
    def num_docs(self) -> int:
        """Number of documents (including a trailing padding pseudo-document)."""
        return int(self.cu_seq_lens.numel() - 1)

    @property
    def lengths(self) -> list[int]:
        """Per-document lengths."""
        if self.doc_bounds is not None:
            return [e - s for s, e in zip(self.doc_bounds[:-1], self.doc_bounds[1:])]
        return (self.cu_seq_lens[1:] - self.cu_seq_lens[:-1]).tolist()

    def to(self, device: torch.device | str) -> SequenceContext:
        """Move every tensor to ``device``, those in ``extras`` (e.g. the images of a pack) included."""
        return self.map_tensors(lambda t: t.to(device, non_blocking=True))

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> SequenceContext:
        """A copy with ``fn`` applied to every tensor (``extras`` included; host-side bounds are kept)."""

        def apply(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else fn(t)

        return replace(
            self,
            input_ids=apply(self.input_ids),
            cu_seq_lens=apply(self.cu_seq_lens),
            position_ids=apply(self.position_ids),
            inputs_embeds=apply(self.inputs_embeds),
            loss_positions=apply(self.loss_positions),
            pack_input_ids=apply(self.pack_input_ids),
            pack_labels=apply(self.pack_labels),
            extras={k: apply(v) if isinstance(v, torch.Tensor) else v for k, v in self.extras.items()},
        )

    def document_ids(self) -> torch.Tensor:
        """Document index of every token, shape ``(T,)``."""
        lengths = self.cu_seq_lens[1:] - self.cu_seq_lens[:-1]
        return torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths.long())


@dataclass
class ModelOutput:
    """Result of a model forward.

    Attributes:
        loss: Mean cross-entropy over supervised tokens (``None`` without labels).
        loss_sum: Sum of per-token cross-entropy (for global-token normalization across ranks/micro-batches).
        num_tokens: Number of supervised tokens (labels != -100) in this forward.
        logits: Vocabulary logits, if requested.
        hidden_states: Final hidden states (after the last norm), if requested.
        extras: Family extras (router losses, tokens per expert, ...).
    """

    loss: torch.Tensor | None = None
    loss_sum: torch.Tensor | None = None
    num_tokens: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
