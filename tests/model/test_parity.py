"""The runtime parity engine (``xtl.model.parity``): passes on correct models, names the first diverging layer of
injected faults, and leaves the checked model untouched.

The fault injectors below change the xtl side only (the reference is built from the correct transformers config);
the tool and callback tests reuse them.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from xtl.batch import SequenceContext
from xtl.model import MODEL_TYPES, BaseModel
from xtl.model.moe.config import MoEConfig
from xtl.model.parity import (
    ParityDocuments,
    ParityReport,
    ParityRow,
    ParityTolerance,
    default_grad_params,
    load_reference,
    resolve_tolerance,
    run_parity_check,
)
from xtl.module.norm import RMSNorm
from xtl.module.rope import RotaryEmbedding

TINY = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128)
MODELS = {
    "llama_mha": ("llama", dict(intermediate_size=64, num_key_value_heads=4)),
    "llama_gqa": ("llama", dict(intermediate_size=64, num_key_value_heads=2)),
    "qwen3_tied": ("qwen3", dict(intermediate_size=64, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)),
    "qwen3_moe": (
        "qwen3_moe",
        dict(
            intermediate_size=64, num_key_value_heads=2, head_dim=8, moe_intermediate_size=16, num_experts=4,
            num_experts_per_tok=2, mlp_only_layers=[0],
        ),
    ),
}  # fmt: skip


# ---- fault injectors (xtl side only) -----------------------------------------------------------------------------


def swap_q_and_k_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """The HF key map sends q_proj to k_proj and back (shape-compatible only when heads == kv heads)."""
    original = BaseModel.to_hf_key_list

    def swapped(self: BaseModel, key: str) -> list[str]:
        table = {".q_proj.": ".k_proj.", ".k_proj.": ".q_proj."}
        out = []
        for hf_key in original(self, key):
            for old, new in table.items():
                if old in hf_key:
                    hf_key = hf_key.replace(old, new)
                    break
            out.append(hf_key)
        return out

    monkeypatch.setattr(BaseModel, "to_hf_key_list", swapped)


def wrong_rope_theta(monkeypatch: pytest.MonkeyPatch) -> None:
    """xtl's rotary embeddings use twice the config's ``rope_theta``."""
    original = RotaryEmbedding.__init__

    def init(self: RotaryEmbedding, hf_config: object) -> None:
        hf_config = copy.deepcopy(hf_config)
        params = dict(hf_config.rope_parameters)
        params["rope_theta"] = 2 * params["rope_theta"]
        hf_config.rope_parameters = params
        original(self, hf_config)

    monkeypatch.setattr(RotaryEmbedding, "__init__", init)


def wrong_norm_eps(monkeypatch: pytest.MonkeyPatch) -> None:
    """xtl's RMSNorms use 100x the config's epsilon."""
    original = RMSNorm.__init__

    def init(self: RMSNorm, hidden_size: int, eps: float = 1e-6) -> None:
        original(self, hidden_size, 100 * eps)

    monkeypatch.setattr(RMSNorm, "__init__", init)


def router_top_k_plus_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """xtl's MoE routers pick one expert more than the config says."""
    original = MoEConfig.build_router

    def build_router(self: MoEConfig) -> nn.Module:
        router = original(self)
        router.top_k += 1
        return router

    monkeypatch.setattr(MoEConfig, "build_router", build_router)


# fault -> (model of MODELS it applies to, first diverging layer)
FAULTS = {
    "swapped_q_k_keys": (swap_q_and_k_keys, "llama_mha", "layer 0"),
    "wrong_rope_theta": (wrong_rope_theta, "llama_gqa", "layer 0"),
    "wrong_norm_eps": (wrong_norm_eps, "qwen3_tied", "layer 0"),
    "router_top_k_plus_one": (router_top_k_plus_one, "qwen3_moe", "layer 1"),  # layer 0 is dense (mlp_only_layers)
}


def tiny_model(name: str, seed: int = 0) -> BaseModel:
    """A randomly initialized xtl model of ``MODELS[name]`` with non-trivial norm weights."""
    model_type, fields = MODELS[name]
    model = MODEL_TYPES[model_type](**TINY, **fields).build()
    torch.manual_seed(seed)
    model.init_weights()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.add_(0.1 * torch.randn_like(param))
    return model


def documents(seed: int = 0) -> ParityDocuments:
    return ParityDocuments.random(TINY["vocab_size"], 40, 3, seed)


def check(model: BaseModel, **kwargs: object) -> ParityReport:
    return run_parity_check(model, documents(), hf_config=model.config.hf_config, **kwargs)


