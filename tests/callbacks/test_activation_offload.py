"""Tests for ``ActivationOffload``: options, bytes really copied (as many as the layers save), parameter views
left in place by storage, composition with checkpointing, bitwise-equal tiny CLI runs, and the CUDA path."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.callbacks.helpers import DENSE, MOE, build, count_calls, forward, step
from tests.cli.test_cli import ROOT
from xtl.callbacks import ActivationCheckpointing, ActivationOffload

FRAGMENT = ROOT / "callbacks/activation_offload.yaml"
CHECKPOINTING = ROOT / "callbacks/activation_checkpointing.yaml"


class _ToyLayer(nn.Module):
    """``relu(x @ w.T) @ v``: saves ``x``, the view ``w.t()``, ``h`` (twice: relu and matmul) and ``v``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 4))
        self.v = nn.Parameter(torch.randn(6, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ self.w.t()) @ self.v


class _Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_ToyLayer(), _ToyLayer()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[1](self.layers[0](x) @ torch.ones(3, 4))

    def layer_stacks(self) -> dict[str, nn.ModuleList]:
        return {"language": self.layers}


def _saved_in_layers(model: nn.Module) -> tuple[int, int]:
    """(bytes of the distinct non-parameter storages each layer call saves, bytes of saved parameter views)
    during one step of ``model``, counted by independent hooks."""
    totals = [0, 0]

    def enter(layer, args):
        params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
        seen: set[int] = set()

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr in params:
                totals[1] += t.numel() * t.element_size()
            elif ptr not in seen:
                seen.add(ptr)
                totals[0] += t.untyped_storage().nbytes()
            return t.detach()  # a reference keeps the address from being reused

        layer._ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        layer._ctx.__enter__()

    def leave(layer, args, out):
        layer._ctx.__exit__(None, None, None)

    for layer in model.layers:
        layer.register_forward_pre_hook(enter)
        layer.register_forward_hook(leave)
    step(model)
    return totals[0], totals[1]


class TestOptions:
    @pytest.mark.parametrize("k", [0, -1])
    def test_every_n_layers_below_one_names_the_key(self, k):
        with pytest.raises(ValueError, match="every_n_layers"):
            ActivationOffload(every_n_layers=k)

    def test_layers_and_every_n_layers_exclude_each_other(self):
        with pytest.raises(ValueError, match="layers"):
            ActivationOffload(layers=[0], every_n_layers=2)

    def test_layer_index_out_of_range_names_the_key(self):
        with pytest.raises(ValueError, match="layers"):
            build(DENSE, [ActivationOffload(layers=[3])])

    @pytest.mark.parametrize(
        ("options", "chosen"), [({}, [0, 1, 2]), ({"every_n_layers": 2}, [0, 2]), ({"layers": [-1, 1]}, [1, 2])]
    )
    def test_chosen_layers(self, options, chosen):
        callback = ActivationOffload(**options)
        build(DENSE, [callback])
        assert callback.offloaded_layers == {"language": chosen}


class TestOffload:
    @pytest.mark.parametrize("spec", [DENSE, MOE], ids=["dense", "moe"])
    def test_copies_what_the_layers_save_and_keeps_gradients(self, spec):
        base_loss, base_grads = step(build(spec))
        saved, param_bytes = _saved_in_layers(build(spec))
        callback = ActivationOffload()
        loss, grads = step(build(spec, [callback]))
        stats = callback.stats
        assert stats.offloaded_bytes == saved > 0
        assert stats.kept_bytes == param_bytes > 0, "views of the weights (w.t() of each linear) stay"
        assert torch.equal(loss, base_loss)
        assert all(torch.equal(grads[name], g) for name, g in base_grads.items())

    def test_host_copies_are_released_after_backward(self):
        callback = ActivationOffload()
        loss = forward(build(DENSE, [callback]))
        assert callback.stats.held_bytes == callback.stats.offloaded_bytes > 0
        loss.backward()
        del loss
        assert callback.stats.held_bytes == 0

    def test_parameter_views_are_kept_by_storage(self):
        torch.manual_seed(0)
        model = _Toy()
        callback = ActivationOffload()
        callback.transform_model(model)
        x = torch.randn(5, 4, requires_grad=True)
        model(x).sum().backward()
        stats = callback.stats
        # per layer: w.t() (a view, not a Parameter) and v stay; x and h (saved twice, one storage) move
        assert (stats.kept_tensors, stats.kept_bytes) == (4, 2 * (6 * 4 + 6 * 3) * 4)
        assert stats.offloaded_tensors == 6
        assert stats.offloaded_bytes == 2 * (5 * 4 + 5 * 6) * 4

    def test_only_the_chosen_layers(self):
        callback = ActivationOffload(layers=[1])
        step(build(DENSE, [callback]))
        one = callback.stats.offloaded_bytes
        everything = ActivationOffload()
        step(build(DENSE, [everything]))
        assert 0 < one < everything.stats.offloaded_bytes

    def test_nothing_is_offloaded_without_gradients(self):
        callback = ActivationOffload()
        model = build(DENSE, [callback])
        with torch.no_grad():
            forward(model)
        assert callback.stats.offloaded_tensors == callback.stats.kept_tensors == 0

    @pytest.mark.parametrize("mode", ["full", "selective"])
    def test_with_checkpointing_the_checkpoint_inputs_move(self, mode):
        _, base_grads = step(build(DENSE))
        offload = ActivationOffload()
        model = build(DENSE, [offload, ActivationCheckpointing(mode=mode)])  # callback order must not matter
        calls = count_calls([layer.self_attn for layer in model.layers])
        _, grads = step(model)
        assert calls == [2, 2, 2], "still recomputed"
        hidden = 64 * 32 * 4  # each layer saves its (1, T, C) input only
        assert offload.stats.offloaded_bytes == 3 * hidden
        assert all(torch.equal(grads[name], g) for name, g in base_grads.items())


class TestTinyRuns:
    @pytest.mark.parametrize("recipe", ["tiny_sft.yaml", "tiny_moe_sft.yaml"])
    @pytest.mark.parametrize("with_checkpointing", [False, True], ids=["offload", "offload+checkpointing"])
    def test_loss_and_grad_norm_equal_the_run_without_offload(self, recipe, with_checkpointing, tiny_fit):
        base = tiny_fit(recipe)
        fragments = (FRAGMENT, CHECKPOINTING) if with_checkpointing else (FRAGMENT,)
        run = tiny_fit(recipe, *fragments)
        assert len(run.rows) == 3
        assert run.column("train/loss") == base.column("train/loss")
        assert run.column("train/grad_norm") == base.column("train/grad_norm")
        assert all(float(gib) > 0 for gib in run.column("train/offloaded_gib"))
        assert run.forward_calls == ([12, 12] if with_checkpointing else [6, 6])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
class TestCUDA:
    @pytest.mark.parametrize("checkpointing", [False, True], ids=["offload", "offload+checkpointing"])
    def test_pinned_side_stream_copies_give_equal_gradients(self, checkpointing):
        loss0, grads0 = step(build(DENSE, device="cuda"))
        offload = ActivationOffload()
        transforms = [offload, ActivationCheckpointing()] if checkpointing else [offload]
        model = build(DENSE, transforms, device="cuda")
        for _ in range(2):  # the second step reuses the pooled pinned buffers
            loss, grads = step(model)
        assert torch.equal(loss, loss0)
        assert all(torch.equal(grads[name], g) for name, g in grads0.items())
        assert offload.stats.offloaded_bytes > 0

    @pytest.mark.parametrize("spec", [DENSE, MOE], ids=["dense", "moe"])
    def test_device_memory_held_after_forward_drops_by_half(self, spec):
        def held(model):
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            loss = forward(model)
            torch.cuda.synchronize()
            after = torch.cuda.memory_allocated()
            loss.backward()
            return after - before

        base = held(build(spec, device="cuda"))
        offloaded = held(build(spec, [ActivationOffload()], device="cuda"))
        assert offloaded < 0.5 * base
