"""MoE configs and checkpoints: config round trips, save_hf round trips, packed forward, router-bias hook."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from xtl.model import SequenceContext, get_model_config, get_model_config_from_hf
from xtl.model.hf import CheckpointReader
from xtl.model.moe import DeepSeekV3Config, GptOssMoEConfig, MoE, Qwen3MoEConfig
from xtl.module.fp32_norm import Fp32ScaleRMSNorm
from xtl.module.norm import RMSNorm
from xtl.module.router import NoAuxTopKRouter
from xtl.ops.moe_loss import balance_loss

from .test_hf_io import assert_same_tensors
from .test_moe_parity import VARIANTS, build_tiny_moe, save_tiny_moe


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory: pytest.TempPathFactory):
    """Factory: ``tiny_moe_dir(variant, dtype=torch.float32) -> Path`` of a saved tiny HF MoE checkpoint."""
    root = tmp_path_factory.mktemp("hf_moe_io")
    return lambda variant, dtype=torch.float32: save_tiny_moe(variant, dtype, root)


def _comparable(config) -> dict:
    d = config.to_dict()
    d.pop("_name_or_path", None)
    d.pop("transformers_version", None)
    return d


def _load(path) -> MoE:
    with torch.device("meta"):
        model = get_model_config_from_hf(path).build()
    model.from_hf(path)
    return model.eval()


def _all_tensors(path) -> dict[str, torch.Tensor]:
    reader = CheckpointReader(path)
    return {k: reader.load(k) for k in reader.keys()}


class TestMoEConfig:
    @pytest.mark.parametrize("variant", VARIANTS)
    def test_from_hf_then_hf_config_is_identity(self, tiny_moe_dir, variant):
        path = tiny_moe_dir(variant)
        cfg = get_model_config_from_hf(path)
        assert _comparable(cfg.hf_config) == _comparable(AutoConfig.from_pretrained(path))
        assert dataclasses.asdict(type(cfg).from_hf_config(cfg.hf_config)) == dataclasses.asdict(cfg)

    @pytest.mark.parametrize(
        "alias,cls,params_b",
        [
            ("Qwen3-30B-A3B", Qwen3MoEConfig, 30.5),
            ("qwen3_235b_a22b", Qwen3MoEConfig, 235.1),
            ("DeepSeek-V3", DeepSeekV3Config, 671.0),
            ("gpt-oss-20b", GptOssMoEConfig, 20.9),
            ("GPT-OSS-120B", GptOssMoEConfig, 116.8),
        ],
    )
    def test_published_sizes(self, alias, cls, params_b):
        cfg = get_model_config(alias)
        assert isinstance(cfg, cls)
        with torch.device("meta"):
            model = cfg.build()
        assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(params_b, abs=0.1)

    def test_structure_of_the_tiny_models(self, tiny_moe_dir):
        assert _load(tiny_moe_dir("qwen3_moe")).moe_layer_indices == [1]
        deepseek = _load(tiny_moe_dir("deepseek_v3"))
        assert deepseek.moe_layer_indices == [1]
        assert deepseek.layers[1].mlp.shared_experts is not None
        gpt_oss = _load(tiny_moe_dir("gpt_oss"))
        assert [layer.self_attn.sliding_window for layer in gpt_oss.layers] == [6, None]
        assert gpt_oss.layers[0].mlp.experts.gate_up.shape == (8, 64, 64)  # (E, 2I, C): leading expert dim

    @pytest.mark.parametrize(("variant", "norm_class"), [("qwen3_moe", RMSNorm), ("gpt_oss", Fp32ScaleRMSNorm)])
    def test_every_norm_is_built_from_the_config_norm_class(self, tiny_moe_dir, variant, norm_class):
        model = _load(tiny_moe_dir(variant))
        norms = [model.norm] + [
            n for layer in model.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)
        ]
        assert {type(n) for n in norms} == {norm_class}


class TestMoESaveHF:
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
    @pytest.mark.parametrize("variant", VARIANTS)
    def test_round_trip_is_byte_equal_and_loads_in_transformers(self, tiny_moe_dir, tmp_path, variant, dtype):
        src = tiny_moe_dir(variant, dtype)
        model = _load(src)
        out = tmp_path / "export"
        model.save_hf(out)
        before, after = _all_tensors(src), _all_tensors(out)
        assert set(before) == set(after)
        for key, tensor in before.items():
            assert after[key].dtype == tensor.dtype, key
            assert torch.equal(after[key].view(torch.uint8), tensor.view(torch.uint8)), key

        kwargs = dict(attn_implementation="eager", experts_implementation="eager")
        reference = AutoModelForCausalLM.from_pretrained(src, **kwargs).eval()
        reloaded = AutoModelForCausalLM.from_pretrained(out, **kwargs).eval()
        ids = torch.randint(0, reference.config.vocab_size, (2, 12))
        with torch.no_grad():
            assert torch.equal(reference(input_ids=ids).logits, reloaded(input_ids=ids).logits)

    @pytest.mark.parametrize("variant", VARIANTS)
    def test_a_model_cast_whole_to_bf16_round_trips_in_bf16(self, tmp_path, variant):
        # transformers' own .to(bfloat16) + save_pretrained: the router and DeepSeek-V3's correction bias are bf16
        # too (from_pretrained(dtype=bfloat16) keeps them fp32); xtl keeps them fp32 in training, not on save
        src = tmp_path / "src"
        build_tiny_moe(variant, torch.bfloat16).save_pretrained(src)
        before = _all_tensors(src)
        assert {t.dtype for t in before.values()} == {torch.bfloat16}
        _load(src).save_hf(tmp_path / "out")
        after = _all_tensors(tmp_path / "out")
        assert_same_tensors(after, before)

    def test_a_model_from_scratch_saves_in_the_config_dtype_with_its_fp32_tensors(self, tiny_moe_dir, tmp_path):
        config = get_model_config_from_hf(tiny_moe_dir("deepseek_v3"))
        config.dtype = "bfloat16"
        model = config.build()
        model.init_weights()
        model.save_hf(tmp_path / "out")
        dtypes = {k: t.dtype for k, t in _all_tensors(tmp_path / "out").items()}
        kept = {"model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias"}
        assert {k for k, d in dtypes.items() if d == torch.float32} == kept
        assert {d for k, d in dtypes.items() if k not in kept} == {torch.bfloat16}

    def test_deepseek_mtp_layers_are_ignored_on_load(self, tiny_moe_dir, tmp_path):
        src = tiny_moe_dir("deepseek_v3")
        model = _load(src)
        out = tmp_path / "with_mtp"
        model.save_hf(out)
        reader = CheckpointReader(out)
        tensors = {k: reader.load(k) for k in reader.keys()}
        tensors["model.layers.2.embed_tokens.weight"] = torch.zeros(3)  # an MTP layer after the last layer
        from safetensors.torch import save_file

        for path in out.glob("*.safetensors*"):
            path.unlink()
        save_file(tensors, str(out / "model.safetensors"))
        assert _load(out).from_hf(out, strict=True) == []


class TestMoEPackedForward:
    # fp32, default (non-HF) ops: the per-document run differs from the packed one only in matmul shapes, i.e.
    # by rounding (~1e-6); routing margins of the tiny model are far larger, so no token changes experts and
    # 1e-4 on logits of magnitude ~1 is far below a cross-document leak or a misrouted token (~1e-1).
    ATOL = 1e-4

    @pytest.mark.parametrize("variant", ["qwen3_moe", "gpt_oss"])
    def test_each_document_equals_running_it_alone(self, tiny_moe_dir, variant):
        model = _load(tiny_moe_dir(variant))
        lengths = [7, 13, 10]
        torch.manual_seed(0)
        ids = torch.randint(0, 160, (1, sum(lengths)))
        with torch.no_grad():
            packed = model(seq_ctx=SequenceContext.from_lengths(ids, lengths))
            start, counts = 0, 0
            for n in lengths:
                alone = model(input_ids=ids[:, start : start + n])
                torch.testing.assert_close(packed.logits[:, start : start + n], alone.logits, atol=self.ATOL, rtol=0)
                counts = counts + alone.extras["tokens_per_expert"]
                start += n
        assert torch.equal(packed.extras["tokens_per_expert"], counts)

    def test_trailing_padding_is_not_counted(self, tiny_moe_dir):
        model = _load(tiny_moe_dir("qwen3_moe"))
        ids = torch.randint(0, 160, (1, 20))
        with torch.no_grad():
            out = model(seq_ctx=SequenceContext.from_lengths(ids, [12, 8], num_padding=8))
        assert int(out.extras["router_num_tokens"]) == 12
        assert out.extras["tokens_per_expert"].sum().item() == 12 * 3


class TestRouterBiasHook:
    def test_update_moves_load_towards_balance(self, tiny_moe_dir):
        model = _load(tiny_moe_dir("deepseek_v3"))
        router = model.layers[1].mlp.gate
        assert isinstance(router, NoAuxTopKRouter)
        ids = torch.randint(0, 160, (4, 32))
        with torch.no_grad():
            before = model(input_ids=ids).extras
        bias = router.e_score_correction_bias.clone()
        loads = before["tokens_per_expert"]
        model.update_router_bias(loads, lr=0.05)
        step = router.e_score_correction_bias - bias
        over, under = loads[0] > loads[0].float().mean(), loads[0] < loads[0].float().mean()
        assert over.any() and under.any()
        torch.testing.assert_close(step[over], torch.full_like(step[over], -0.05))
        torch.testing.assert_close(step[under], torch.full_like(step[under], 0.05))
        for _ in range(30):
            with torch.no_grad():
                loads = model(input_ids=ids).extras["tokens_per_expert"]
            model.update_router_bias(loads, lr=0.05)
        num_tokens = ids.numel()
        spread_before = before["tokens_per_expert"].max() - before["tokens_per_expert"].min()
        assert (loads.max() - loads.min()) < spread_before
        assert balance_loss(before["router_prob_sum"], loads, num_tokens) > 0

    def test_gate_and_bias_stay_fp32_under_dtype_casts(self, tiny_moe_dir):
        model = _load(tiny_moe_dir("deepseek_v3")).to(torch.bfloat16)
        assert model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
        assert model.layers[1].mlp.gate.weight.dtype == torch.float32
        assert model.layers[1].mlp.experts.gate_up.dtype == torch.bfloat16

    def test_wrong_number_of_layers_is_an_error(self, tiny_moe_dir):
        model = _load(tiny_moe_dir("deepseek_v3"))
        with pytest.raises(ValueError, match="1 MoE layers"):
            model.update_router_bias(torch.zeros(2, 8), lr=0.1)
