"""Collate: per-document label shift, padding pseudo-document, token counts."""

from __future__ import annotations

import numpy as np
import torch

from xtl.data import IGNORE_INDEX, MicroBatch, Pack, StepCollator, collate_pack


def _pack() -> Pack:
    ids = np.array([10, 11, 12, 13, 20, 21, 22])
    labels = np.array([IGNORE_INDEX, 11, 12, 13, IGNORE_INDEX, IGNORE_INDEX, 22])
    return Pack(index=4, input_ids=ids, labels=labels, lengths=[4, 3])


class TestCollate:
    def test_shift_within_documents_and_padding(self):
        mb = collate_pack(_pack(), pad_token_id=0, pad_to=10)
        assert isinstance(mb, MicroBatch) and mb.pack_index == 4
        ctx = mb.seq_ctx
        assert ctx.input_ids.tolist() == [[10, 11, 12, 13, 20, 21, 22, 0, 0, 0]]
        assert ctx.cu_seq_lens.tolist() == [0, 4, 7, 10] and ctx.cu_seq_lens.dtype == torch.int32
        assert ctx.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0, 1, 2]]
        assert ctx.num_padding == 3 and ctx.max_seq_len == 4
        ignore = IGNORE_INDEX
        assert mb.labels.tolist() == [[11, 12, 13, ignore, ignore, 22, ignore, ignore, ignore, ignore]]
        assert mb.num_tokens == 4 and mb.num_real_tokens == 7

    def test_no_padding_when_disabled(self):
        mb = collate_pack(_pack(), pad_to=None)
        assert mb.seq_ctx.seq_len == 7 and mb.seq_ctx.num_padding == 0 and mb.seq_ctx.num_docs == 2

    def test_step_collator_and_to(self):
        step = StepCollator(pad_token_id=1, pad_to=8)([_pack(), _pack()])
        assert len(step) == 2 and all(mb.labels.shape == (1, 8) for mb in step)
        moved = step[0].to("cpu")
        assert torch.equal(moved.labels, step[0].labels) and moved.num_tokens == step[0].num_tokens
