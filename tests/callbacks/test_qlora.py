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
import filecmp
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torchao.quantization import to_nf4

from tests.callbacks.helpers import DENSE, batch, build, forward
from tests.callbacks.test_activation_checkpointing import single_rank_group  # noqa: F401 - a fixture
from tests.cli.test_cli import ROOT, _run_main, _tiny_args
from tests.inprocess import run_in_process
from tests.train.test_step import _free_port
from xtl.batch import SequenceContext
from xtl.callbacks import ActivationCheckpointing, ActivationOffload
from xtl.callbacks.lora import LoRA
from xtl.callbacks.qlora import QLoRA
from xtl.errors import ConfigError
from xtl.model.hf import copy_into
from xtl.model.hf.peft_adapter import ADAPTER_WEIGHTS
from xtl.module.lora import adapters_disabled, lora_layers
from xtl.module.nf4 import (
    BLOCK_SIZE,
    SCALER_BLOCK_SIZE,
    _shard_incompatibility,  # the shard rule, for ranks this machine cannot spawn
    dequantize,
    is_nf4,
    nf4_codebook,
    nf4_error_bound,
    nf4_incompatibility,
    nf4_nbytes,
    nf4_rows,
    quantize_base_weights,
    quantize_linear,
)
from xtl.strategies import FSDPStrategy
from xtl.strategies.parallelize import SingleDevice
from xtl.tools._memory_lora import nf4_shard_bytes

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


def lora_model(spec: dict, seed: int = 0, shard=None, **lora_args) -> nn.Module:
    """A LoRA model from a fixed init, with ``lora_B`` drawn from ``seed`` (non-zero: the adapters contribute);
    ``shard`` (e.g. FSDP2) is applied on ``meta``, in the strategy's order."""
    model = build(spec, [LoRA(rank=4, **lora_args)], shard=shard)
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            copy_into(param, torch.randn(param.shape, generator=generator) * 0.05)  # a DTensor: its shard
    return model


