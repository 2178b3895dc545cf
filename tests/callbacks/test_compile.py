"""Tests for ``Compile``: options, layers compiled in place (names kept), exact numerics with ``aot_eager``,
``train/recompiles`` (logged, 0 after the first step with fixed-length packs; new documents or supervised-row counts
compile nothing), the whole-forward scope (text and vision-language models; under FSDP, expert and context
parallelism in ``test_compile_parallel.py``), and inductor within 1e-4."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from tests.callbacks.helpers import DENSE, MOE, build, count_calls, step
from tests.callbacks.test_compile_parallel import packs
from tests.cli.test_cli import ROOT
from tests.model.vlm import build_tiny_vlm
from tests.strategies.test_context_parallel import MODELS
from xtl.batch import SequenceContext
from xtl.callbacks import ActivationCheckpointing, ActivationOffload, Compile
from xtl.callbacks import compile as compile_module
from xtl.data import XTLDataModule
from xtl.data.collate import MicroBatch
from xtl.errors import ConfigError
from xtl.model import BaseModel, get_model_config_from_hf
from xtl.ops import IGNORE_INDEX
from xtl.train import resolve_model_config

FRAGMENT = ROOT / "callbacks/compile.yaml"


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Start each test without compiled code of earlier tests (layers of other models would share it)."""
    torch._dynamo.reset()


def _fragment(backend: str) -> str:
    text = FRAGMENT.read_text()
    assert "backend: inductor" in text
    return text.replace("backend: inductor", f"backend: {backend}")


class TestOptions:
    def test_unknown_backend_names_the_key(self):
        with pytest.raises(ValueError, match="backend"):
            Compile(backend="fastest")

    def test_unknown_mode_names_the_key(self):
        with pytest.raises(ValueError, match="mode"):
            Compile(mode="turbo")

    def test_unknown_scope_names_the_key(self):
        with pytest.raises(ValueError, match="scope"):
            Compile(scope="step")

    def test_the_whole_forward_refuses_fullgraph_only(self, tmp_path):
        """Any number of devices (``tests/callbacks/test_compile_parallel.py``) and vision-language models run."""
        Compile(scope="model").setup(SimpleNamespace(world_size=2, datamodule=None), None, "fit")
        build_tiny_vlm("qwen3_vl").config.save_pretrained(tmp_path)
        with torch.device("meta"):
            vlm = get_model_config_from_hf(tmp_path).build()
        with pytest.raises(ConfigError, match="mask eagerly.*fullgraph: false"):
            build(DENSE, [Compile(backend="eager", scope="model", compile_attention=True, fullgraph=True)])
        Compile(backend="eager", scope="model").transform_model(vlm)
        assert "forward" in vars(vlm.text_model()) and "forward" not in vars(vlm), "the language model's forward"

    def test_fullgraph_needs_the_eager_parts_compiled(self):
        with pytest.raises(ValueError, match="fullgraph.*compile_attention"):
            build(DENSE, [Compile(backend="eager", fullgraph=True)])
        with pytest.raises(ValueError, match="compile_moe_block"):
            build(MOE, [Compile(backend="eager", fullgraph=True, compile_attention=True)])

    def test_packs_of_varying_length_are_refused_unless_dynamic(self):
        source = [{"path": "tiny:sft_train.jsonl", "kind": "chat"}]
        trainer = SimpleNamespace(datamodule=XTLDataModule(sources=source, tokenizer="tiny:", pad_to_max_length=False))
        with pytest.raises(ValueError, match="pad_to_max_length"):
            Compile(backend="eager").setup(trainer, None, "fit")
        Compile(backend="eager", dynamic=True).setup(trainer, None, "fit")
        padded = SimpleNamespace(datamodule=XTLDataModule(sources=source, tokenizer="tiny:"))
        Compile(backend="eager").setup(padded, None, "fit")