class TestParityDocuments:
    def test_from_packed_drops_padding_and_cuts_at_max_tokens(self):
        ids = torch.arange(12)[None]
        labels = torch.tensor([[1, 2, 3, -100, 5, 6, 7, 8, -100, -100, -100, -100]])
        ctx = SequenceContext.from_lengths(ids, [4, 5, 3], num_padding=3)
        docs = ParityDocuments.from_packed(ctx, labels)
        assert docs.lengths == [4, 5]
        cut = ParityDocuments.from_packed(ctx, labels, max_tokens=7)
        assert cut.lengths == [4, 3]
        assert cut.labels[1].tolist() == [5, 6, -100]  # the cut document's last target is unseen
        assert cut.num_supervised == 5

    def test_token_lists_and_random_documents(self):
        docs = ParityDocuments.from_token_lists([[5, 6, 7], [8, 9]], max_tokens=4)
        assert docs.lengths == [3, 1]
        assert [t.tolist() for t in docs.labels] == [[6, 7, -100], [-100]]
        generated = ParityDocuments.random(50, 11, 3, seed=1)
        assert generated.lengths == [4, 4, 3] and generated.max_token_id() < 50
        with pytest.raises(ValueError, match="cannot split"):
            ParityDocuments.random(50, 2, 3)


class TestRunParityCheck:
    @pytest.mark.parametrize("name", ["llama_gqa", "qwen3_tied", "qwen3_moe"])
    def test_correct_models_are_bitwise_in_hf_impl_mode(self, name):
        model = tiny_model(name)
        report = check(model)
        assert report.ok, report.render()
        assert [r.name for r in report.rows[:4]] == ["embed", "layer 0", "layer 1", "norm"]
        assert {"logits", "loss"} <= {r.name for r in report.rows}
        grads = [r.name for r in report.rows if r.kind == "grad"]
        assert "grad layers.0.self_attn.q_proj.weight" in grads and "grad norm.weight" in grads
        assert all(r.exact for r in report.rows)
        assert report.metrics() == {
            "parity/max_abs_logits": 0.0,
            "parity/max_rel_grad": 0.0,
            "parity/loss_abs_diff": 0.0,
            "parity/ok": 1.0,
        }

    @pytest.mark.parametrize("name", ["llama_gqa", "qwen3_moe"])
    def test_fast_mode_is_within_the_fp32_bounds(self, name):
        model = tiny_model(name)
        model.config.attn_impl = "sdpa"
        report = check(model, mode="fast")
        assert report.ok, report.render()
        assert report.tolerance_name == "fp32"
        assert not all(r.exact for r in report.rows), "sdpa and the fused loss are not bitwise: bounds are used"

    @pytest.mark.parametrize("fault", sorted(FAULTS))
    def test_an_injected_fault_names_the_first_diverging_layer(self, fault, monkeypatch):
        inject, name, layer = FAULTS[fault]
        inject(monkeypatch)
        report = check(tiny_model(name))
        assert not report.ok
        assert report.first_divergence == layer
        assert f"first diverging layer: {layer} (" in report.failure_message()
        names = [r.name for r in report.rows]
        assert all(r.exact for r in report.rows[: names.index(layer)]), "rows before the first diverging one are equal"

    @pytest.mark.parametrize("mode", ["hf_impl", "fast"])
    def test_a_fault_in_the_backward_pass_alone_names_its_gradient_row(self, mode):
        """Catches a gradient row compared with itself (or not at all): the final norm's weight gradient is doubled
        by a hook, so every forward row and every other gradient stays equal."""
        model = tiny_model("qwen3_tied")
        model.norm.weight.register_hook(lambda grad: 2 * grad)
        report = check(model, mode=mode)
        assert not report.ok
        assert report.first_divergence == "grad norm.weight"
        assert "first diverging layer: grad norm.weight (" in report.failure_message()
        failed = [r.name for r in report.rows if not r.ok]
        assert failed == ["grad norm.weight"], failed
        if mode == "hf_impl":
            assert all(r.exact for r in report.rows if r.name != "grad norm.weight")

    def test_a_fault_is_caught_in_fast_mode_too(self, monkeypatch):
        wrong_norm_eps(monkeypatch)
        report = check(tiny_model("qwen3_tied"), mode="fast")
        assert report.first_divergence == "layer 0"

    def test_a_misshapen_key_map_is_reported_as_a_weights_error(self, monkeypatch):
        swap_q_and_k_keys(monkeypatch)  # q and k differ in shape with grouped-query attention
        report = check(tiny_model("llama_gqa"))
        assert report.first_divergence == "weights"
        assert "q_proj" in report.failure_message() or "k_proj" in report.failure_message()

    def test_max_layers_compares_only_the_first_layers(self):
        report = check(tiny_model("qwen3_moe"), max_layers=1)
        assert report.ok
        assert [r.name for r in report.rows] == ["embed", "layer 0"]
        assert report.checked_layers == 1 and report.num_layers == 2
        assert "logits, loss and gradients not compared" in report.notes[0]

    def test_grad_params_select_gradients_and_must_match(self):
        model = tiny_model("llama_gqa")
        report = check(model, grad_params=["layers.1.mlp.*"])
        assert [r.name for r in report.rows if r.kind == "grad"] == [
            "grad layers.1.mlp.gate_proj.weight",
            "grad layers.1.mlp.up_proj.weight",
            "grad layers.1.mlp.down_proj.weight",
        ]
        assert not [r for r in check(model, grad_params=[]).rows if r.kind == "grad"]
        with pytest.raises(ValueError, match="grad_params: 'layers.9.*' matches no trainable parameter"):
            check(model, grad_params=["layers.9.*"])
        assert default_grad_params(tiny_model("qwen3_tied"))[-1] == "embed_tokens.weight"  # the tied head

    def test_the_checked_model_is_left_untouched(self):
        model = tiny_model("qwen3_moe").train()
        model.layers[0].eval()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        marker = torch.ones_like(model.norm.weight)
        model.norm.weight.grad = marker
        rng = torch.get_rng_state()
        assert check(model).ok
        assert model.norm.weight.grad is marker and model.lm_head.weight.grad is None
        assert model.training and not model.layers[0].training and model.layers[1].training
        assert torch.equal(torch.get_rng_state(), rng)
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())

    def test_reference_loaded_from_a_directory(self, tiny_hf_dir):
        from xtl.model import get_model_config_from_hf

        path = tiny_hf_dir("qwen3")
        config = get_model_config_from_hf(path)
        model = config.build()
        model.from_hf(path)
        reference, errors = load_reference(path, config.hf_config, torch.float32)
        assert errors == []
        report = run_parity_check(model, documents(), reference=reference)
        assert report.ok, report.render()