def fsdp(world: int):
    """``fully_shard`` of each decoder layer, then the root, over ``world`` CPU ranks (the strategy's order)."""

    def shard(model: nn.Module) -> None:
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)

    return shard


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def adapter_step(model: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward/backward on the helpers' batch: the loss and the adapters' whole gradients (then reset)."""
    loss = forward(model)
    loss.backward()
    grads = {name: full(p.grad).clone() for name, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


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
    def test_fsdp_on_one_rank_keeps_whole_nf4_weights_and_computes_as_one_device(self, pair):
        # a one-rank shard group holds whole weights: they leave FSDP (torch 2.13 gathers one input there); the
        # adapters and the other weights stay FSDP's. Sharded NF4 weights: TestFSDP (2 ranks)
        _, model = pair
        sharded = lora_model(DENSE128, shard=fsdp(1))
        summary = quantize_base_weights(sharded)
        assert summary.startswith("QLoRA: 10 linear layers store their base weights in NF4 (4.1")
        for name, layer in lora_layers(model):
            weight = sharded.get_submodule(name).weight
            assert is_nf4(weight) == is_nf4(layer.weight), name
            assert isinstance(weight, DTensor) != is_nf4(weight)
            assert isinstance(sharded.get_submodule(name).lora_A.weight, DTensor)
            if is_nf4(layer.weight):
                assert torch.equal(dequantize(weight), dequantize(layer.weight)), name
        seq_ctx, _ = batch(DENSE128["vocab_size"])
        torch.testing.assert_close(sharded(seq_ctx=seq_ctx).logits, model(seq_ctx=seq_ctx).logits, rtol=0, atol=0)
        (loss, grads), (sharded_loss, sharded_grads) = adapter_step(model), adapter_step(sharded)
        assert torch.equal(loss, sharded_loss) and grads.keys() == sharded_grads.keys()
        assert all(torch.equal(sharded_grads[name], grad) for name, grad in grads.items())


class TestNF4Shards:
    """A weight quantized whole, cut into row shards (:func:`nf4_rows`) and gathered back as FSDP does."""

    @staticmethod
    def whole(rows: int, cols: int) -> tuple[torch.Tensor, object]:
        weight = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0)) * 0.02
        weight[::7, ::13] *= 25  # outliers: block scalers far from their mean
        return weight, to_nf4(weight, BLOCK_SIZE, SCALER_BLOCK_SIZE)

    @pytest.mark.parametrize(
        ("rows", "cols", "ranks", "group"),
        [
            (256, 128, 2, 256),
            (256, 64, 2, 128),
            (128, 128, 4, 64),
            (384, 128, 3, 256),
            (64, 256, 8, 32),
            (256, 64, 64, 4),
        ],
    )
    def test_shards_hold_the_rows_of_the_whole_quantization_and_gather_back_to_it(self, rows, cols, ranks, group):
        _, whole = self.whole(rows, cols)
        values = dequantize(whole)
        shards = [nf4_rows(whole, r * rows // ranks, rows // ranks) for r in range(ranks)]
        for r, shard in enumerate(shards):
            assert shard.scaler_block_size == group and shard.shape == (rows // ranks, cols)
            assert torch.equal(dequantize(shard), values[r * rows // ranks : (r + 1) * rows // ranks])
        # torchao's FSDP extension: each rank's all-gather inputs, concatenated, then its post-all-gather
        inputs = [shard.fsdp_pre_all_gather(_mesh_of(ranks)) for shard in shards]
        gathered = [torch.cat(parts) for parts in zip(*(tensors for tensors, _ in inputs))]
        for _, metadata in inputs:  # every rank builds the same unsharded weight
            unsharded, _ = shards[0].fsdp_post_all_gather(tuple(gathered), metadata, torch.bfloat16)
            assert is_nf4(unsharded) and unsharded.shape == (rows, cols)
            assert torch.equal(dequantize(unsharded), values)
            assert torch.equal(unsharded.to(torch.bfloat16), values.to(torch.bfloat16))  # the mixed-precision cast

    def test_quantizing_each_shard_on_its_own_would_differ(self):
        # the scaler mean (and the groups of 256 scalers) belong to the whole weight: a shard quantized alone holds
        # other values, so the shards must come from the whole quantization
        weight, whole = self.whole(256, 64)
        alone = dequantize(to_nf4(weight[:128].contiguous(), BLOCK_SIZE, 128))
        assert not torch.equal(alone, dequantize(whole)[:128])

    def test_rows_that_cut_a_block_are_refused(self):
        _, whole = self.whole(512, 96)
        with pytest.raises(ValueError, match="whole blocks of 64"):
            nf4_rows(whole, 0, 3)  # 288 weights

    def test_shards_nf4_cannot_store_are_named(self):
        def sharded(shape, ranks, placement=Shard(0)):
            mesh = SimpleNamespace(size=lambda dim: ranks)
            return SimpleNamespace(placements=(placement,), device_mesh=mesh, shape=torch.Size(shape))

        assert _shard_incompatibility(sharded((256, 64), 2)) is None
        assert "do not split evenly over the 4 ranks" in _shard_incompatibility(sharded((6, 8192), 4))
        assert "would cut NF4 blocks of 64 weights" in _shard_incompatibility(sharded((512, 32), 512))
        assert "row shards" in _shard_incompatibility(sharded((256, 64), 2, Shard(1)))
        assert _shard_incompatibility(sharded((256, 64), 2, Replicate())) is None


def _mesh_of(ranks: int) -> SimpleNamespace:
    """What torchao's ``fsdp_pre_all_gather`` reads of a mesh: its group's size."""
    return SimpleNamespace(get_group=lambda: SimpleNamespace(size=lambda: ranks))


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

    def test_the_qlora_callback_needs_one_lora_under_any_strategy(self):
        single = SimpleNamespace(parallelizer=SingleDevice())  # the module's view of its strategy
        with pytest.raises(ConfigError, match="needs one LoRA callback, it has 0"):
            QLoRA().setup(SimpleNamespace(callbacks=[]), single, "fit")
        two = [LoRA(), LoRA(), QLoRA()]
        with pytest.raises(ConfigError, match="needs one LoRA callback, it has 2"):
            two[2].setup(SimpleNamespace(callbacks=two), single, "fit")
        plain = [LoRA(), QLoRA()]
        plain[1].setup(SimpleNamespace(callbacks=plain), single, "fit")
        sharded = SimpleNamespace(parallelizer=FSDPStrategy())  # FSDP QLoRA
        plain[1].setup(SimpleNamespace(callbacks=plain), sharded, "fit")
        offload = SimpleNamespace(parallelizer=FSDPStrategy(cpu_offload=True))
        with pytest.raises(ConfigError, match="remove cpu_offload"):
            plain[1].setup(SimpleNamespace(callbacks=plain), offload, "fit")

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
    @staticmethod
    def _fit(run_dir: Path, data_cache: Path, *extra: str) -> None:
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
        TestQLoRACLI._fit(tmp_path, data_cache, "--trainer.max_steps", "3")
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


# ---- FSDP QLoRA on 2 ranks ------------------------------------------------------------------------------------------
#
# Each rank trains on its own batch and FSDP averages the adapter gradients; one process trains on the mean of the two
# batches' losses. The NF4 values are bit for bit those one process holds (asserted), so in fp32 the runs can differ
# only by the order of sums (the reduce-scatter adds the two ranks' gradients and halves them, autograd adds the two
# halved batch gradients: the same rounding for two ranks). Observed: losses, first gradients and the adapters after
# 3 SGD steps bit for bit equal; allowed 1e-6 relative (atol 1e-9), so another reduction order still passes. NF4 is
# lossy (about 10% RMS per weight, the single-device tests' bounds), but the error is the same on both sides, so the
# QLoRA tolerance here is fp32 rounding; quantizing each shard on its own (its own scaler mean and groups) or pairing
# a shard with another group's scaler factor changes the weights by up to an NF4 step and the gradients by ~1e-3.

STEPS, LR, LENGTHS = 3, 0.5, (24, 20, 20)


def doc_loss(model: nn.Module, seed: int) -> torch.Tensor:
    """The loss of ``model`` on a packed batch of three documents drawn from ``seed`` (the same token count for
    every seed, so that the mean over batches is the mean over tokens)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (1, sum(LENGTHS)), generator=generator)
    labels = torch.randint(0, model.config.vocab_size, (1, sum(LENGTHS)), generator=generator)
    seq_ctx = SequenceContext.from_lengths(ids, LENGTHS)
    return model(seq_ctx=seq_ctx, labels=labels, return_logits=False).loss


