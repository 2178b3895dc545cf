"""The input of a parity check: :class:`ParityDocuments`, documents of token ids and their shifted labels."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from xtl.batch import SequenceContext
from xtl.ops.cross_entropy import IGNORE_INDEX


@dataclass
class ParityDocuments:
    """The documents one check runs on.

    Attributes:
        input_ids: One 1-D int64 tensor per document.
        labels: Each document's shifted targets (``labels[t]`` is the target of position ``t``; -100: no loss).
    """

    input_ids: list[torch.Tensor]
    labels: list[torch.Tensor]

    def __post_init__(self) -> None:
        if not self.input_ids:
            raise ValueError("a parity check needs at least one document")
        if [t.numel() for t in self.input_ids] != [t.numel() for t in self.labels]:
            raise ValueError("every document needs one label per token")

    @classmethod
    def from_packed(
        cls, seq_ctx: SequenceContext, labels: torch.Tensor, max_tokens: int | None = None
    ) -> ParityDocuments:
        """The documents of a packed micro-batch: trailing padding dropped, cut after ``max_tokens`` tokens.

        Args:
            seq_ctx: The packed batch (``input_ids`` ``(1, T)``, ``cu_seq_lens``, ``num_padding``).
            labels: Its shifted labels ``(1, T)``.
            max_tokens: Keep at most this many tokens (a cut document loses its last target).
        """
        if seq_ctx.input_ids is None:
            raise ValueError("a parity check needs token ids, not inputs_embeds")
        ids, targets = seq_ctx.input_ids.reshape(-1).cpu(), labels.reshape(-1).cpu()
        bounds = seq_ctx.cu_seq_lens.tolist()
        limit = bounds[-1] - seq_ctx.num_padding
        if max_tokens is not None:
            limit = min(limit, max_tokens)
        docs, doc_labels = [], []
        for start, end in zip(bounds[:-1], bounds[1:]):
            end = min(end, limit)
            if end <= start:
                break
            docs.append(ids[start:end].clone())
            doc_labels.append(targets[start:end].clone())
            doc_labels[-1][-1] = IGNORE_INDEX  # the target after a document's (or the cut's) last token is unseen
        return cls(docs, doc_labels)

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


def _next_token_labels(ids: torch.Tensor) -> torch.Tensor:
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[:-1] = ids[1:]
    return labels
