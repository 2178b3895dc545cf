"""MoE gather and combine selectors against transformers-style per-expert loops."""

from __future__ import annotations

import torch

from xtl.ops import get_moe_combine_fn, get_moe_gather_fn, hf_impl
from xtl.ops.moe_dispatch import (
    combine_expert_rows,
    combine_expert_rows_hf,
    gather_expert_rows,
    gather_expert_rows_hf,
)

NUM_TOKENS, NUM_EXPERTS, TOP_K, WIDTH = 12, 6, 3, 64


def _routing(dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Random distinct top-k choices (expert 5 idle) laid out as :class:`xtl.module.LocalDispatcher` does."""
    torch.manual_seed(0)
    topk_ids = torch.stack([torch.randperm(NUM_EXPERTS - 1)[:TOP_K] for _ in range(NUM_TOKENS)])
    flat_ids = topk_ids.t().reshape(-1)
    row_order = torch.argsort(flat_ids, stable=True)
    return {
        "topk_ids": topk_ids,
        "row_order": row_order,
        "row_expert": flat_ids[row_order],
        "token_idx": row_order % NUM_TOKENS,
        "tokens_per_expert": torch.bincount(flat_ids, minlength=NUM_EXPERTS),
        "row_weights": torch.rand(NUM_TOKENS * TOP_K, dtype=dtype),
        "expert_out": torch.randn(NUM_TOKENS * TOP_K, WIDTH, dtype=dtype),
    }


def _gather_reference(hidden_states: torch.Tensor, r: dict[str, torch.Tensor]) -> torch.Tensor:
    """transformers' loop: ``hidden_states[token_idx]`` once per expert with rows, in ascending expert order."""
    parts = [hidden_states[r["token_idx"][r["row_expert"] == e]] for e in range(NUM_EXPERTS)]
    return torch.cat([p for p in parts if p.shape[0]])


def _combine_reference(r: dict[str, torch.Tensor]) -> torch.Tensor:
    """transformers' loop: per expert in ascending order, ``out[token] += (row * weight).to(dtype)``."""
    out = torch.zeros(NUM_TOKENS, WIDTH, dtype=r["expert_out"].dtype)
    for expert in range(NUM_EXPERTS):
        for m in (r["row_expert"] == expert).nonzero().flatten().tolist():
            t = r["token_idx"][m]
            out[t] = out[t] + (r["expert_out"][m] * r["row_weights"][m]).to(out.dtype)
    return out


def _combine(fn, r: dict[str, torch.Tensor]) -> torch.Tensor:
    return fn(r["expert_out"], r["row_weights"], r["row_order"], r["topk_ids"])


class TestMoEGatherSelector:
    def _run(self, fn):
        r = _routing()
        hidden_states = torch.randn(NUM_TOKENS, WIDTH, dtype=torch.bfloat16, requires_grad=True)
        rows = fn(hidden_states, r["token_idx"], r["tokens_per_expert"])
        rows.backward(torch.randn_like(rows, generator=torch.Generator().manual_seed(1)))
        return hidden_states, r, rows, hidden_states.grad

    def test_hf_parity_selects_the_per_expert_gather_equal_to_the_loop(self):
        with hf_impl(True):
            fn = get_moe_gather_fn()
        assert fn is gather_expert_rows_hf
        hidden_states, r, rows, grad = self._run(fn)
        ref_input = hidden_states.detach().clone().requires_grad_()
        ref = _gather_reference(ref_input, r)
        ref.backward(torch.randn_like(ref, generator=torch.Generator().manual_seed(1)))
        assert torch.equal(rows, ref)
        assert torch.equal(grad, ref_input.grad)

    def test_default_selects_one_gather_that_agrees(self):
        with hf_impl(False):
            fn = get_moe_gather_fn()
        assert fn is gather_expert_rows
        _, _, rows, grad = self._run(fn)
        _, _, hf_rows, hf_grad = self._run(gather_expert_rows_hf)
        assert torch.equal(rows, hf_rows)  # a gather is exact
        # the input gradient sums k = 3 bf16 rows per token in some order: within a few bf16 ulps
        torch.testing.assert_close(grad, hf_grad, atol=2e-2, rtol=2e-2)

    def test_without_rows(self):
        hidden_states, empty = torch.randn(0, 4), torch.zeros(0, dtype=torch.long)
        assert gather_expert_rows_hf(hidden_states, empty, torch.zeros(3, dtype=torch.long)).shape == (0, 4)


class TestMoECombineSelector:
    def test_hf_parity_selects_the_expert_order_sum_equal_to_the_loop(self):
        with hf_impl(True):
            fn = get_moe_combine_fn()
        assert fn is combine_expert_rows_hf
        r = _routing()
        out = _combine(fn, r)
        assert out.dtype == torch.bfloat16
        assert torch.equal(out, _combine_reference(r))

    def test_default_selects_the_fp32_sum(self):
        with hf_impl(False):
            fn = get_moe_combine_fn()
        assert fn is combine_expert_rows
        r = _routing()
        expected = torch.zeros(NUM_TOKENS, WIDTH, dtype=torch.float64)
        for m, t in enumerate(r["token_idx"].tolist()):
            expected[t] += r["expert_out"][m].double() * r["row_weights"][m].double()
        out = _combine(fn, r)
        assert out.dtype == torch.bfloat16
        # one rounding to bf16 of a sum held in fp32: half a bf16 ulp, plus fp32 noise
        torch.testing.assert_close(out.double(), expected, atol=1e-6, rtol=2**-8)

    def test_both_agree_within_bf16_rounding_but_not_bitwise(self):
        r = _routing()
        fast, hf = _combine(combine_expert_rows, r), _combine(combine_expert_rows_hf, r)
        # the HF order rounds each product and each partial sum to bf16: up to ~3 bf16 ulps of the largest term
        torch.testing.assert_close(fast.float(), hf.float(), atol=3e-2, rtol=2e-2)
        assert not torch.equal(fast, hf)  # the order matters, hence the HF op for parity
