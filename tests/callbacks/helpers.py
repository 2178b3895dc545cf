"""Helpers of the memory/speed callback tests: tiny models, one training step, a forward-call counter."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from xtl.batch import SequenceContext
from xtl.model import BaseModel
from xtl.strategies.parallelize import ModelTransform
from xtl.train.model_spec import resolve_model_config

DENSE = dict(
    model_type="qwen3", vocab_size=200, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, attn_impl="sdpa",
)  # fmt: skip
MOE = dict(
    DENSE, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, num_hidden_layers=2
)


def build(
    spec: dict[str, Any],
    transforms: Sequence[ModelTransform] = (),
    shard: Callable[[BaseModel], None] | None = None,
    device: str = "cpu",
) -> BaseModel:
    """A model built on meta, transformed in ``parallelize`` order, sharded by ``shard`` (e.g. FSDP2), then
    initialized from a fixed seed on ``device``."""
    config, _ = resolve_model_config(spec, None)
    with torch.device("meta"):
        model = config.build()
    for transform in sorted(transforms, key=lambda t: t.transform_stage):
        model = transform.transform_model(model)
    if shard is not None:
        shard(model)
    model.materialize(device)
    torch.manual_seed(0)
    model.init_weights()
    return model


def batch(vocab: int = 200, lengths: Sequence[int] = (30, 20, 14)) -> tuple[SequenceContext, torch.Tensor]:
    """A packed batch of a few documents and its (shifted) labels, from a fixed seed."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (1, sum(lengths)), generator=generator)
    labels = torch.randint(0, vocab, (1, sum(lengths)), generator=generator)
    return SequenceContext.from_lengths(ids, lengths), labels


def forward(model: BaseModel) -> torch.Tensor:
    """The training loss of ``model`` on :func:`batch`, on the model's device."""
    device = next(model.parameters()).device
    seq_ctx, labels = batch(model.config.vocab_size)
    return model(seq_ctx=seq_ctx.to(device), labels=labels.to(device), return_logits=False).loss


def step(model: BaseModel) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward/backward on :func:`batch`: the loss and each parameter's gradient (the grads are reset)."""
    loss = forward(model)
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def count_calls(modules: Sequence[torch.nn.Module]) -> list[int]:
    """Install forward pre-hooks counting the calls of each module; returns the live list of counts."""
    counts = [0] * len(modules)
    for i, module in enumerate(modules):
        module.register_forward_pre_hook(lambda *_, i=i: counts.__setitem__(i, counts[i] + 1))
    return counts


class ForwardCounter(pl.Callback):
    """Count the calls of every decoder layer's attention (recomputation calls it again) during fit; the counts
    are written to ``forward_calls.json`` in the working directory at the end."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Hook the attention of every decoder layer."""
        self.counts = count_calls([layer.self_attn for layer in pl_module.model.layers])

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Write the counts."""
        Path("forward_calls.json").write_text(json.dumps(self.counts))
