"""Tests for ``FP8Training``: options, which modules are swapped (and why the others are not), the fp8 path really
taken in forward and backward, per-layer numerics against the unconverted layers, and short CLI runs per recipe.

Tolerances (measured on the tiny models below; the bounds leave ~1.5x margin): an fp8 operand carries a relative
rounding error of at most 2**-4 per element (e4m3; e5m2, used by torchao's tensorwise recipe for the output
gradient, 2**-3), about 2-4% in norm after a matmul. Each converted layer, fed the inputs and output gradients the
unconverted fp32 layer saw, must stay within 6% (output) and 6% / 9% (rowwise, blockwise / tensorwise; input and
weight gradients) of that layer, and above 0.5% (a layer that skipped fp8 would be exact).
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torchao.float8.float8_linear import Float8Linear

import xtl.ops.fp8
from tests.callbacks.helpers import build, forward, step
from tests.callbacks.test_activation_checkpointing import single_rank_group  # noqa: F401 - a fixture
from tests.cli.test_cli import ROOT, _run_main, _tiny_args
from xtl.callbacks import FP8Training
from xtl.callbacks.fp8 import BlockwiseFp8Linear, layer_errors

FRAGMENT = ROOT / "callbacks/fp8.yaml"
DENSE128 = dict(
    model_type="qwen3", vocab_size=200, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, attn_impl="sdpa",
)  # fmt: skip
DEEPSEEK = dict(
    model_type="deepseek_v3", vocab_size=200, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
    num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2,
    n_group=1, topk_group=1, first_k_dense_replace=1, n_shared_experts=1, q_lora_rank=32, kv_lora_rank=32,
    qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, attn_impl="sdpa",
)  # fmt: skip
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GRAD_BOUND = {"tensorwise": 0.09, "rowwise": 0.06, "blockwise": 0.06}


class TestOptions:
    def test_unknown_recipe_names_the_key(self):
        with pytest.raises(ValueError, match="recipe"):
            FP8Training(recipe="mxfp8")

    def test_skip_must_be_a_list_of_patterns(self):
        with pytest.raises(ValueError, match="skip"):
            FP8Training(skip="layers.0.*")

    @pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
    def test_emulate_with_another_recipe_is_refused(self, recipe):
        with pytest.raises(ValueError, match="emulate applies to the tensorwise recipe only"):
            FP8Training(recipe, emulate=True)

    def test_a_skip_pattern_that_matches_nothing_names_the_key(self):
        with pytest.raises(ValueError, match="skip pattern 'layers.9.*'"):
            build(DENSE128, [FP8Training(skip=["layers.9.*"])])


class TestModuleSwap:
    def test_tensorwise_swaps_every_decoder_projection_and_keeps_names(self):
        names = [name for name, _ in build(DENSE128).named_parameters()]
        callback = FP8Training("tensorwise")
        model = build(DENSE128, [callback])
        assert callback.converted == [f"layers.{i}.{part}.{p}" for i in range(2) for part, p in _parts()]
        assert all(isinstance(model.get_submodule(name), Float8Linear) for name in callback.converted)
        assert type(model.lm_head) is nn.Linear and type(model.embed_tokens) is nn.Embedding
        assert [name for name, _ in model.named_parameters()] == names

    def test_blockwise_skips_dims_that_are_not_multiples_of_128(self):
        callback = FP8Training("blockwise")
        model = build(DENSE128, [callback])
        assert callback.skipped == {
            f"layers.{i}.self_attn.{p}": "in/out features 128/64 are not multiples of 128"
            for i in range(2)
            for p in ("k_proj", "v_proj")
        }
        assert len(callback.converted) == 10
        assert all(type(model.get_submodule(name)) is BlockwiseFp8Linear for name in callback.converted)

    def test_skip_patterns_keep_the_named_modules(self):
        callback = FP8Training("rowwise", skip=["layers.0.*", "*.down_proj"])
        build(DENSE128, [callback])
        assert callback.converted == [f"layers.1.{part}.{p}" for part, p in _parts() if p != "down_proj"]
        assert callback.skipped["layers.0.self_attn.q_proj"] == "skip: layers.0.*"
        assert callback.skipped["layers.1.mlp.down_proj"] == "skip: *.down_proj"

    def test_moe_shared_experts_are_swapped_routers_and_routed_experts_are_not(self):
        callback = FP8Training("tensorwise")
        model = build(DEEPSEEK, [callback])
        assert {"layers.1.mlp.shared_experts.gate_proj", "layers.1.mlp.shared_experts.down_proj"} <= set(
            callback.converted
        )
        assert "layers.1.self_attn.kv_a_proj_with_mqa" in callback.converted
        assert callback.skipped == {"layers.1.mlp.experts": "routed experts: grouped GEMM in the training dtype"}
        assert not any(".gate." in name or name.endswith(".gate") for name in callback.converted)
        assert type(model.layers[1].mlp.gate.weight) is nn.Parameter
        loss = forward(model)
        loss.backward()
        assert math.isfinite(float(loss.detach()))

    def test_dims_not_multiple_of_16_stay_in_high_precision(self):
        callback = FP8Training("tensorwise")
        build(dict(DENSE128, intermediate_size=200), [callback])
        assert callback.skipped["layers.0.mlp.gate_proj"] == "in/out features 128/200 are not multiples of 16"
        assert "layers.0.self_attn.q_proj" in callback.converted


class TestFp8PathIsTaken:
    @pytest.mark.parametrize("recipe, scale_shape", [("tensorwise", ()), ("rowwise", (64, 1))])
    def test_torchao_recipes_run_scaled_mm_on_fp8_operands(self, monkeypatch, recipe, scale_shape):
        calls = []
        scaled_mm = torch._scaled_mm

        def record(a, b, *args, **kwargs):
            calls.append((a.dtype, b.dtype, tuple(kwargs["scale_a"].shape)))
            return scaled_mm(a, b, *args, **kwargs)

        monkeypatch.setattr(torch, "_scaled_mm", record)
        callback = FP8Training(recipe)
        model = build(DENSE128, [callback])
        loss = forward(model)
        assert len(calls) == len(callback.converted) == 14, "one fp8 matmul per converted layer in forward"
        assert all(a == b == torch.float8_e4m3fn for a, b, _ in calls)
        assert {shape for _, _, shape in calls} == {scale_shape}
        loss.backward()
        assert len(calls) == 3 * 14, "grad_input and grad_weight matmuls in fp8 too"

    def test_emulate_runs_no_scaled_mm_and_stays_close_to_the_kernel(self, monkeypatch):
        # the same casts and scales, a high-precision matmul instead of _scaled_mm (fp32 model): the loss within 1e-5
        # relative and a weight gradient within 1e-4 of its max (measured 1.2e-7 and 2.2e-6), unlike the unconverted
        # model's loss
        torch.manual_seed(0)
        results, calls = {}, {False: 0, True: 0}
        scaled_mm = torch._scaled_mm
        for emulate in (False, True):

            def counting(*args, emulate=emulate, **kwargs):
                calls[emulate] += 1
                return scaled_mm(*args, **kwargs)

            monkeypatch.setattr(torch, "_scaled_mm", counting)
            torch.manual_seed(0)
            model = build(DENSE128, [FP8Training("tensorwise", emulate=emulate)])
            loss = forward(model)
            loss.backward()
            results[emulate] = (loss.detach(), model.layers[0].mlp.down_proj.weight.grad.clone())
        assert calls[False] > 0 and calls[True] == 0
        (kernel_loss, kernel_grad), (loss, grad) = results[False], results[True]
        assert torch.allclose(loss, kernel_loss, rtol=1e-5)
        assert (grad - kernel_grad).abs().max() <= 1e-4 * kernel_grad.abs().max()
        torch.manual_seed(0)
        plain = build(DENSE128)
        plain_loss = forward(plain)
        assert not torch.equal(plain_loss.detach(), loss)

    def test_blockwise_quantizes_activations_per_1x128_and_weights_per_128x128(self, monkeypatch):
        seen = []

        def recording(fn_name):
            fn = getattr(xtl.ops.fp8, fn_name)

            def quantize(tensor):
                q, scale_inv = fn(tensor)
                seen.append((fn_name, q, scale_inv))
                return q, scale_inv

            return quantize

        for fn_name in ("quantize_1x128", "quantize_128x128"):
            monkeypatch.setattr(xtl.ops.fp8, fn_name, recording(fn_name))
        callback = FP8Training("blockwise")
        model = build(DENSE128, [callback])
        loss = forward(model)
        assert len(seen) == 2 * 10
        assert all(q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 for _, q, s in seen)
        shapes = {(name, tuple(s.shape)) for name, _, s in seen}
        assert ("quantize_1x128", (128, 1)) in shapes, "64 tokens padded to one 128-row group, K = 128"
        assert ("quantize_128x128", (2, 1)) in shapes, "gate_proj (256, 128)"
        loss.backward()
        assert len(seen) == 2 * 10 + 4 * 10, "backward: grad_out twice, x and the weight again"


class TestNumerics:
    @pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
    def test_per_layer_relative_errors_against_the_unconverted_layers(self, recipe):
        callback = FP8Training(recipe)
        spec = dict(DENSE128, num_hidden_layers=1)
        model, reference = build(spec, [callback]), build(spec)
        errors = layer_errors(model, reference, callback.converted, forward)
        assert set(errors) == set(callback.converted)
        for name, error in errors.items():
            assert 0.005 < error["output"] < 0.06, (name, error)
            assert 0.005 < error["grad_input"] < GRAD_BOUND[recipe], (name, error)
            assert 0.005 < error["grad_weight"] < GRAD_BOUND[recipe], (name, error)
        loss, ref_loss = float(forward(model)), float(forward(reference))
        assert abs(loss - ref_loss) / ref_loss < 1e-2


class TestWithFSDP2:
    @pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
    @pytest.mark.usefixtures("single_rank_group")
    def test_fsdp2_on_top_gives_the_unsharded_gradients(self, recipe):
        """FSDP2 shards the converted layers as the strategy does (each decoder layer, then the root); on one
        rank without mixed precision (weights all-gathered in fp32) the step equals the unsharded one bitwise."""
        mesh = init_device_mesh("cpu", (1,))

        def shard(model):
            for layer in model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)

        base_loss, base_grads = step(build(DENSE128, [FP8Training(recipe)]))
        loss, grads = step(build(DENSE128, [FP8Training(recipe)], shard=shard))
        assert torch.equal(loss, base_loss)
        for name, grad in base_grads.items():
            assert torch.equal(grads[name].full_tensor(), grad), name


@pytest.fixture(scope="module")
def fp8_fit(data_cache: Path, tmp_path_factory: pytest.TempPathFactory):
    """``fp8_fit(recipe or None) -> [train/loss per step]`` of a 3-step tiny SFT run with hidden 128 (cached)."""
    cache: dict[str | None, list[float]] = {}

    def fit(recipe: str | None) -> list[float]:
        if recipe not in cache:
            run_dir = tmp_path_factory.mktemp(f"fp8_{recipe}")
            fragments = []
            if recipe is not None:
                fragment = run_dir / "fp8.yaml"
                fragment.write_text(FRAGMENT.read_text().replace("recipe: tensorwise", f"recipe: {recipe}"))
                fragments = ["--config", str(fragment)]
            args = [*_tiny_args(ROOT / "configs/tiny_sft.yaml", data_cache, *fragments), *_SIZE_128]
            with pytest.MonkeyPatch.context() as patch:
                patch.chdir(run_dir)
                assert _run_main(["fit", *args, "--trainer.max_steps", "3"]) == 0
            metrics = next(run_dir.glob("runs/*/logs/version_*/metrics.csv"))
            cache[recipe] = [float(row["train/loss"]) for row in csv.DictReader(metrics.open()) if row["train/loss"]]
        return cache[recipe]

    return fit


class TestCLI:
    def test_fragment_uses_a_known_recipe(self):
        assert "recipe: tensorwise" in FRAGMENT.read_text()

    @pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
    def test_three_steps_train_like_the_high_precision_run(self, fp8_fit, recipe):
        """Same data and seed: the first loss is within 1% of the unconverted run's, and differs from it (the fp8
        path ran); every loss is finite and the last is below the first."""
        base, losses = fp8_fit(None), fp8_fit(recipe)
        assert len(losses) == len(base) == 3
        assert all(math.isfinite(v) for v in losses)
        assert losses[-1] < losses[0]
        assert losses[0] != base[0] and abs(losses[0] - base[0]) / base[0] < 1e-2


_SIZE_128 = [
    "--model.init_args.model.hidden_size", "128", "--model.init_args.model.intermediate_size", "256",
    "--model.init_args.model.head_dim", "32",
]  # fmt: skip


def _parts() -> list[tuple[str, str]]:
    return [("self_attn" if p in PROJECTIONS[:4] else "mlp", p) for p in PROJECTIONS]