class TestCompiledLayers:
    def test_layers_compile_in_place_and_keep_their_names(self):
        names = [name for name, _ in build(MOE).named_parameters()]
        model = build(MOE, [Compile(backend="eager")])
        assert [name for name, _ in model.named_parameters()] == names
        assert all(layer._compiled_call_impl is not None for layer in model.layers)
        moe_layer = model.layers[0]
        assert moe_layer.self_attn.forward is not type(moe_layer.self_attn).forward, "attention runs eagerly"

    def test_a_whole_layer_graph_with_aot_eager_gives_bitwise_gradients(self):
        base_loss, base_grads = step(build(DENSE))
        loss, grads = step(build(DENSE, [Compile(backend="aot_eager", compile_attention=True)]))
        assert torch.equal(loss, base_loss)
        assert all(torch.equal(grads[name], g) for name, g in base_grads.items())

    def test_checkpointing_and_offload_still_act_inside_compiled_layers(self):
        base_loss, base_grads = step(build(DENSE))
        offload = ActivationOffload()
        model = build(DENSE, [ActivationCheckpointing(), offload, Compile(backend="aot_eager")])
        calls = count_calls([layer.self_attn for layer in model.layers])  # attention runs eagerly: hooks fire
        loss, grads = step(model)
        assert calls == [2, 2, 2], "recomputed"
        assert offload.stats.offloaded_bytes > 0
        assert torch.equal(loss, base_loss)
        for name, g in base_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-7, msg=name)  # last bits (graph breaks)


class TestWholeForward:
    @pytest.mark.parametrize("spec", [DENSE, MOE], ids=["dense", "moe"])
    def test_aot_eager_equals_eager_and_compiles_once_for_any_packing(self, spec):
        """New document bounds, supervised-row counts and padding compile nothing: the mask is built outside the
        compiled frame, the row dimension is dynamic from the first call, and an MoE model's router statistics
        (which count the real tokens) run eagerly."""
        base, model = build(spec), build(spec, [Compile(backend="aot_eager", scope="model")])
        assert model.forward is not type(model).forward and model.layers[0]._compiled_call_impl is None
        frames = []
        for lengths, supervised, padding in [
            ((30, 20, 14), 40, 14),
            ((10, 54), 25, 0),
            ((64,), 61, 0),
            ((8, 8, 8, 40), 20, 40),
        ]:
            seq_ctx, labels = _packed(lengths, supervised, padding)
            want = base(seq_ctx=seq_ctx, labels=labels, return_logits=False).loss
            got = model(seq_ctx=seq_ctx, labels=labels, return_logits=False).loss
            assert torch.equal(got, want)
            got.backward()
            frames.append(compile_module.compiled_frames())
        assert frames[0] > 0 and frames[1:] == [frames[0]] * 3, frames

    @pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_vl_moe"])
    def test_a_vision_language_model_compiles_its_language_model_once_for_any_images(self, family):
        """Packs with images of other sizes and places, and without any, compile nothing new: the vision tower and
        the image merge run before the compiled forward, the DeepStack additions as eager hooks inside it. Losses
        bitwise; fp32 gradients within 1e-5 relative (sums at the graph breaks in another order, measured
        <= 7e-7 relative to each tensor's largest entry)."""
        base = _built(MODELS[family], [])
        model = _built(MODELS[family], [Compile(backend="aot_eager", scope="model")])
        frames = []
        for pack in packs(family, seed=0, count=3) + packs(family, seed=1, count=3):
            assert torch.equal(*(_loss_backward(m, pack) for m in (model, base)))
            for (name, p), q in zip(model.named_parameters(), base.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)
            model.zero_grad(set_to_none=True), base.zero_grad(set_to_none=True)
            frames.append(compile_module.compiled_frames())
        assert frames[0] > 0 and frames[1:] == [frames[0]] * 5, frames

    def test_the_compiled_head_loss_compiles_once_for_any_row_count(self):
        """Catches a chunk loop over the row count (Dynamo specializes on it: one compile per count, until the
        cache limit sends the head back to eager)."""
        model = build(DENSE, [Compile(backend="eager")])
        frames = []
        for supervised in (40, 25, 61, 33):
            seq_ctx, labels = _packed((30, 20, 14), supervised)
            model(seq_ctx=seq_ctx, labels=labels, return_logits=False).loss.backward()
            frames.append(compile_module.compiled_frames())
        assert frames[1:] == [frames[0]] * 3, frames


