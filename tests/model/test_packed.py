"""Packed varlen forward: documents in one SequenceContext never see each other."""

from __future__ import annotations

import pytest
import torch

from xtl.model import SequenceContext, get_model_config_from_hf
from xtl.ops import shift_labels

LENGTHS = [7, 13, 10]


def _model(path, attn_impl):
    cfg = get_model_config_from_hf(path)
    cfg.attn_impl = attn_impl
    model = cfg.build()
    model.from_hf(path)
    return model.eval()


class TestPackedForward:
    # fp32 tolerance: the same math on differently shaped matmuls (T vs n rows) may round differently in the
    # last bits; 1e-5 absolute on logits of magnitude ~1 is far below any cross-document leak (~1e-2).
    ATOL = 1e-5

    @pytest.mark.parametrize("attn_impl", ["sdpa", "eager"])
    @pytest.mark.parametrize("variant", ["qwen3", "llama_llama3_rope", "qwen2"])
    def test_each_document_equals_running_it_alone(self, tiny_hf_dir, variant, attn_impl):
        model = _model(tiny_hf_dir(variant), attn_impl)
        torch.manual_seed(0)
        ids = torch.randint(0, 160, (1, sum(LENGTHS)))
        ctx = SequenceContext.from_lengths(ids, LENGTHS)
        with torch.no_grad():
            packed = model(seq_ctx=ctx).logits
            start = 0
            for n in LENGTHS:
                alone = model(input_ids=ids[:, start : start + n]).logits
                torch.testing.assert_close(packed[:, start : start + n], alone, atol=self.ATOL, rtol=0)
                start += n

    def test_changing_one_document_leaves_the_others_untouched(self, tiny_hf_dir):
        model = _model(tiny_hf_dir("qwen3"), "sdpa")
        ids = torch.randint(0, 160, (1, sum(LENGTHS)))
        other = ids.clone()
        other[:, :7] = (other[:, :7] + 1) % 160
        with torch.no_grad():
            a = model(seq_ctx=SequenceContext.from_lengths(ids, LENGTHS)).logits
            b = model(seq_ctx=SequenceContext.from_lengths(other, LENGTHS)).logits
        assert not torch.equal(a[:, :7], b[:, :7])
        assert torch.equal(a[:, 7:], b[:, 7:])

    def test_packed_loss_sums_document_losses(self, tiny_hf_dir):
        model = _model(tiny_hf_dir("qwen3"), "sdpa")
        ids = torch.randint(0, 160, (1, sum(LENGTHS)))
        labels = torch.cat([shift_labels(ids[:, s : s + n]) for s, n in zip([0, 7, 20], LENGTHS)], dim=1)
        with torch.no_grad():
            out = model(seq_ctx=SequenceContext.from_lengths(ids, LENGTHS), labels=labels)
            alone = [model(input_ids=ids[:, s : s + n], labels=ids[:, s : s + n]) for s, n in zip([0, 7, 20], LENGTHS)]
        assert int(out.num_tokens) == sum(n - 1 for n in LENGTHS)
        torch.testing.assert_close(out.loss_sum, sum(o.loss_sum for o in alone), atol=1e-4, rtol=1e-6)

    def test_seq_ctx_excludes_hf_style_arguments(self, tiny_hf_dir):
        model = _model(tiny_hf_dir("qwen3"), "sdpa")
        ids = torch.randint(0, 160, (1, 8))
        with pytest.raises(ValueError, match="either seq_ctx or"):
            model(input_ids=ids, seq_ctx=SequenceContext.from_input_ids(ids))


class TestSequenceContext:
    def test_from_lengths(self):
        ctx = SequenceContext.from_lengths(torch.arange(6), [2, 3, 1])
        assert ctx.cu_seq_lens.tolist() == [0, 2, 5, 6]
        assert ctx.position_ids.tolist() == [[0, 1, 0, 1, 2, 0]]
        assert ctx.max_seq_len == 3 and ctx.num_docs == 3 and ctx.seq_len == 6
        assert ctx.document_ids().tolist() == [0, 0, 1, 1, 1, 2]

    @pytest.mark.parametrize(("lengths", "message"), [([2, 3], "sum to 5"), ([3, 0, 3], "positive")])
    def test_bad_lengths(self, lengths, message):
        with pytest.raises(ValueError, match=message):
            SequenceContext.from_lengths(torch.arange(6), lengths)


class TestLossPositions:
    def test_head_on_supervised_rows_only_gives_the_same_loss_and_gradients(self, tiny_hf_dir, monkeypatch):
        import xtl.model.dense.dense as dense

        model = _model(tiny_hf_dir("qwen3"), "sdpa").train()
        torch.manual_seed(0)
        ids = torch.randint(0, 160, (1, sum(LENGTHS)))
        labels = torch.randint(0, 160, (1, sum(LENGTHS)))
        labels[:, ::3] = -100  # a third of the positions carry no loss
        rows_seen = []
        head = dense.lm_head_loss
        monkeypatch.setattr(dense, "lm_head_loss", lambda h, *a, **k: rows_seen.append(h.shape[1]) or head(h, *a, **k))

        def step(ctx):
            model.zero_grad()
            out = model(seq_ctx=ctx, labels=labels, return_logits=False)
            out.loss_sum.backward()
            return out.loss_sum.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

        every = SequenceContext.from_lengths(ids, LENGTHS)
        selected = SequenceContext.from_lengths(ids, LENGTHS)
        selected.loss_positions = (labels[0] != -100).nonzero().squeeze(1)
        loss_all, grads_all = step(every)
        loss_sel, grads_sel = step(selected)
        assert rows_seen == [30, 20], "the head ran on the 20 supervised rows only"
        # fp32; the same per-token math, summed over different chunkings of the rows
        torch.testing.assert_close(loss_sel, loss_all, rtol=1e-6, atol=0)
        for name, grad in grads_all.items():
            torch.testing.assert_close(grads_sel[name], grad, rtol=1e-5, atol=1e-7)

    def test_collate_finds_the_supervised_positions_on_the_host(self):
        import numpy as np

        from xtl.data.collate import collate_pack, loss_rows
        from xtl.data.packing import Pack

        # topped up with the first unsupervised positions to a multiple of 4 rows
        assert loss_rows(np.array([5, 9, 12]), 20, multiple=4).tolist() == [0, 5, 9, 12]
        assert loss_rows(np.array([5, 9, 12]), 4, multiple=4) is None, "every position: nothing to select"
        assert loss_rows(np.array([], dtype=np.int64), 20) is None
        ids = np.arange(300, dtype=np.int64)
        labels = np.full(300, -100, dtype=np.int64)
        labels[50:60] = 7
        mb = collate_pack(Pack(input_ids=ids, labels=labels, lengths=[300], index=0))
        # shifted targets: position t carries token t+1's label
        assert mb.num_tokens == 10 and len(mb.seq_ctx.loss_positions) == 128
        assert set(range(49, 59)) <= set(mb.seq_ctx.loss_positions.tolist())
