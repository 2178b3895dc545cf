"""``fused_projections``: one q/k/v and one gate/up matmul, the HF checkpoint's separate projections at load and
save, and the separate projections' numbers under ``XTL_HF_IMPL`` (bitwise) and on the fast path (close)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from xtl.errors import ConfigError
from xtl.model import get_model_config_from_hf
from xtl.model.base import has_fused_projections
from xtl.model.hf import CheckpointReader

from .test_moe_parity import save_tiny_moe
from .vlm import save_tiny_vlm

DENSE = ["llama", "qwen2", "qwen3", "qwen3_tied"]
MOE = ["deepseek_v3", "gpt_oss", "qwen3_moe"]
VLM = ["qwen3_vl", "qwen3_vl_moe"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_hf_dir):
    """``checkpoint(variant, dtype=torch.float32) -> Path``: a tiny HF checkpoint of any family."""
    root = tmp_path_factory.mktemp("fused_hf")

    def make(variant: str, dtype: torch.dtype = torch.float32):
        if variant in MOE:
            return save_tiny_moe(variant, dtype, root)
        if variant in VLM:
            return save_tiny_vlm(variant, dtype, root)
        return tiny_hf_dir(variant, dtype)

    return make


def load_fused(path, fused: bool, dtype: torch.dtype | None = torch.float32):
    """The checkpoint at ``path`` as an xtl model with or without fused projections, cast to ``dtype`` (``None``:
    each tensor in the dtype it was stored in)."""
    config = get_model_config_from_hf(path)
    config.fused_projections = fused
    if hasattr(config, "text_config"):
        config.text_config.fused_projections = fused
    with torch.device("meta"):
        model = config.build()
    model.from_hf(path)
    return model if dtype is None else model.to(dtype)


def _all_tensors(path):
    reader = CheckpointReader(path)
    return {key: reader.load(key) for key in reader.keys()}


def _part_grads(model) -> dict[str, torch.Tensor]:
    """Every parameter's gradient under its unfused name (a fused gradient split into its parts' rows)."""
    grads = {}
    for name, param in model.named_parameters():
        parts = model.fused_param_parts(name)
        if not parts:
            grads[name] = param.grad
            continue
        for (part, _), piece in zip(parts, param.grad.split([rows for _, rows in parts])):
            grads[part] = piece
    return grads


def _loss_and_grads(model, ids: torch.Tensor, labels: torch.Tensor):
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), _part_grads(model)


class TestFusedModules:
    @pytest.mark.parametrize("variant", DENSE + MOE + VLM)
    def test_fused_layers_replace_the_separate_projections(self, checkpoint, variant):
        model = load_fused(checkpoint(variant), fused=True)
        names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
        assert has_fused_projections(model) and not names & {"gate_proj", "up_proj"}, names
        if variant != "gpt_oss":  # GPT-OSS has routed experts only: no gated MLP
            assert "gate_up_proj" in names, names
        if variant != "deepseek_v3":  # multi-head latent attention has no q/k/v projections of one input
            assert "qkv_proj" in names and not names & {"q_proj", "k_proj", "v_proj"}, names
        assert not has_fused_projections(load_fused(checkpoint(variant), fused=False))

    @pytest.mark.parametrize("variant", ["qwen2", "qwen3", "gpt_oss"])
    def test_fused_weight_and_bias_are_the_parts_stacked(self, checkpoint, variant):
        fused, plain = load_fused(checkpoint(variant), fused=True), load_fused(checkpoint(variant), fused=False)
        attn, ref = fused.layers[0].self_attn, plain.layers[0].self_attn
        for name in ("weight", "bias") if variant != "qwen3" else ("weight",):
            parts = [getattr(getattr(ref, p), name) for p in ("q_proj", "k_proj", "v_proj")]
            assert torch.equal(getattr(attn.qkv_proj, name), torch.cat(parts))


class TestCheckpointKeys:
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
    @pytest.mark.parametrize("variant", DENSE + MOE + VLM)
    def test_save_writes_the_separate_projections_byte_identical(self, checkpoint, tmp_path, variant, dtype):
        src = checkpoint(variant, dtype)
        fused, plain = load_fused(src, fused=True), load_fused(src, fused=False)
        fused.save_hf(tmp_path / "fused")
        plain.save_hf(tmp_path / "plain")
        before, after = _all_tensors(src), _all_tensors(tmp_path / "fused")
        assert set(after) == set(before)
        for key, tensor in before.items():
            assert torch.equal(after[key].view(torch.uint8), tensor.view(torch.uint8)), key
        for file in sorted((tmp_path / "plain").glob("*.safetensors")):  # the very files the unfused model writes
            assert (tmp_path / "fused" / file.name).read_bytes() == file.read_bytes(), file.name

    def test_hf_keys_expand_to_the_parts_in_row_order(self, checkpoint):
        model = load_fused(checkpoint("qwen3"), fused=True)
        assert model.hf_keys("layers.1.self_attn.qkv_proj.weight") == [
            f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkv"
        ]
        assert model.hf_keys("layers.0.mlp.gate_up_proj.weight") == [
            "model.layers.0.mlp.gate_proj.weight",
            "model.layers.0.mlp.up_proj.weight",
        ]
        assert model.fused_param_parts("layers.0.self_attn.o_proj.weight") == ()
        assert model.fused_param_parts("layers.0.nonexistent.qkv_proj.weight") == ()


class TestNumerics:
    @pytest.mark.usefixtures("hf_impl")
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
    @pytest.mark.parametrize("variant", DENSE + MOE + VLM)
    def test_hf_impl_is_bitwise_the_separate_projections(self, checkpoint, variant, dtype):
        """Logits, loss and every gradient (the fused ones split into their parts) equal the unfused model's,
        which the parity tests hold bitwise to transformers."""
        src = checkpoint(variant, dtype)
        torch.manual_seed(0)
        ids = torch.randint(0, 150, (2, 20))
        fused = _loss_and_grads(load_fused(src, fused=True, dtype=dtype), ids, ids)
        plain = _loss_and_grads(load_fused(src, fused=False, dtype=dtype), ids, ids)
        assert torch.equal(fused[0], plain[0]) and torch.equal(fused[1], plain[1])
        assert fused[2].keys() == plain[2].keys()
        for name, grad in plain[2].items():  # a VLM's vision tower has no gradient from text alone
            assert (grad is None and fused[2][name] is None) or torch.equal(fused[2][name], grad), name

    @pytest.mark.usefixtures("hf_impl")
    def test_hf_impl_matches_transformers(self, checkpoint):
        src = checkpoint("qwen2")
        hf = AutoModelForCausalLM.from_pretrained(src, attn_implementation="eager").eval()
        model = load_fused(src, fused=True).eval()
        ids = torch.randint(0, 150, (2, 20))
        out_hf, out = hf(input_ids=ids, labels=ids), model(input_ids=ids, labels=ids)
        assert torch.equal(out_hf.logits, out.logits) and torch.equal(out_hf.loss, out.loss)

    @pytest.mark.parametrize("variant", ["qwen2", "qwen3", "gpt_oss", "deepseek_v3"])
    def test_fast_path_is_close_to_the_separate_projections(self, checkpoint, variant):
        """fp32: the fused matmul sums each output in its own order, so results agree to rounding (rtol 1e-5)."""
        src = checkpoint(variant)
        torch.manual_seed(0)
        ids = torch.randint(0, 150, (2, 20))
        fused = _loss_and_grads(load_fused(src, fused=True), ids, ids)
        plain = _loss_and_grads(load_fused(src, fused=False), ids, ids)
        torch.testing.assert_close(fused[1], plain[1], rtol=1e-5, atol=0)
        torch.testing.assert_close(fused[0], plain[0], rtol=1e-5, atol=1e-5)
        for name, grad in plain[2].items():
            torch.testing.assert_close(fused[2][name], grad, rtol=1e-4, atol=1e-6, msg=name)


class TestRefusals:
    def test_lora_refuses_fused_projections(self, checkpoint):
        from xtl.callbacks import LoRA

        with pytest.raises(ConfigError, match="fused_projections: false"):
            LoRA().transform_model(load_fused(checkpoint("qwen3"), fused=True))


class TestInit:
    @pytest.mark.parametrize("model_type", ["qwen2", "deepseek_v3"])
    def test_from_scratch_weights_equal_the_unfused_models(self, model_type):
        """Each part is drawn from its own unfused name's seed: the same seed gives the same model, fused or not."""
        from xtl.train.model_spec import resolve_model_config

        fields = dict(model_type=model_type, vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2)
        fields |= dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8)
        if model_type == "deepseek_v3":
            fields |= dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, first_k_dense_replace=1)
            fields |= dict(n_shared_experts=1, kv_lora_rank=8, q_lora_rank=16, qk_rope_head_dim=4)
            fields |= dict(qk_nope_head_dim=4, v_head_dim=4, n_group=2, topk_group=1)
        models = {}
        for fused in (False, True):
            config, _ = resolve_model_config(dict(fields), {"fused_projections": fused})
            torch.manual_seed(3)
            models[fused] = config.build()
            models[fused].init_weights()
        plain = dict(models[False].named_parameters())
        for name, param in models[True].named_parameters():
            parts = models[True].fused_param_parts(name)
            want = torch.cat([plain[p] for p, _ in parts]) if parts else plain[name]
            assert torch.equal(param, want), name
