"""Collate: per-document label shift, padding pseudo-document, token counts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from xtl.data import IGNORE_INDEX, MicroBatch, Pack, StepCollator, collate_pack
from xtl.data.collate import split_for_context_parallel


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


class TestPinnedTransfer:
    def test_pin_memory_pins_every_tensor_and_keeps_host_bounds(self, monkeypatch):
        pinned: list[tuple] = []

        def fake_pin(self):  # CPU-only torch cannot pin; record what would be pinned
            pinned.append(tuple(self.shape))
            return self.clone()

        monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
        mb = collate_pack(_pack(), pad_to=10)
        out = mb.pin_memory()
        rows = mb.seq_ctx.loss_positions  # a pack this short runs its head on every position: no row index
        assert rows is None and sorted(pinned) == sorted([(1, 10), (4,), (1, 10), (1, 10)])  # ids, bounds, pos, labels
        assert out.seq_ctx.doc_bounds == (0, 4, 7, 10) and out.seq_ctx.num_padding == 3
        assert torch.equal(out.labels, mb.labels) and out.num_tokens == mb.num_tokens and out.pack_index == 4

    def test_to_is_non_blocking_only_from_pinned_memory(self, monkeypatch):
        calls: list[bool] = []
        original = torch.Tensor.to

        def recording_to(self, *args, **kwargs):
            calls.append(kwargs.get("non_blocking", False))
            return original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, "to", recording_to)
        mb = collate_pack(_pack(), pad_to=10)
        mb.to("cpu")
        assert calls[-1] is False  # labels: pageable memory, a synchronous copy
        monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)
        mb.to("cpu")
        assert calls[-1] is True
        mb.to("cpu", non_blocking=False)
        assert calls[-1] is False

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locked memory needs CUDA")
    def test_pinned_batch_reaches_the_device_intact(self):
        mb = collate_pack(_pack(), pad_to=10)
        pinned = mb.pin_memory()
        assert pinned.labels.is_pinned() and pinned.seq_ctx.input_ids.is_pinned()
        moved = pinned.to("cuda")
        torch.cuda.synchronize()
        assert torch.equal(moved.labels.cpu(), mb.labels)
        assert torch.equal(moved.seq_ctx.position_ids.cpu(), mb.seq_ctx.position_ids)
        assert moved.seq_ctx.doc_bounds == mb.seq_ctx.doc_bounds


def _random_pack(lengths: list[int], seed: int = 0) -> Pack:
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, 50, sum(lengths))
    labels = np.where(rng.random(ids.size) < 0.3, IGNORE_INDEX, ids)  # some unsupervised tokens
    return Pack(0, ids, labels, list(lengths))


class TestSplitForContextParallel:
    @pytest.mark.parametrize(
        ("lengths", "pad_to", "size"),
        [
            ([7, 20, 3, 10, 8], None, 2),  # a document crosses the split point; one is shorter than a share
            ([7, 20, 3, 10, 7], None, 2),  # 47 tokens: padded to 48 by a new padding pseudo-document
            ([5, 9, 2], 20, 4),  # padded pack: the share boundary falls in the padding
            ([30, 1, 2], 35, 4),  # 35 -> 36: the existing padding document grows
        ],
    )
    def test_shares_make_up_the_pack(self, lengths, pad_to, size):
        whole = collate_pack(_random_pack(lengths), pad_to=pad_to)
        shares = [split_for_context_parallel(whole, rank, size) for rank in range(size)]
        total = whole.seq_ctx.seq_len + (-whole.seq_ctx.seq_len % size)
        assert {s.seq_ctx.seq_len for s in shares} == {total // size}
        ids = torch.cat([s.seq_ctx.input_ids for s in shares], dim=1)
        labels = torch.cat([s.labels for s in shares], dim=1)
        positions = torch.cat([s.seq_ctx.position_ids for s in shares], dim=1)
        n = whole.seq_ctx.seq_len
        assert torch.equal(ids[:, :n], whole.seq_ctx.input_ids) and torch.equal(labels[:, :n], whole.labels)
        assert torch.equal(positions[:, :n], whole.seq_ctx.position_ids), "positions of the whole pack"
        assert (labels[:, n:] == IGNORE_INDEX).all(), "added padding is never supervised"
        bounds = shares[0].seq_ctx.doc_bounds
        assert {s.seq_ctx.pack_len for s in shares} == {total}, "a share knows the length of its pack"
        assert all(s.seq_ctx.doc_bounds == bounds for s in shares) and bounds[-1] == total
        assert bounds[: len(whole.seq_ctx.doc_bounds) - 1] == whole.seq_ctx.doc_bounds[:-1]
        assert shares[0].seq_ctx.cu_seq_lens.tolist() == list(bounds)
        assert sum(s.num_tokens for s in shares) == whole.num_tokens
        assert sum(s.num_real_tokens for s in shares) == whole.num_real_tokens
        assert [s.seq_ctx.num_padding for s in shares] == [s.seq_ctx.seq_len - s.num_real_tokens for s in shares]
        for share in shares:  # the head runs on rows that hold every supervised label of the share
            rows = share.seq_ctx.loss_positions
            supervised = torch.nonzero(share.labels[0] != IGNORE_INDEX).flatten()
            if rows is not None:
                assert set(supervised.tolist()) <= set(rows.tolist())

    def test_rank_r_keeps_run_r(self):
        whole = collate_pack(_random_pack([6, 10]))
        second = split_for_context_parallel(whole, 1, 2)
        assert torch.equal(second.seq_ctx.input_ids, whole.seq_ctx.input_ids[:, 8:])
        assert second.seq_ctx.position_ids.tolist() == [[2, 3, 4, 5, 6, 7, 8, 9]]