class TestReport:
    def _report(self) -> ParityReport:
        rows = [
            ParityRow("embed", "hidden", 0.0, 0.0, 0.0, exact=True),
            ParityRow("layer 0", "hidden", 0.5, 0.1, 0.0, exact=False),
            ParityRow("logits", "logits", float("nan"), float("nan"), 1.0, exact=False),
            ParityRow("loss", "loss", 0.25, 0.25, 0.0, exact=False),
            ParityRow("grad w", "grad", 1.0, 0.5, 0.0, exact=False),
        ]
        bounds = ParityTolerance(0.0, 1.0, 0.0, 0.0)
        return ParityReport(rows, "hf_impl", "float32", "bitwise", bounds, [3, 4], 2, 2, step=7)

    def test_verdict_metrics_render_and_json(self):
        report = self._report()
        assert not report.ok and report.first_divergence == "layer 0"
        assert not report.rows[2].ok, "a NaN error fails whatever the bound"
        assert report.failure_message().startswith("HF parity check failed at step 7: first diverging layer: layer 0")
        metrics = report.metrics()
        assert metrics["parity/max_rel_grad"] == 0.5 and metrics["parity/loss_abs_diff"] == 0.25
        text = report.render()
        assert "layer 0" in text and "FAIL" in text and text.endswith("FAILED: first diverging layer: layer 0")
        data = json.loads(report.to_json())
        assert data["rows"][2]["max_abs"] == "nan" and data["first_divergence"] == "layer 0" and data["step"] == 7

    def test_resolve_tolerance(self):
        assert resolve_tolerance("auto", "hf_impl", torch.bfloat16)[0] == "bitwise"
        assert resolve_tolerance("auto", "fast", torch.bfloat16)[0] == "bf16"
        assert resolve_tolerance("auto", "fast", torch.float32)[0] == "fp32"
        name, bounds = resolve_tolerance("fp8", "fast", torch.bfloat16, {"grad": 0.5})
        assert name == "fp8+overrides" and bounds.grad == 0.5
        for args, match in [
            (("auto", "eager", torch.float32), "mode must be one of"),
            (("fp4", "fast", torch.float32), "tolerance must be 'auto' or one of"),
            (("fp32", "fast", torch.float32, {"hiden": 1.0}), "tolerances: unknown key 'hiden'"),
            (("fp32", "fast", torch.float32, {"grad": -1}), "tolerances.grad must be >= 0"),
        ]:
            with pytest.raises(ValueError, match=match):
                resolve_tolerance(*args)