def train(model: nn.Module, batches: list[list[int]]) -> dict:
    """SGD on the adapters, one step per entry of ``batches`` (the seeds of the step's batches, averaged): the
    losses, the whole first gradients and the whole adapters after the last step."""
    adapters = {name: p for name, p in model.named_parameters() if p.requires_grad}
    optimizer = torch.optim.SGD(adapters.values(), lr=LR)
    losses, first = [], {}
    for seeds in batches:
        loss = sum(doc_loss(model, seed) for seed in seeds) / len(seeds)
        loss.backward()
        first = first or {name: full(p.grad).clone() for name, p in adapters.items()}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return {"losses": losses, "grads": first, "adapters": {name: full(p).detach() for name, p in adapters.items()}}


def _fsdp_worker(rank: int, world: int, port: int, out: str) -> None:
    """QLoRA on ``world`` gloo ranks: quantize the sharded model, train it on this rank's batches, check the bf16
    matmul and a layer whose rows do not split; rank 0 saves what it saw."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = lora_model(DENSE128, shard=fsdp(world))
        summary = quantize_base_weights(model)
        nf4 = {name: layer.weight for name, layer in lora_layers(model) if is_nf4(layer.weight)}
        seen = {
            "summary": summary,
            "values": {name: dequantize(w).full_tensor() for name, w in nf4.items()},
            "gathered": {name: dequantize(w.full_tensor()) for name, w in nf4.items()},
            "local": {
                name: (type(w.to_local()).__name__, tuple(w.to_local().shape), nf4_nbytes(w))
                for name, w in nf4.items()
            },
        }
        all_reduce = lambda t: dist.all_reduce(t, op=dist.ReduceOp.AVG) or t  # noqa: E731 - the mean over ranks
        seen |= train(model, [[100 * step + rank] for step in range(STEPS)])
        seen["losses"] = [all_reduce(loss) for loss in seen["losses"]]
        odd = nn.Linear(16384, 3, bias=False)  # 3 rows over 2 ranks
        fully_shard(odd, mesh=init_device_mesh("cpu", (world,)))
        seen["odd"] = nf4_incompatibility(odd)
        torch.manual_seed(0)  # the same weight on every rank
        lone = nn.Linear(128, 256, bias=False).requires_grad_(False)
        seen["lone"] = lone.weight.detach().clone()
        fully_shard(lone, mesh=init_device_mesh("cpu", (world,)))
        quantize_linear(lone, lone)  # a layer of its own: the model that holds it is itself
        seen["lone_nf4"] = dequantize(lone.weight).full_tensor()
        seen["bf16"] = _bf16_matmul(world)
        if rank == 0:
            torch.save(seen, out)
    finally:
        dist.destroy_process_group()


def _bf16_matmul(world: int) -> tuple[torch.dtype, bool]:
    """Under ``param_dtype: bfloat16`` a sharded NF4 layer's input dtype, and whether its output is exactly the bf16
    matmul with the bf16 rounding of the dequantized whole weight."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)

    def shard(model: nn.Module) -> None:
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)

    model = lora_model(DENSE128, shard=shard)
    quantize_base_weights(model)
    layer = model.get_submodule("layers.1.self_attn.q_proj")
    whole = dequantize(layer.weight).full_tensor()
    seen = []
    layer.register_forward_hook(lambda _, args, output: seen.append((args[0], output)))
    with torch.no_grad(), adapters_disabled(model):
        forward(model)
    x, y = seen[0]
    return x.dtype, torch.equal(y, torch.nn.functional.linear(x, whole.to(torch.bfloat16)))


