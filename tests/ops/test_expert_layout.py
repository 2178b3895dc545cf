"""Gate/up layout selector: transformers' interleaved layout under the HF-parity switch, views otherwise."""

from __future__ import annotations

import torch

from xtl.ops import get_gate_up_layout, hf_impl
from xtl.ops.expert_layout import GATE_UP_CONCAT, GATE_UP_INTERLEAVED, deinterleave_gate_up, interleave_gate_up
from xtl.ops.grouped_gemm import grouped_gemm_loop

EXPERTS, WIDTH, INTER = 3, 8, 5


def _params() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    gate_up = torch.randn(EXPERTS, 2 * INTER, WIDTH)
    return gate_up, torch.randn(EXPERTS, 2 * INTER), torch.randn(EXPERTS, WIDTH, INTER)


def _selected(enabled: bool):
    """The layout the selector returns with the switch ``enabled``, the parameters and their operands."""
    with hf_impl(enabled):
        layout = get_gate_up_layout()
    params = _params()
    return layout, params, layout.operands(*params)


class TestGateUpLayoutSelector:
    def test_hf_parity_selects_the_interleaved_copies(self):
        layout, (gate_up, bias, down), (w1, b1, w2) = _selected(True)
        assert layout is GATE_UP_INTERLEAVED
        assert w1.is_contiguous() and w2.is_contiguous()
        # transformers' GPT-OSS layout: column 2i is gate row i, column 2i+1 is up row i
        assert torch.equal(w1[:, :, 0::2], gate_up[:, :INTER].transpose(1, 2))
        assert torch.equal(w1[:, :, 1::2], gate_up[:, INTER:].transpose(1, 2))
        assert torch.equal(b1[:, 0::2], bias[:, :INTER]) and torch.equal(b1[:, 1::2], bias[:, INTER:])
        assert torch.equal(w2, down.transpose(1, 2))
        self._check_split(layout, w1, b1, gate_up, bias)

    def test_default_selects_views_of_the_parameters(self):
        layout, (gate_up, bias, down), (w1, b1, w2) = _selected(False)
        assert layout is GATE_UP_CONCAT
        assert w1.data_ptr() == gate_up.data_ptr() and w2.data_ptr() == down.data_ptr() and b1 is bias
        self._check_split(layout, w1, b1, gate_up, bias)

    def test_both_give_the_same_gate_and_up_projections(self):
        # the same dot products with columns in another order: equal up to fp32 summation order
        gate_up, bias, down = _params()
        x, counts = torch.randn(7, WIDTH), torch.tensor([2, 0, 5])
        projections = []
        for layout in (GATE_UP_CONCAT, GATE_UP_INTERLEAVED):
            w1, b1, _ = layout.operands(gate_up, bias, down)
            projections.append(layout.split(grouped_gemm_loop(x, w1, counts) + b1.repeat_interleave(counts, 0)))
        for concat, interleaved in zip(*projections):
            torch.testing.assert_close(concat, interleaved, atol=1e-5, rtol=1e-5)

    def test_interleave_round_trip(self):
        gate_up, _, _ = _params()
        assert torch.equal(deinterleave_gate_up(interleave_gate_up(gate_up, dim=1), dim=1), gate_up)

    @staticmethod
    def _check_split(layout, w1, b1, gate_up, bias) -> None:
        gate, up = layout.split(w1)
        assert torch.equal(gate, gate_up[:, :INTER].transpose(1, 2)) and torch.equal(up, gate_up[:, INTER:].mT)
        gate_b, up_b = layout.split(b1)
        assert torch.equal(gate_b, bias[:, :INTER]) and torch.equal(up_b, bias[:, INTER:])
