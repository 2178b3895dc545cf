"""Shared assertions of the layer parity tests (dense and MoE)."""

from __future__ import annotations

import torch

from xtl.ops import causal_lm_loss, shift_labels


def assert_head_loss_and_input_grad_equal(hf, model, out_hf, out_xtl, x_hf, x_xtl, labels) -> None:  # noqa: ANN001
    """Layer output -> final norm -> LM head -> loss: losses and dL/dx of transformers and xtl are bitwise equal."""
    assert torch.equal(out_hf, out_xtl)
    loss_hf = hf.loss_function(hf.lm_head(hf.model.norm(out_hf)), labels, hf.config.vocab_size)
    loss_xtl, _, _ = causal_lm_loss(model.lm_head(model.norm(out_xtl)), shift_labels(labels))
    assert torch.equal(loss_hf, loss_xtl)
    loss_hf.backward()
    loss_xtl.backward()
    assert torch.equal(x_hf.grad, x_xtl.grad)