@pytest.mark.distributed
class TestFSDP:
    def test_two_ranks_hold_train_and_compute_as_one_process(self, tmp_path):
        out = tmp_path / "seen.pt"
        mp.spawn(_fsdp_worker, args=(2, _free_port(), str(out)), nprocs=2, join=True)
        seen = torch.load(out, weights_only=False)
        model = lora_model(DENSE128)
        assert seen["summary"].startswith("QLoRA: 10 linear layers store their base weights in NF4")
        assert seen["summary"].split("; ")[0].endswith("each sharded over 2 ranks")
        # every rank holds half the rows of each NF4 weight; gathered, they are one process's NF4 values
        quantize_base_weights(model)
        nf4 = {name: layer.weight for name, layer in lora_layers(model) if is_nf4(layer.weight)}
        assert seen["values"].keys() == nf4.keys()
        for name, weight in nf4.items():
            kind, shape, nbytes = seen["local"][name]
            assert (kind, shape) == ("NF4Tensor", (weight.shape[0] // 2, weight.shape[1])), name
            assert nbytes == nf4_shard_bytes(weight.shape[1], weight.shape[0], 2)[0], name  # as xtl memory counts
            assert torch.equal(seen["values"][name], dequantize(weight)), name
            assert torch.equal(seen["gathered"][name], dequantize(weight)), name
        single = train(model, [[100 * step, 100 * step + 1] for step in range(STEPS)])
        torch.testing.assert_close(seen["losses"], single["losses"], rtol=1e-6, atol=0)
        assert single["grads"].keys() == seen["grads"].keys() == seen["adapters"].keys()
        for name, grad in single["grads"].items():
            torch.testing.assert_close(seen["grads"][name], grad, rtol=1e-6, atol=1e-9, msg=name)
            torch.testing.assert_close(seen["adapters"][name], single["adapters"][name], rtol=1e-6, atol=1e-9)
        assert "3 rows do not split evenly over the 2 ranks that shard it" in seen["odd"]
        assert torch.equal(seen["lone_nf4"], dequantize(to_nf4(seen["lone"], BLOCK_SIZE, SCALER_BLOCK_SIZE)))
        assert seen["bf16"] == (torch.bfloat16, True)


@pytest.mark.distributed
class TestFSDPCLI:
    def test_two_ranks_train_resume_and_export_as_one_process(self, tmp_path, data_cache):
        fragment = tmp_path / "fsdp.yaml"
        fragment.write_text(
            "trainer:\n  devices: 2\n  strategy: {class_path: xtl.strategies.FSDPStrategy}\n"
            "  val_check_interval: null\n  precision: 32-true\ndata:\n  val_sources: null\n"
        )
        adapter = tmp_path / "lora.yaml"  # the merged model and the PEFT adapter beside it
        adapter.write_text((ROOT / "callbacks/lora.yaml").read_text().replace("export: merged", "export: both"))
        fragments = ["--config", str(adapter), "--config", str(ROOT / "callbacks/qlora.yaml")]
        fragments += ["--config", str(ROOT / "callbacks/hf_export.yaml")]
        fragments += ["--model.init_args.schedule.decay_steps", "10"]  # the same schedule in every run
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}

        def sharded(run_dir: Path, *extra: str) -> None:
            run_dir.mkdir(parents=True, exist_ok=True)
            args = _tiny_args(ROOT / "configs/tiny_sft.yaml", data_cache, "--config", str(fragment), *fragments)
            args = [sys.executable, "-m", "xtl", "fit", *args, *CLI_MODEL, *extra]  # the second rank re-runs it
            proc = subprocess.run(args, cwd=run_dir, env=env, capture_output=True, text=True, timeout=600)
            assert proc.returncode == 0, proc.stderr[-3000:]
            assert "QLoRA: 10 linear layers store their base weights in NF4" in proc.stderr
            assert "each sharded over 2 ranks" in proc.stderr

        sharded(tmp_path / "fsdp", "--trainer.max_steps", "3")
        # a DCP checkpoint of the adapters, the NF4 base rebuilt from the source: resumes bit for bit
        sharded(tmp_path / "resumed", "--trainer.max_steps", "2")
        sharded(tmp_path / "resumed", "--trainer.max_steps", "3", "--ckpt_path", "last")
        straight, resumed = _losses(tmp_path / "fsdp"), _losses(tmp_path / "resumed")
        assert sorted(straight) == [0, 1, 2] and resumed == straight
        final = [tmp_path / run / "runs/tiny_sft/hf/final" for run in ("fsdp", "resumed")]
        for name in ("model-00001-of-00001.safetensors", f"adapter/{ADAPTER_WEIGHTS}"):
            assert filecmp.cmp(final[0] / name, final[1] / name, shallow=False), name
        # one process, 4 micro-batches a step (2 ranks x 2): fp32, only the order of sums differs
        (tmp_path / "single").mkdir()
        args = ["fit", *_tiny_args(ROOT / "configs/tiny_sft.yaml", data_cache, *fragments), *CLI_MODEL]
        args += ["--trainer.precision", "32-true", "--data.micro_batches_per_step", "4", "--trainer.max_steps", "3"]
        args += ["--data.val_sources", "null", "--trainer.val_check_interval", "null"]
        code, output = run_in_process(args, tmp_path / "single")
        assert code == 0, output[-3000:]
        single = _losses(tmp_path / "single")
        assert [float(straight[k]) for k in range(3)] == pytest.approx([float(single[k]) for k in range(3)], rel=1e-5)
        one = tmp_path / "single/runs/tiny_sft/hf/final"
        for name in ("model-00001-of-00001.safetensors", f"adapter/{ADAPTER_WEIGHTS}"):
            got, expected = load_file(final[0] / name), load_file(one / name)
            assert got.keys() == expected.keys(), name
            for key, tensor in expected.items():
                torch.testing.assert_close(got[key], tensor, rtol=1e-4, atol=1e-6, msg=key)
        peft = [key for key in expected if "lora_B" in key]
        assert peft and all(expected[key].abs().sum() > 0 for key in peft), "the adapters trained"
