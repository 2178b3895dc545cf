"""QLoRA: NF4 base weights (torchao's ``NF4Tensor``) under LoRA adapters.

Bounds used below:

- Round trip: within a block of 64 weights with absolute maximum ``a``, a weight comes back at most ``a * g / 2 +
  c / 128`` away, ``g`` the largest gap between neighbouring NF4 code values (0.3038, between -1 and -0.6962) and
  ``c`` the largest ``|a_i - mean(a)|`` of its group of 256 block scalers (their int8 double quantization:
  rounding costs half a step of ``2c / 256``, clamping the top value to 127 a whole step). Checked per element.
- Storage: ``numel / 2`` bytes of codes, ``numel / 64`` int8 scalers, one fp32 factor per 16384 weights, an fp32
  scaler mean and the 16 fp32 code values: 4.127 bits per weight plus 68 bytes per tensor.
- Model: NF4 rounds Gaussian weights with a relative RMS error of about 10%; through the 2-layer model below the
  logits of the quantized LoRA model differ from the unquantized one by about 13% in norm and the loss by under
  0.1% (measured over 3 seeds); the tests allow 20% and 1%. With the quantized weights replaced by their
  dequantized values the two models agree to fp32 rounding (1e-5): the matmul uses exactly the NF4 values.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from tests.callbacks.helpers import DENSE, batch, build, forward
from tests.callbacks.test_activation_checkpointing import single_rank_group  # noqa: F401 - a fixture
from tests.cli.test_cli import ROOT, _run_main, _tiny_args
from xtl.callbacks import ActivationCheckpointing, ActivationOffload
from xtl.callbacks.lora import LoRA
from xtl.callbacks.qlora import QLoRA
from xtl.errors import ConfigError
from xtl.module.lora import lora_layers
from xtl.module.nf4 import (
    BLOCK_SIZE,
    SCALER_BLOCK_SIZE,
    dequantize,
    is_nf4,
    nf4_codebook,
    nf4_error_bound,
    nf4_incompatibility,
    nf4_nbytes,
    quantize_base_weights,
    quantize_linear,
)
from xtl.strategies import FSDPStrategy
from xtl.strategies.parallelize import SingleDevice

# The NF4 data type of the QLoRA paper (Dettmers et al. 2023, appendix E; bitsandbytes' fp32 table).
PAPER_NF4 = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
    0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
]  # fmt: skip
# q, o, gate, up, down hold 128 x 128 or 128 x 256 weights (multiples of 16384); k and v (64 x 128) do not.
DENSE128 = dict(DENSE, hidden_size=128, intermediate_size=256, num_hidden_layers=2, head_dim=32)
QUANTIZABLE = ("q_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The tiny CLI model with NF4-compatible widths (later options override _tiny_args' small model).
CLI_MODEL = [
    "--model.init_args.model.hidden_size",
    "128",
    "--model.init_args.model.intermediate_size",
    "256",
    "--model.init_args.model.head_dim",
    "32",
]


def nf4_storage_bytes(numel: int) -> int:
    """Bytes of one NF4 tensor of ``numel`` weights (see the module docstring)."""
    return numel // 2 + numel // BLOCK_SIZE + 4 * numel // (BLOCK_SIZE * SCALER_BLOCK_SIZE) + 4 + 16 * 4


def lora_model(spec: dict, seed: int = 0, **lora_args) -> nn.Module:
    """A LoRA model from a fixed init, with ``lora_B`` drawn from ``seed`` (non-zero: the adapters contribute)."""
    model = build(spec, [LoRA(rank=4, **lora_args)])
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    return model


@pytest.fixture
def pair() -> tuple[nn.Module, nn.Module]:
    """The same LoRA model twice: unquantized, and with NF4 base weights."""
    reference, quantized = lora_model(DENSE128), lora_model(DENSE128)
    quantize_base_weights(quantized)
    return reference, quantized


class TestNF4Format:
    def test_the_codebook_is_the_qlora_nf4_data_type(self):
        codes = nf4_codebook()
        assert codes.shape == (16,) and codes.dtype == torch.float32
        # torchao writes the code values with 4 decimals: equal to the paper's up to that rounding
        torch.testing.assert_close(codes, torch.tensor(PAPER_NF4), rtol=0, atol=5e-5)
        assert codes[7] == 0 and codes[0] == -1 and codes[-1] == 1

    @pytest.mark.parametrize("outliers", [False, True], ids=["gaussian", "outliers"])
    def test_round_trip_error_is_within_the_nf4_bound(self, outliers):
        weight = torch.randn(256, 512, generator=torch.Generator().manual_seed(0)) * 0.02
        if outliers:
            weight[::17, ::29] *= 30
        layer = nn.Linear(512, 256, bias=False)
        layer.weight = nn.Parameter(weight.clone(), requires_grad=False)
        quantize_linear(layer)
        error = (dequantize(layer.weight) - weight).abs()
        bound = nf4_error_bound(weight)
        assert (error <= bound * (1 + 1e-6) + 1e-9).all(), f"worst excess {(error - bound).max():.3g}"
        gap = (nf4_codebook()[1:] - nf4_codebook()[:-1]).max()
        assert gap == pytest.approx(1.0 - 0.6962)  # the widest gap of the code: between -1 and -0.6962
        # the bound is not vacuous: about 15% of the block's absolute maximum (g / 2 = 0.152)
        assert bound.max() <= 0.17 * weight.abs().max()
        if not outliers:
            absmax = weight.reshape(-1, BLOCK_SIZE).abs().amax(dim=1, keepdim=True)
            assert (bound.reshape(-1, BLOCK_SIZE) <= 0.2 * absmax).all()
            relative_rms = (error.square().mean() / weight.square().mean()).sqrt()
            assert 0.05 < relative_rms < 0.15  # about 10% on Gaussian weights

    def test_storage_is_four_bits_and_an_eighth_per_weight(self):
        layer = nn.Linear(512, 256, bias=False)
        quantize_linear(layer)
        numel = 256 * 512
        assert nf4_nbytes(layer.weight) == nf4_storage_bytes(numel)
        assert 8 * nf4_nbytes(layer.weight) / numel == pytest.approx(4 + 8 / 64 + 32 / 16384 + 8 * 68 / numel)

    def test_shapes_nf4_cannot_store_are_named(self):
        assert nf4_incompatibility(nn.Linear(128, 128)) is None
        reason = nf4_incompatibility(nn.Linear(128, 64))
        assert "8192 elements" in reason and "16384" in reason
        with pytest.raises(ConfigError, match="no linear layer's weight can be stored in NF4"):
            quantize_base_weights(build(DENSE, [LoRA(rank=2)]))  # hidden 32: no layer qualifies


class TestQLoRAModel:
    def test_adapted_base_weights_are_nf4_and_the_adapters_are_not(self, pair):
        _, model = pair
        for name, layer in lora_layers(model):
            quantizable = name.rsplit(".", 1)[-1] in QUANTIZABLE
            assert is_nf4(layer.weight) == quantizable, name
            assert not layer.weight.requires_grad
            for factor in (layer.lora_A, layer.lora_B):
                assert type(factor.weight) is nn.Parameter and factor.weight.dtype == torch.float32
                assert factor.weight.requires_grad
        assert not is_nf4(model.lm_head.weight) and not is_nf4(model.embed_tokens.weight)

    def test_quantized_weights_take_about_4_bits_per_weight(self, pair):
        reference, model = pair
        names = [name for name, layer in lora_layers(model) if is_nf4(layer.weight)]
        assert len(names) == 2 * len(QUANTIZABLE)
        nbytes = sum(nf4_nbytes(model.get_submodule(n).weight) for n in names)
        numel = sum(model.get_submodule(n).weight.numel() for n in names)
        assert nbytes == sum(nf4_storage_bytes(model.get_submodule(n).weight.numel()) for n in names)
        assert 4.12 < 8 * nbytes / numel < 4.2
        fp32 = sum(reference.get_submodule(n).weight.nbytes for n in names)
        assert nbytes < fp32 * 4.2 / 32

    def test_the_matmul_uses_the_nf4_values(self, pair):
        _, model = pair
        dequantized = lora_model(DENSE128)
        with torch.no_grad():
            for name, layer in lora_layers(model):
                if is_nf4(layer.weight):
                    dequantized.get_submodule(name).weight.copy_(dequantize(layer.weight))
        seq_ctx, _ = batch(DENSE128["vocab_size"])
        torch.testing.assert_close(
            model(seq_ctx=seq_ctx).logits, dequantized(seq_ctx=seq_ctx).logits, atol=1e-5, rtol=0
        )

    def test_output_is_close_to_the_unquantized_lora_model(self, pair):
        reference, model = pair
        seq_ctx, _ = batch(DENSE128["vocab_size"])
        ref, out = reference(seq_ctx=seq_ctx).logits, model(seq_ctx=seq_ctx).logits
        assert (out - ref).norm() / ref.norm() < 0.2
        assert forward(model).item() == pytest.approx(forward(reference).item(), rel=0.01)

    def test_only_adapters_get_gradients_under_bf16_autocast(self, pair):
        _, model = pair
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = forward(model)
        loss.backward()
        with_grad = {name for name, param in model.named_parameters() if param.grad is not None}
        adapters = {name for name, param in model.named_parameters() if "lora_" in name}
        assert with_grad == adapters
        # layer 0's adapters get gradients through layer 1's NF4 matmuls (backward to the input)
        first = model.get_submodule("layers.0.self_attn.q_proj").lora_A.weight.grad
        assert first.abs().sum() > 0 and torch.isfinite(first).all()

    def test_a_few_optimizer_steps_reduce_the_loss(self, pair):
        _, model = pair
        frozen = {name: dequantize(layer.weight) for name, layer in lora_layers(model) if is_nf4(layer.weight)}
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        losses = []
        for _ in range(6):
            loss = forward(model)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
        assert losses[-1] < losses[0] - 0.05, losses
        for name, values in frozen.items():
            assert torch.equal(dequantize(model.get_submodule(name).weight), values), name

    @pytest.mark.parametrize("memory", ["full", "selective", "offload"])
    def test_composes_with_checkpointing_and_offload(self, memory):
        def run(*transforms):
            model = build(DENSE128, [LoRA(rank=4), *transforms])
            quantize_base_weights(model)
            loss = forward(model)
            loss.backward()
            return loss.detach(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}

        extra = ActivationOffload(pin_memory=False) if memory == "offload" else ActivationCheckpointing(mode=memory)
        (loss, grads), (base_loss, base_grads) = run(extra), run()
        assert torch.equal(loss, base_loss) and grads.keys() == base_grads.keys()
        assert all(torch.equal(grads[name], base_grads[name]) for name in grads)

    def test_all_linear_quantizes_frozen_layers_without_adapters_but_not_the_head(self):
        model = lora_model(DENSE128, target_modules=["q_proj"])
        quantize_base_weights(model, all_linear=True, head=model.text_model().lm_head)
        nf4 = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if is_nf4(getattr(m, "weight", None))}
        assert nf4 == set(QUANTIZABLE)
        assert not is_nf4(model.lm_head.weight)

    @pytest.mark.usefixtures("single_rank_group")
    def test_sharded_weights_are_refused(self):
        mesh = init_device_mesh("cpu", (1,))

        def shard(model):
            for layer in model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)

        model = build(DENSE128, [LoRA(rank=2)], shard=shard)
        with pytest.raises(ConfigError, match="sharded"):
            quantize_base_weights(model)


class TestQLoRAOptions:
    def test_unknown_formats_are_refused(self):
        with pytest.raises(ConfigError, match="quantize_base"):
            QLoRA(quantize_base="fp4")

    def test_the_qlora_callback_quantizes_after_the_weights(self):
        qlora = QLoRA()
        model = build(DENSE128, [LoRA(rank=2), qlora])  # transform_model leaves the meta model alone
        assert not any(is_nf4(p) for p in model.parameters())
        qlora.after_weights(model)
        assert is_nf4(model.get_submodule("layers.0.mlp.down_proj").weight)

    def test_the_qlora_callback_needs_one_lora_and_one_device(self):
        single = SimpleNamespace(parallelizer=SingleDevice())  # the module's view of its strategy
        with pytest.raises(ConfigError, match="needs one LoRA callback, it has 0"):
            QLoRA().setup(SimpleNamespace(callbacks=[]), single, "fit")
        two = [LoRA(), LoRA(), QLoRA()]
        with pytest.raises(ConfigError, match="needs one LoRA callback, it has 2"):
            two[2].setup(SimpleNamespace(callbacks=two), single, "fit")
        plain = [LoRA(), QLoRA()]
        plain[1].setup(SimpleNamespace(callbacks=plain), single, "fit")
        fsdp, sharded = (
            SimpleNamespace(callbacks=plain, strategy=FSDPStrategy()),
            SimpleNamespace(parallelizer=FSDPStrategy()),
        )
        with pytest.raises(ConfigError, match="single-device"):
            plain[1].setup(fsdp, sharded, "fit")

    def test_lora_has_no_quantize_base_of_its_own(self):
        with pytest.raises(TypeError, match="quantize_base"):
            LoRA(quantize_base="nf4")


def _losses(run_dir: Path) -> dict[int, str]:
    """``{step: logged train/loss}`` of every run under ``run_dir`` (resumed runs add their steps)."""
    losses = {}
    for metrics in sorted(run_dir.glob("runs/tiny_sft/logs/version_*/metrics.csv")):
        losses.update({int(r["step"]): r["train/loss"] for r in csv.DictReader(metrics.open()) if r.get("train/loss")})
    return losses


class TestQLoRACLI:
    def _fit(self, run_dir: Path, data_cache: Path, *extra: str) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        fragments = ["--config", str(ROOT / "callbacks/lora.yaml"), "--config", str(ROOT / "callbacks/qlora.yaml")]
        args = ["fit", *_tiny_args(ROOT / "configs/tiny_sft.yaml", data_cache, *fragments), *CLI_MODEL, *extra]
        cwd = Path.cwd()
        try:
            os.chdir(run_dir)
            assert _run_main(args) == 0
        finally:
            os.chdir(cwd)

    def test_tiny_sft_with_the_lora_and_qlora_fragments(self, tmp_path, data_cache, caplog):
        caplog.set_level("INFO")
        self._fit(tmp_path, data_cache, "--trainer.max_steps", "3")
        assert sorted(_losses(tmp_path)) == [0, 1, 2]
        assert "QLoRA: 10 linear layers store their base weights in NF4" in caplog.text
        state = torch.load(tmp_path / "runs/tiny_sft/checkpoints/last.ckpt", weights_only=False)["state_dict"]
        assert state and all("lora_" in key for key in state), "the checkpoint holds the adapters only"

    def test_four_steps_equal_two_plus_resume_two_bitwise(self, tmp_path, data_cache):
        fixed = ["--model.init_args.schedule.decay_steps", "10"]  # the same schedule in both runs
        self._fit(tmp_path / "straight", data_cache, *fixed, "--trainer.max_steps", "4")
        self._fit(tmp_path / "resumed", data_cache, *fixed, "--trainer.max_steps", "2")
        self._fit(tmp_path / "resumed", data_cache, *fixed, "--trainer.max_steps", "4", "--ckpt_path", "last")
        straight, resumed = _losses(tmp_path / "straight"), _losses(tmp_path / "resumed")
        assert sorted(straight) == [0, 1, 2, 3]
        assert resumed == straight