class TestRecompiles:
    def test_logs_frames_compiled_after_the_first_step(self, monkeypatch):
        frames = iter([7, 7, 9])
        monkeypatch.setattr(compile_module, "compiled_frames", lambda: next(frames))
        logged = []
        module = SimpleNamespace(log=lambda key, value, **kwargs: logged.append((key, value)))
        callback = Compile(backend="eager")
        for i in range(3):
            callback.on_train_batch_end(None, module, None, None, i)
        assert logged == [("train/recompiles", 0.0), ("train/recompiles", 0.0), ("train/recompiles", 2.0)]

    def test_a_real_recompile_is_counted(self):
        """Catches a counter that reads 0 whatever happens: Dynamo really compiles again for a new input shape."""
        logged = []
        module = SimpleNamespace(log=lambda key, value, **kwargs: logged.append(value))
        callback = Compile(backend="eager")
        double = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
        double(torch.ones(3))
        callback.on_train_batch_end(None, module, None, None, 0)  # the first step's compiles are not counted
        double(torch.ones(3))
        callback.on_train_batch_end(None, module, None, None, 1)
        double(torch.ones(5))  # a new shape: one more frame
        callback.on_train_batch_end(None, module, None, None, 2)
        assert logged == [0.0, 0.0, 1.0]


class TestTinyRuns:
    def test_aot_eager_losses_equal_eager_and_nothing_recompiles(self, tiny_fit):
        base = tiny_fit("tiny_sft.yaml")
        run = tiny_fit("tiny_sft.yaml", _fragment("aot_eager"))
        assert len(run.rows) == 3
        assert run.column("train/loss") == base.column("train/loss")
        # gradient contributions meeting at the graph breaks around attention add up in another order
        for got, want in zip(run.column("train/grad_norm"), base.column("train/grad_norm")):
            assert math.isclose(float(got), float(want), rel_tol=1e-6)
        assert run.column("train/recompiles") == ["0.0"] * 3

    @pytest.mark.slow
    def test_inductor_losses_within_1e_4_of_eager(self, tiny_fit):
        """Inductor (cold compile ~30 s here). Reached: the 3 fp32 losses equal eager's to every logged digit, the
        gradient norms agree within 2e-7 relative."""
        base = tiny_fit("tiny_sft.yaml")
        run = tiny_fit("tiny_sft.yaml", _fragment("inductor"))
        for got, want in zip(run.column("train/loss"), base.column("train/loss")):
            assert math.isclose(float(got), float(want), rel_tol=1e-4)
        assert run.column("train/recompiles") == ["0.0"] * 3


def _built(spec: dict, transforms: list) -> BaseModel:
    """``spec``'s model (a config of ``tests.strategies.test_context_parallel.MODELS``), transformed on meta, then
    initialized from seed 0."""
    config, _ = resolve_model_config(spec)
    with torch.device("meta"):
        model = config.build()
    for transform in transforms:
        model = transform.transform_model(model)
    model.materialize("cpu")
    torch.manual_seed(0)
    model.init_weights()
    return model


def _loss_backward(model: BaseModel, batch: MicroBatch) -> torch.Tensor:
    """The pack's mean loss, backpropagated."""
    loss = model(seq_ctx=batch.seq_ctx, labels=batch.labels, return_logits=False).loss
    loss.backward()
    return loss.detach()


def _packed(lengths: tuple[int, ...], supervised: int, padding: int = 0) -> tuple[SequenceContext, torch.Tensor]:
    """A pack of ``lengths`` whose first ``supervised`` positions carry a label (``loss_positions`` set, as the
    collate sets it); the last ``padding`` tokens (the last document, if any) are padding."""
    generator = torch.Generator().manual_seed(sum(lengths) + supervised)
    ids = torch.randint(0, DENSE["vocab_size"], (1, sum(lengths)), generator=generator)
    labels = torch.randint(0, DENSE["vocab_size"], (1, sum(lengths)), generator=generator)
    labels[:, supervised:] = IGNORE_INDEX
    seq_ctx = SequenceContext.from_lengths(ids, lengths, num_padding=padding)
    seq_ctx.loss_positions = torch.arange(supervised)
    return seq_ctx, labels
