"""Router gate-logits selector: the model-dtype op under the HF-parity switch, fp32 otherwise."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from xtl.ops import get_router_logits_fn, hf_impl
from xtl.ops.moe_routing import router_logits_fp32, router_logits_native


def _selected(enabled: bool):
    """The op the selector returns with the switch ``enabled``, and bf16 inputs."""
    with hf_impl(enabled):
        fn = get_router_logits_fn()
    return fn, _inputs()


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(9, 32, dtype=torch.bfloat16)
    return x, torch.randn(6, 32, dtype=torch.bfloat16), torch.randn(6, dtype=torch.bfloat16)


class TestRouterLogitsSelector:
    def test_hf_parity_selects_the_model_dtype_op(self):
        fn, (x, weight, bias) = _selected(True)
        assert fn is router_logits_native
        logits = fn(x, weight, bias)
        assert logits.dtype == torch.bfloat16
        assert torch.equal(logits, F.linear(x, weight, bias))  # transformers' gate op

    def test_default_selects_fp32(self):
        fn, (x, weight, bias) = _selected(False)
        assert fn is router_logits_fp32
        logits = fn(x, weight, bias)
        assert logits.dtype == torch.float32
        assert torch.equal(logits, F.linear(x.float(), weight.float(), bias.float()))
        assert torch.equal(fn(x, weight, None), F.linear(x.float(), weight.float()))

    def test_both_agree_within_bf16_rounding(self):
        # the bf16 op rounds the 32-term dot product once to bf16 (relative error <= 2**-8)
        x, weight, bias = _inputs()
        fp32 = router_logits_fp32(x, weight, bias)
        native = router_logits_native(x, weight, bias).float()
        torch.testing.assert_close(native, fp32, atol=2e-2, rtol=2**-8)
