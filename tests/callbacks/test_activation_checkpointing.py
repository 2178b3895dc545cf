"""Tests for ``ActivationCheckpointing``: options, recomputation (full, every k-th layer, selective), exact
gradients on dense and MoE models, names kept, FSDP2 on top, and bitwise-equal tiny CLI runs."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils._python_dispatch import TorchDispatchMode

from tests.callbacks.helpers import DENSE, MOE, build, count_calls, forward, step
from tests.cli.test_cli import ROOT
from xtl.callbacks import ActivationCheckpointing, ActivationOffload

FRAGMENT = ROOT / "callbacks/activation_checkpointing.yaml"


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops run while active, by overload packet name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _step_counting_backward_ops(model) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, int]]:
    """One step of ``model``: the loss, the gradients and the ops backward ran (recomputation included) by name."""
    loss = forward(model)
    with _OpCounter() as counter:
        loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}, counter.counts


class TestOptions:
    def test_unknown_mode_names_the_key(self):
        with pytest.raises(ValueError, match="mode"):
            ActivationCheckpointing(mode="everything")

    @pytest.mark.parametrize("k", [0, -2])
    def test_every_n_layers_below_one_names_the_key(self, k):
        with pytest.raises(ValueError, match="every_n_layers"):
            ActivationCheckpointing(every_n_layers=k)


class TestRecomputation:
    def test_full_runs_every_layer_forward_twice_with_equal_gradients(self):
        base_loss, base_grads = step(build(DENSE))
        callback = ActivationCheckpointing()
        model = build(DENSE, [callback])
        calls = count_calls([layer.self_attn for layer in model.layers])
        loss, grads = step(model)
        assert callback.checkpointed_layers == {"language": [0, 1, 2]}
        assert calls == [2, 2, 2], "forward + recomputation in backward"
        assert torch.equal(loss, base_loss)
        assert all(torch.equal(grads[name], g) for name, g in base_grads.items())

    def test_every_n_layers_recomputes_only_layers_i_mod_k_zero(self):
        model = build(DENSE, [ActivationCheckpointing(every_n_layers=2)])
        calls = count_calls([layer.self_attn for layer in model.layers])
        step(model)
        assert calls == [2, 1, 2]

    def test_parameter_names_are_unchanged(self):
        names = [name for name, _ in build(DENSE).named_parameters()]
        assert [name for name, _ in build(DENSE, [ActivationCheckpointing()]).named_parameters()] == names

    def test_selective_recomputes_norms_but_not_matmuls(self):
        _, base_grads, base = _step_counting_backward_ops(build(DENSE))
        _, _, full = _step_counting_backward_ops(build(DENSE, [ActivationCheckpointing()]))
        _, grads, selective = _step_counting_backward_ops(build(DENSE, [ActivationCheckpointing(mode="selective")]))
        assert full["mm"] > base["mm"], "full recomputes the projections"
        assert selective["mm"] == base["mm"], "selective keeps matmul outputs"
        assert selective["rsqrt"] > base.get("rsqrt", 0), "selective recomputes the norms"
        assert all(torch.equal(grads[name], g) for name, g in base_grads.items())

    @pytest.mark.parametrize("mode", ["full", "selective"])
    def test_moe_recomputes_without_rerouting(self, mode):
        base_loss, base_grads = step(build(MOE))
        model = build(MOE, [ActivationCheckpointing(mode=mode)])
        calls = count_calls([layer.self_attn for layer in model.layers])
        # a changed routing would raise torch.utils.checkpoint.CheckpointError
        loss, grads, ops = _step_counting_backward_ops(model)
        assert calls == [2, 2]
        assert "topk" not in ops, "routing decisions are kept, not recomputed"
        assert torch.equal(loss, base_loss)
        assert all(torch.equal(grads[name], g) for name, g in base_grads.items())


@pytest.fixture
def single_rank_group():
    """A one-process gloo group, so FSDP2 can shard in this process."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class TestWithFSDP2:
    @pytest.mark.parametrize("spec", [DENSE, MOE], ids=["dense", "moe"])
    def test_fsdp2_after_checkpointing_and_offload_gives_equal_gradients(self, spec, single_rank_group):
        mesh = init_device_mesh("cpu", (1,))

        def shard(model):  # the strategy's order: each decoder layer, then the root
            for layer in model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)

        _, base_grads = step(build(spec))
        offload = ActivationOffload()
        model = build(spec, [ActivationCheckpointing(), offload], shard=shard)
        calls = count_calls([layer.self_attn for layer in model.layers])
        _, grads = step(model)
        assert calls == [2] * len(model.layers)
        assert offload.stats.offloaded_bytes > 0
        assert offload.stats.kept_tensors == 0, "the checkpoint inputs are activations only"
        for name, g in base_grads.items():
            assert torch.equal(grads[name].full_tensor(), g), name


class TestTinyRuns:
    # 3 steps of 2 micro-batches: the attention of each of the 2 layers runs 6 times, 12 with recomputation
    @pytest.mark.parametrize("recipe", ["tiny_sft.yaml", "tiny_moe_sft.yaml"])
    def test_loss_and_grad_norm_equal_the_run_without_checkpointing(self, recipe, tiny_fit):
        base = tiny_fit(recipe)
        run = tiny_fit(recipe, FRAGMENT)
        assert len(run.rows) == 3
        assert run.column("train/loss") == base.column("train/loss")
        assert run.column("train/grad_norm") == base.column("train/grad_norm")
        assert base.forward_calls == [6, 6]
        assert run.forward_calls == [12, 12]
