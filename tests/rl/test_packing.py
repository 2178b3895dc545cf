"""Rollout packing: packed prompt + completion sequences, their checkpoint state, the micro-batches of an update."""

from __future__ import annotations

import pytest
import torch

from xtl.rl.buffer import Sample
from xtl.rl.packing import RLMicroBatch, cut_micro_batches, pack_sequences, split_round_robin


class TestPackSequences:
    def test_completion_tokens_are_labelled_and_indexed_per_sequence(self) -> None:
        mb = pack_sequences([([5, 6, 7], [8, 9]), ([10], [11, 12, 13])], [1.0, -1.0])
        assert mb.batch.seq_ctx.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 11, 12, 13]]
        assert mb.positions.tolist() == [2, 3, 5, 6, 7], "positions whose next token is a completion token"
        assert mb.rows.tolist() == [[0, 1, 0], [2, 3, 4]] and mb.mask.tolist() == [[1, 1, 0], [1, 1, 1]]
        assert mb.advantages.tolist() == [1.0, -1.0]

    def test_an_empty_micro_batch_is_a_filler_without_completions(self) -> None:
        mb = pack_sequences([], [])
        assert mb.mask.numel() == 0 and mb.num_real_tokens == 2 and (mb.batch.labels == -100).all()

    def test_state_round_trip(self) -> None:
        mb = pack_sequences([([1, 2], [3]), ([4], [5, 6])], [0.5, -0.5])
        mb.old_logps, mb.num_items = torch.randn(2, 2), 3.0
        back = RLMicroBatch.from_state(mb.state())
        assert torch.equal(back.batch.seq_ctx.input_ids, mb.batch.seq_ctx.input_ids)
        assert torch.equal(back.batch.labels, mb.batch.labels) and torch.equal(back.old_logps, mb.old_logps)
        assert back.num_items == 3.0 and torch.equal(back.rows, mb.rows)


class TestCutMicroBatches:
    SAMPLES = [(Sample([1, 2], [3] * n, "stop", logprobs=[-0.5] * n), float(n)) for n in (1, 2, 3, 4, 5)]

    @pytest.mark.parametrize(
        ("loss_type", "normalizers"),
        [("grpo", [3, 2]), ("dr_grpo", [3 * 8, 2 * 8]), ("bnpo", [1 + 3 + 5, 2 + 4]), ("dapo", [9, 6])],
    )
    def test_each_micro_batch_carries_its_share_of_the_normalizer(self, loss_type, normalizers) -> None:
        parts = cut_micro_batches(self.SAMPLES, 2, loss_type, max_new_tokens=8)
        assert [mb.num_items for mb in parts] == normalizers
        assert [mb.advantages.tolist() for mb in parts] == [[1.0, 3.0, 5.0], [2.0, 4.0]], "dealt round-robin"

    def test_engine_log_probs_ride_along_and_an_empty_part_is_a_filler(self) -> None:
        first, second, third = cut_micro_batches(self.SAMPLES[:2], 3, "grpo", max_new_tokens=8)
        assert first.sampling_logps.tolist() == [[-0.5]] and second.sampling_logps.tolist() == [[-0.5, -0.5]]
        assert third.sequences == [] and third.num_items == 0 and third.sampling_logps is None

    def test_split_round_robin(self) -> None:
        assert split_round_robin(list(range(5)), 3) == [[0, 3], [1, 4], [2]]
