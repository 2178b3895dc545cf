"""Gradient invariance: the step's gradients do not depend on how tokens are split into ranks and micro-batches."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from xtl.model import SequenceContext
from xtl.ops import shift_labels
from xtl.strategies.parallelize import fully_shard_model
from xtl.train import resolve_model_config
from xtl.train.step import forward_backward, grad_norm_and_clip

MODEL = {
    "model_type": "qwen3",
    "vocab_size": 97,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "attn_impl": "sdpa",
}
# four micro-batches of packed documents; labels masked on some tokens so token counts differ per micro-batch
DOC_LENGTHS = [[5, 9], [11], [3, 4, 6], [12]]


def _model() -> torch.nn.Module:
    config, _ = resolve_model_config(MODEL)
    model = config.build()
    torch.manual_seed(0)
    model.init_weights()
    return model


def _micro_batches() -> list[tuple[SequenceContext, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    batches = []
    for lengths in DOC_LENGTHS:
        docs = [torch.randint(0, 97, (n,), generator=g) for n in lengths]
        labels = torch.cat([shift_labels(d[None])[0] for d in docs])
        labels[: lengths[0] // 2] = -100  # an unsupervised prompt
        batches.append((SequenceContext.from_lengths(torch.cat(docs)[None], lengths), labels[None]))
    return batches


def _merged(batches):
    ids = torch.cat([ctx.input_ids for ctx, _ in batches], dim=1)
    lengths = [n for ctx, _ in batches for n in ctx.lengths]
    return SequenceContext.from_lengths(ids, lengths), torch.cat([lab for _, lab in batches], dim=1)


def _step(model, batches, dp_world_size, group=None):
    return forward_backward(
        forward=lambda mb: model(seq_ctx=mb[0], labels=mb[1], return_logits=False),
        micro_batches=batches,
        num_tokens=lambda mb: int((mb[1] != -100).sum()),
        dp_world_size=dp_world_size,
        backward=lambda loss: loss.backward(),
        device=torch.device("cpu"),
        group=group,
        gradient_sync=getattr(model, "set_requires_gradient_sync", None),
    )


def _fsdp_worker(rank: int, world: int, port: int, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    model = _model()
    fully_shard_model(model, mesh=init_device_mesh("cpu", (world,)))
    batches = _micro_batches()[2 * rank : 2 * rank + 2]
    result = _step(model, batches, world, dist.group.WORLD)
    norm = grad_norm_and_clip(list(model.parameters()), None)
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    # a model initialized after sharding equals the unsharded initialization
    config, _ = resolve_model_config(MODEL)
    with torch.device("meta"):
        sharded = config.build()
    fully_shard_model(sharded, mesh=init_device_mesh("cpu", (world,)))
    sharded.materialize("cpu")
    torch.manual_seed(0)
    sharded.init_weights()
    init = {name: p.full_tensor() for name, p in sharded.named_parameters()}
    if rank == 0:
        torch.save({"grads": grads, "tokens": result.global_tokens, "norm": norm, "init": init}, out_path)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TestGradientInvariance:
    # fp32: the same sums in a different order (per micro-batch, per rank, then averaged): 1e-6 relative on
    # gradients of magnitude ~1e-2..1 is a few ulps of accumulated rounding.
    TOL = {"rtol": 1e-5, "atol": 1e-6}

    def _reference(self):
        model = _model()
        _step(model, [_merged(_micro_batches())], 1)
        return model

    def test_one_rank_micro_batch_split_matches_single_micro_batch(self):
        reference = self._reference()
        model = _model()
        _step(model, _micro_batches(), 1)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **self.TOL, msg=name)

    @pytest.mark.distributed
    def test_two_fsdp_ranks_two_micro_batches_match_one_rank_one_micro_batch(self, tmp_path):
        out = tmp_path / "grads.pt"
        mp.spawn(_fsdp_worker, args=(2, _free_port(), str(out)), nprocs=2, join=True)
        got = torch.load(out)
        reference = self._reference()
        assert int(got["tokens"]) == sum(int((lab != -100).sum()) for _, lab in _micro_batches())
        for name, p in reference.named_parameters():
            torch.testing.assert_close(got["grads"][name], p.grad, **self.TOL, msg=name)
        ref_norm = grad_norm_and_clip(list(reference.parameters()), None)
        torch.testing.assert_close(got["norm"], ref_norm, rtol=1e-5, atol=0)
        for name, p in _model().named_parameters():
            assert torch.equal(got["init"][name], p.detach()), f"sharded init differs for {name}"
