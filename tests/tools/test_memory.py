"""Tests for ``xtl memory``: the reference Qwen3-8B case, published parameter counts, model resolution, parallel
layouts, memory modes (recompute, offload), recipes (--config), --measure."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from xtl.model import MODEL_TYPES, alias_names, get_model_config
from xtl.model.dims import ModelDims
from xtl.tools import memory
from xtl.tools._cli import ToolInputError
from xtl.tools.memory import TrainSetup, estimate_memory, model_dims

GIB = 2**30
ROOT = Path(__file__).resolve().parents[2]
L = 32768  # reference case: Qwen3-8B, 1 node, dp 8, FSDP, L=32768, recompute, flash attention, chunk loss 1024
H, V, HEADS, KV, HD, LAYERS, CHUNK = 4096, 151936, 32, 8, 128, 36, 1024

# Figures printed by the reference calculator (its "B" is 2**30 parameters, its tables are GiB).
REF_PARAMS = {
    "total": 7.628208160400391,
    "embedding": 0.57958984375,
    "attention": 1.4063873291015625,
    "mlp": 5.0626373291015625,
    "head": 0.5795936584472656,
}
REF_COLUMNS = ("params", "grads", "opt_states", "master_params", "master_grads", "acts")
REF_PARTS = {
    "embed": (1.159180, 1.159180, 0.579590, 0.289795, 0.289795, 0.000061),
    "head": (1.159187, 1.159187, 0.579594, 0.289797, 0.289797, 0.625000),
    "layer_attn": (0.078133, 0.078133, 0.039066, 0.019533, 0.019533, 1.751953),
    "layer_mlp": (0.281258, 0.281258, 0.140629, 0.070314, 0.070314, 2.500000),
    "all_attn": (0.0, 0.0, 1.406387, 0.703194, 0.703194, 0.0),
    "all_mlp": (0.0, 0.0, 5.062637, 2.531319, 2.531319, 0.0),
    "layer_input_ckpt": (0.0, 0.0, 0.0, 0.0, 0.0, 0.25),
}
REF_PHASES = {
    "micro1_forward_end": 26.58784294128418,
    "micro1_backward_end": 21.386390686035156,
    "microN_forward_end": 30.401947021484375,
}

# Where xtl's model differs from the reference, per quantity, in bytes (or parameters) and why.
QK_NORM_PARAMS = 2 * HD  # xtl counts q_norm/k_norm weights (256 per layer); the reference leaves them out
DEVIATION_ACTS = {
    # fp32 rstd of input/q/k norms kept by fused RMSNorm; fp32 (not bf16) log-sum-exp; the RoPE *input* q/k is not
    # kept (RoPE's backward only needs cos/sin), the reference counts it.
    "layer_attn": L * ((1 + HEADS + KV) * 4 + HEADS * (4 - 2) - (HEADS * HD + KV * HD) * 2),
    # the post-attention norm output is kept by gate_proj/up_proj (h bf16) plus its fp32 rstd; the reference omits it.
    "layer_mlp": L * (H * 2 + 4),
    # chunked loss keeps chunk x vocab fp32 log-probs; the reference counts 2 x L x chunk (vocab missing), plus rstd.
    "head": CHUNK * V * 4 - 2 * L * CHUNK * 2 + L * 4,
    # token ids are int64 (8 bytes) for the embedding backward; the reference counts 2 bytes.
    "embed": L * (8 - 2),
}


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


@pytest.fixture(scope="module")
def qwen3_8b() -> memory.MemoryEstimate:
    return estimate_memory("qwen3-8b", TrainSetup(nodes=1, gpus_per_node=8, seq_len=L, chunk_loss=CHUNK))


class TestQwen3_8BReference:
    def test_parameter_counts(self, qwen3_8b: memory.MemoryEstimate) -> None:
        p = qwen3_8b.params
        assert p["attention"] == round(REF_PARAMS["attention"] * GIB) + LAYERS * QK_NORM_PARAMS
        for key, ref in REF_PARAMS.items():
            assert _rel(p[key], ref * GIB) < 5e-4, f"{key}: 3 significant digits"
        assert p["total"] == 8_190_735_360, "published Qwen3-8B safetensors parameter count"

    def test_every_component_matches_or_differs_for_the_stated_reason(self, qwen3_8b: memory.MemoryEstimate) -> None:
        for row, values in REF_PARTS.items():
            for col, ref in zip(REF_COLUMNS, values, strict=True):
                mine = qwen3_8b.parts[row][col] / GIB
                if col == "acts" and row in DEVIATION_ACTS:
                    expected = ref + DEVIATION_ACTS[row] / GIB
                    assert _rel(mine, expected) < 5e-4, f"{row}.{col}: reference {ref} + stated deviation"
                    continue
                if col in ("opt_states", "master_params", "master_grads") and row.endswith("attn"):
                    ref = ref * (1 + QK_NORM_PARAMS / (REF_PARAMS["attention"] * GIB / LAYERS))
                assert mine == pytest.approx(ref, rel=5e-4, abs=1e-6), f"{row}.{col}"

    def test_phases_follow_the_reference_composition(self, qwen3_8b: memory.MemoryEstimate) -> None:
        def phases(parts: dict[str, dict[str, float]], embed_acts_in_forward: bool) -> dict[str, float]:
            static = sum(
                parts[r]["master_params"] + parts[r]["opt_states"] for r in ("embed", "head", "all_attn", "all_mlp")
            )
            grads = sum(parts[r]["master_grads"] for r in ("embed", "head", "all_attn", "all_mlp"))
            layer = sum(parts[r][c] for r in ("layer_attn", "layer_mlp") for c in ("params", "acts"))
            fwd = layer + parts["head"]["params"] + parts["head"]["acts"] + parts["layer_input_ckpt"]["acts"] * 35
            fwd += parts["embed"]["acts"] if embed_acts_in_forward else 0.0
            bwd = static + grads + layer + parts["embed"]["params"] + parts["embed"]["acts"]
            bwd += parts["layer_attn"]["grads"] + parts["layer_mlp"]["grads"]
            return {
                "micro1_forward_end": static + fwd,
                "micro1_backward_end": bwd,
                "microN_forward_end": static + grads + fwd,
            }

        ref_parts = {r: dict(zip(REF_COLUMNS, v, strict=True)) for r, v in REF_PARTS.items()}
        for name, value in phases(ref_parts, embed_acts_in_forward=False).items():
            assert value == pytest.approx(REF_PHASES[name], rel=1e-5), "composition transcribed from the reference"
        # xtl also keeps the embedding's token ids until backward under recompute (the reference leaves it as a todo)
        expected = phases(qwen3_8b.parts, embed_acts_in_forward=True)
        for name, value in expected.items():
            assert qwen3_8b.phases[name].bytes == pytest.approx(value, rel=1e-9)
            shift = qwen3_8b.phases[name].bytes / GIB - REF_PHASES[name]
            assert abs(shift) < 0.5, f"{name}: within 0.5 GiB of the reference ({shift:+.3f} GiB)"

    def test_peaks_and_their_phases(self, qwen3_8b: memory.MemoryEstimate) -> None:
        assert qwen3_8b.peak_mb1.name == "micro1_forward_end"
        assert qwen3_8b.peak_mbn.name == "microN_forward_end"
        assert qwen3_8b.peak_mbn.bytes / GIB == pytest.approx(30.80, abs=0.01)


class TestPublishedParameterCounts:
    def test_qwen3_30b_a3b_moe(self) -> None:
        h, layers, heads, kv, hd, experts, top_k, inter, vocab = 2048, 48, 32, 4, 128, 128, 8, 768, 151936
        attn = h + 2 * h * heads * hd + 2 * h * kv * hd + 2 * hd  # input norm, q/o, k/v, q/k norms
        routed = experts * 3 * h * inter
        mlp = h + experts * h + routed  # post norm, router, experts
        total = vocab * h + layers * (attn + mlp) + h + vocab * h
        activated = total - layers * routed * (experts - top_k) // experts
        p = model_dims("qwen3-30b-a3b").parameter_counts()
        assert (p["total"], p["activated"], p["experts"]) == (total, activated, layers * routed)
        assert round(total / 1e9, 1) == 30.5 and 3.3e9 <= activated < 3.4e9  # model card: 30.5B / 3.3B

    def test_deepseek_v3_mla_moe(self) -> None:
        h, vocab, layers, dense, heads = 7168, 129280, 61, 3, 128
        q_lora, kv_lora, nope, rope, v_dim, experts, top_k, inter = 1536, 512, 128, 64, 128, 256, 8, 2048
        attn = h + (h * q_lora + q_lora + q_lora * heads * (nope + rope))  # norm, q_a, q_a_norm, q_b
        attn += h * (kv_lora + rope) + kv_lora + kv_lora * heads * (nope + v_dim) + heads * v_dim * h  # kv_a, kv_b, o
        dense_mlp = h + 3 * h * 18432
        routed = experts * 3 * h * inter
        moe_mlp = h + experts * h + experts + 3 * h * inter + routed  # norm, router + score bias, shared, routed
        total = 2 * vocab * h + h + layers * attn + dense * dense_mlp + (layers - dense) * moe_mlp
        activated = total - (layers - dense) * routed * (experts - top_k) // experts
        p = model_dims("deepseek-v3").parameter_counts()
        assert (p["total"], p["activated"]) == (total, activated)
        assert round(total / 1e9) == 671 and 37e9 <= activated < 38e9  # paper: 671B total, 37B activated

    @pytest.mark.parametrize(
        ("alias", "total_b", "active_b"),
        [("gpt-oss-20b", 20.91, 3.61), ("gpt-oss-120b", 116.83, 5.13), ("llama-3.1-8b", 8.03, None),
         ("llama-3.1-70b", 70.55, None), ("qwen3-235b-a22b", 235.09, 22.19), ("qwen3-0.6b", 0.596, None)],
    )  # fmt: skip
    def test_model_cards(self, alias: str, total_b: float, active_b: float | None) -> None:
        p = model_dims(alias).parameter_counts()
        assert p["total"] / 1e9 == pytest.approx(total_b, abs=0.01)
        if active_b is not None:  # OpenAI counts active parameters without the embedding
            embedding = p["embedding"] if alias.startswith("gpt-oss") else 0
            assert (p["activated"] - embedding) / 1e9 == pytest.approx(active_b, abs=0.01)


# Tiny HF configs of every family: the counts must equal the tensors of the model xtl builds from them.
_TINY = dict(vocab_size=160, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, max_position_embeddings=256)
TINY_HF_CONFIGS = {
    "llama_tied": dict(model_type="llama", intermediate_size=96, num_key_value_heads=2, tie_word_embeddings=True),
    "llama_biases": dict(model_type="llama", intermediate_size=96, attention_bias=True, mlp_bias=True),
    "qwen2": dict(model_type="qwen2", intermediate_size=96, num_key_value_heads=2),
    "qwen3": dict(model_type="qwen3", intermediate_size=96, num_key_value_heads=2, head_dim=8),
    "qwen3_moe": dict(
        model_type="qwen3_moe", num_key_value_heads=2, head_dim=16, intermediate_size=96, moe_intermediate_size=32,
        num_experts=8, num_experts_per_tok=3, mlp_only_layers=[0],
    ),
    "deepseek_v3": dict(
        model_type="deepseek_v3", num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=32,
        n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1,
        n_shared_experts=2, q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
    ),
    "deepseek_v3_no_q_lora": dict(
        model_type="deepseek_v3", intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, n_group=1,
        topk_group=1, num_experts_per_tok=2, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=12, attention_bias=True,
    ),
    "gpt_oss": dict(
        model_type="gpt_oss", num_key_value_heads=2, head_dim=16, intermediate_size=32, num_local_experts=8,
        num_experts_per_tok=2, sliding_window=6,
    ),
}  # fmt: skip


class TestModelResolution:
    def test_every_help_alias_resolves_through_the_registry(self, capsys: pytest.CaptureFixture) -> None:
        assert memory.main(["--help"]) == 0
        listed = capsys.readouterr().out.split("aliases: ")[1].split("\n")[0].split(", ")
        assert set(listed) == set(alias_names()) and "qwen3-8b" in listed and "deepseek-v3" in listed
        for alias in listed:
            assert model_dims(alias) == ModelDims.from_config(get_model_config(alias), alias)

    @pytest.mark.parametrize(
        ("old", "registered"),
        [("llama-3.1-8b", "llama3.1-8b"), ("llama-3.1-70b", "llama3.1-70b"), ("Qwen3_30B_A3B", "qwen3-30b-a3b")],
    )
    def test_former_table_spellings_resolve(self, old: str, registered: str) -> None:
        assert model_dims(old).parameter_counts() == model_dims(registered).parameter_counts()

    def test_unknown_alias_lists_the_aliases(self) -> None:
        with pytest.raises(ToolInputError, match="known alias") as err:
            model_dims("no-such-model")
        assert all(alias in str(err.value) for alias in alias_names())

    def test_hf_directory_written_by_transformers(self, tmp_path: Path) -> None:
        from transformers import Qwen3MoeConfig

        h, heads, kv, hd, experts, top_k, inter, vocab, layers = 64, 4, 2, 16, 8, 2, 32, 160, 2
        Qwen3MoeConfig(
            vocab_size=vocab, hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
            num_key_value_heads=kv, head_dim=hd, moe_intermediate_size=inter, num_experts=experts,
            num_experts_per_tok=top_k,
        ).save_pretrained(tmp_path / "tiny-moe")  # fmt: skip
        dims = model_dims(str(tmp_path / "tiny-moe"))
        assert (dims.name, dims.num_experts, dims.experts_per_token, dims.moe_layers) == ("tiny-moe", 8, 2, (0, 1))
        attn = h + 2 * h * heads * hd + 2 * h * kv * hd + 2 * hd  # input norm, q/o, k/v, q/k norms
        routed = experts * 3 * h * inter
        total = 2 * vocab * h + h + layers * (attn + h + experts * h + routed)  # post norm, router, experts
        p = dims.parameter_counts()
        assert (p["total"], p["experts"]) == (total, layers * routed)
        assert model_dims(str(tmp_path / "tiny-moe" / "config.json")) == dims

    @pytest.mark.parametrize("variant", sorted(TINY_HF_CONFIGS))
    def test_counts_equal_the_built_model(self, variant: str) -> None:
        fields = {**_TINY, **TINY_HF_CONFIGS[variant]}
        dims = model_dims(fields)
        cls = MODEL_TYPES[fields["model_type"]]
        with torch.device("meta"):
            model = cls.from_hf_config(cls.hf_config_class.from_dict(fields)).build()
        tensors = model.checkpoint_tensors()  # parameters (tied ones once) and persistent buffers
        p = dims.parameter_counts()
        assert p["total"] == sum(t.numel() for t in tensors.values())
        assert p["embedding"] == tensors["embed_tokens.weight"].numel()
        assert p["attention"] == sum(
            t.numel() for k, t in tensors.items() if ".self_attn." in k or "input_layernorm" in k
        )
        assert p["experts"] == sum(t.numel() for k, t in tensors.items() if ".experts." in k)

    def test_a_reward_model_counts_its_scalar_head(self) -> None:
        """A ``*ForSequenceClassification`` config with one label (a reward export): the head is one row, not the
        vocabulary, and the counts equal the built model's tensors."""
        fields = {**_TINY, **TINY_HF_CONFIGS["qwen3"], "architectures": ["Qwen3ForSequenceClassification"]}
        fields.update(num_labels=1, tie_word_embeddings=False)
        dims = model_dims(fields)
        assert dims.head_outputs == 1 and dims.head_params() == 2 * dims.hidden_size
        cls = MODEL_TYPES[fields["model_type"]]
        with torch.device("meta"):
            model = cls.from_hf_config(cls.hf_config_class.from_dict(fields)).build()
        tensors = model.checkpoint_tensors()
        assert dims.parameter_counts()["total"] == sum(t.numel() for t in tensors.values())

    def test_mtp_depths_count_their_weights_flops_and_memory(self) -> None:
        config = get_model_config("deepseek-v3")
        plain, mtp = ModelDims.from_config(config), ModelDims.from_config(replace(config, mtp_layers=1))
        with torch.device("meta"):
            model = replace(config, mtp_layers=1).build()
        tensors = model.checkpoint_tensors()
        p = mtp.parameter_counts()
        assert p["mtp"] == sum(t.numel() for k, t in tensors.items() if k.startswith("mtp."))
        assert p["mtp_experts"] == sum(
            t.numel() for k, t in tensors.items() if k.startswith("mtp.") and ".experts." in k
        )
        assert p["total"] == sum(t.numel() for t in tensors.values()) and "mtp" not in plain.parameter_counts()
        extra = mtp.flops_per_token(4096) - plain.flops_per_token(
            4096
        )  # the depth's weights, the head again, attention
        head = config.vocab_size * config.hidden_size
        active = mtp.mtp_params(activated=True)
        assert extra == pytest.approx(6 * (active + head) + 6 * 128 * (192 + 128) * 2048)
        setup = TrainSetup(nodes=64, gpus_per_node=8, ep=64, seq_len=4096)
        base, more = estimate_memory(plain, setup), estimate_memory(mtp, setup)
        assert base == estimate_memory(replace(config, mtp_layers=0), setup)
        assert more.peak_mbn.bytes > base.peak_mbn.bytes and more.params["mtp"] == p["mtp"]
        assert any(label.startswith("MTP depths (1)") for label, _ in more.phases["micro1_forward_end"].items)


class TestParallelLayouts:
    def test_tensor_parallel_halves_layer_params(self) -> None:
        one = estimate_memory("qwen3-8b", TrainSetup(tp=1))
        two = estimate_memory("qwen3-8b", TrainSetup(tp=2))
        assert two.parts["layer_mlp"]["params"] == pytest.approx(one.parts["layer_mlp"]["params"] / 2)
        assert two.parts["layer_attn"]["acts"] == pytest.approx(one.parts["layer_attn"]["acts"] / 2)

    def test_context_parallel_divides_the_tokens_of_a_gpu(self) -> None:
        """cp 2 at 2L tokens keeps what cp 1 keeps at L, plus Ulysses' local attention output and its buffers."""
        one = estimate_memory("qwen3-8b", TrainSetup(seq_len=4096, recompute="none"))
        two = estimate_memory("qwen3-8b", TrainSetup(seq_len=8192, recompute="none", cp=2))
        dims = model_dims("qwen3-8b")
        q = dims.num_heads * dims.head_dim * 2 * 4096  # bf16 q-sized tensor of 4096 local tokens
        assert two.parts["layer_mlp"]["acts"] == one.parts["layer_mlp"]["acts"]
        assert two.parts["layer_attn"]["acts"] == one.parts["layer_attn"]["acts"] + q  # o_proj's local input
        assert two.parts["layer_attn"]["params"] == one.parts["layer_attn"]["params"], "sharded over all 8 GPUs"
        (buffers,) = [v for k, v in two.phases["micro1_forward_end"].items if k.startswith("Ulysses")]
        kv = dims.num_kv_heads * dims.head_dim * 2 * 4096
        assert buffers == 2 * (2 * q + 2 * kv)
        # 16 GPUs of one sequence: 8 key/value heads are repeated twice to split evenly
        sixteen = estimate_memory("qwen3-8b", TrainSetup(nodes=2, seq_len=16384, recompute="none", cp=16))
        (buffers,) = [v for k, v in sixteen.phases["micro1_forward_end"].items if k.startswith("Ulysses")]
        assert buffers == 2 * (2 * q + 2 * 2 * kv) / 4
        with pytest.raises(ToolInputError, match="cp=3 is modelled with ZeRO-3 and tp 1"):
            estimate_memory("qwen3-8b", TrainSetup(nodes=3, cp=3))

    def test_expert_parallel_shards_expert_states(self) -> None:
        base = TrainSetup(nodes=2, seq_len=4096)
        ep1 = estimate_memory("qwen3-30b-a3b", base)
        ep8 = estimate_memory("qwen3-30b-a3b", TrainSetup(nodes=2, seq_len=4096, ep=8))
        assert ep8.parts["layer_mlp"]["params"] < ep1.parts["layer_mlp"]["params"] / 7
        # xtl's layout: experts split over ep = 8 and FSDP-sharded over edp = 16 / 8 = 2, so routed-expert states per
        # GPU stay 128 / 16 experts' worth; the non-expert part (post norm + router) stays sharded 16-way.
        experts = 128 * 3 * 2048 * 768
        assert ep8.parts["layer_mlp"]["master_params"] == pytest.approx(ep1.parts["layer_mlp"]["master_params"])
        assert ep8.parts["layer_mlp"]["params"] == pytest.approx(
            ep1.parts["layer_mlp"]["params"] - experts * 2 * 7 / 8
        )

    def test_the_layout_is_xtls(self, capsys: pytest.CaptureFixture) -> None:
        """``dp`` is the layout's ``dp_size``: 8 GPUs at cp 4 are 2 data-parallel ranks (as the sampler counts them),
        while parameters are sharded over all 8; the report and the recipe reader name the same layout."""
        from xtl.strategies.layout import ParallelLayout

        setup = TrainSetup(seq_len=65536, cp=4)
        assert setup.layout == ParallelLayout.for_world(8, cp=4)
        assert (setup.dp, setup.shard, setup.edp) == (2, 8, 8)
        assert memory.main(["qwen3-8b", "--cp", "4", "--seq-len", "65536"]) == 0
        assert ", gpus 8, dp_replicate 1 x dp_shard 2 x cp 4 (dp 2), ep 1, tp 1," in capsys.readouterr().out
        options = _json(capsys, "qwen3-8b", "--cp", "4", "--seq-len", "65536", "--recompute", "full")
        recipe = _json(capsys, "--config", str(ROOT / "configs/qwen3_8b_long_context.yaml"), "qwen3-8b")
        assert {k: options["setup"][k] for k in ("gpus", "dp", "dp_shard", "edp", "cp")} == {
            "gpus": 8, "dp": 2, "dp_shard": 2, "edp": 8, "cp": 4,
        }  # fmt: skip
        assert recipe["phases"] == options["phases"], "the same physical run"
        assert "dp_replicate 1 x dp_shard 2 x cp 4, dp 2 (trainer.strategy" in recipe["recipe"]["read_from"]["layout"]
        experts = TrainSetup(nodes=2, ep=8, tp=2, zero=1)  # experts are not split by tp: sharded over 16 / 8 GPUs
        assert (experts.layout.dp_shard, experts.layout.edp, experts.edp) == (8, 1, 2)

    @pytest.mark.parametrize(
        ("kwargs", "message"),
        [
            ({"nodes": 3, "cp": 3}, "cp=3 is modelled with ZeRO-3 and tp 1; it must divide the 24 GPUs and the 32"),
            ({"cp": 3}, "cp=3 is modelled with ZeRO-3 and tp 1; it must divide the 8 GPUs"),
            ({"cp": 2, "dp_replicate": 3}, r"must divide the 4 GPUs of dp_replicate x dp_shard \(GPUs / cp\)"),
            ({"ep": 16, "model": "qwen3-30b-a3b"}, r"ep=16 must divide the 8 GPUs a parameter is sharded over"),
        ],
    )
    def test_a_layout_that_does_not_fit_is_refused(self, kwargs: dict, message: str) -> None:
        model = kwargs.pop("model", "qwen3-8b")
        with pytest.raises(ToolInputError, match=message):
            estimate_memory(model, TrainSetup(**kwargs))

    def test_the_estimate_loads_no_lightning(self) -> None:
        """The layout comes from ``xtl.strategies.layout`` without Lightning, so ``xtl memory`` starts quickly."""
        code = (
            "import sys\nfrom xtl.tools.memory import TrainSetup, estimate_memory\n"
            "estimate_memory('qwen3-8b', TrainSetup(cp=2))\nassert 'lightning' not in sys.modules, 'lightning'\n"
        )
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]

    def test_zero1_pipeline_keeps_micro_batches_in_flight(self) -> None:
        setup = dict(nodes=8, zero=1, pp=4, tp=2, seq_len=4096, recompute="none", chunk_loss=1024)
        est = estimate_memory("qwen3-32b", TrainSetup(**setup))
        many = est.phases["microN_forward_end"].items
        per_micro_batch = 16 * (est.parts["layer_attn"]["acts"] + est.parts["layer_mlp"]["acts"])
        per_micro_batch += est.parts["embed"]["acts"]  # first stage: 64 layers / pp 4, plus the embedding
        assert "4 in-flight" in many[1][0] and many[1][1] == pytest.approx(4 * per_micro_batch)
        interleaved = estimate_memory("qwen3-32b", TrainSetup(**setup, vpp=2))
        assert "5.5 in-flight" in interleaved.phases["microN_forward_end"].items[1][0]  # p + (p-1)/vpp
        assert est.peak_mbn.name.endswith("(stage 0)")

    def test_recompute_flash_and_chunk_loss(self) -> None:
        base = dict(seq_len=8192)
        ref = estimate_memory("qwen3-8b", TrainSetup(**base, chunk_loss=1024))
        no_rc = estimate_memory("qwen3-8b", TrainSetup(**base, chunk_loss=1024, recompute="none"))
        no_flash = estimate_memory("qwen3-8b", TrainSetup(**base, chunk_loss=1024, flash_attn=False))
        no_chunk = estimate_memory("qwen3-8b", TrainSetup(**base))
        assert no_rc.peak_mbn.bytes > ref.peak_mbn.bytes + 30 * ref.parts["layer_mlp"]["acts"]
        extra = no_flash.parts["layer_attn"]["acts"] - ref.parts["layer_attn"]["acts"]
        assert extra == pytest.approx(HEADS * 8192 * 8192 * 2 - 8192 * HEADS * 4)  # probabilities in, lse out
        assert no_chunk.parts["head"]["acts"] - ref.parts["head"]["acts"] == pytest.approx((8192 - 1024) * V * 4)

    def test_deepseek_first_layers_are_dense(self) -> None:
        est = estimate_memory("deepseek-v3", TrainSetup(nodes=32, ep=64, seq_len=4096))
        assert "first_layer_mlp" in est.parts
        assert est.parts["first_layer_mlp"]["params"] != est.parts["layer_mlp"]["params"]

    @pytest.mark.parametrize(
        "kwargs", [{"pp": 2}, {"tp": 3}, {"ep": 2}, {"zero": 1, "pp": 5}, {"micro_batch_size": 0}]
    )
    def test_invalid_setups(self, kwargs: dict) -> None:
        with pytest.raises(ToolInputError):
            estimate_memory("qwen3-8b", TrainSetup(**kwargs))


class TestMeasure:
    def test_formula_agrees_with_autograd(self) -> None:
        from xtl.tools._memory_measure import MODE_TOLERANCE, MODES, TOLERANCE

        result = memory.measure_activations(seq_len=256)
        assert result.max_grad_diff < 1e-4, "fused-style ops compute the same gradients as transformers"
        assert abs(result.ratio - 1) <= TOLERANCE == 0.03, result.render()
        assert result.measured_bytes >= result.formula_bytes, "the formula leaves out only cos/sin and labels"
        assert result.stock_hf_bytes > result.measured_bytes  # eager RMSNorm/SiLU keep extra copies
        assert result.ok, result.render()
        modes = {m.mode: m for m in result.modes}
        assert list(modes) == list(MODES) and MODE_TOLERANCE == 0.02
        for m in modes.values():
            assert m.ok and m.max_grad_diff == 0.0, result.render()  # the callbacks change memory, not gradients
        gpu = {name: m.gpu_measured for name, m in modes.items()}
        assert gpu["none"] > gpu["selective"] > gpu["full every 2"] > gpu["full"] > gpu["offload"] == 0
        assert gpu["full"] == 256 * 64 * 4, "a fully recomputed layer keeps its fp32 input"
        # offloading moves a layer's activations (and its copy of RoPE's cos/sin) to host memory
        assert modes["offload"].host_measured == gpu["none"] + 256 * 2 * 16 * 4
        assert modes["full+offload"].host_measured == gpu["full"] and modes["full+offload"].gpu_measured == 0
        table = result.render()
        assert all(f"{name:<14}" in table for name in MODES) and "OUT OF TOLERANCE" not in table
        # context parallelism 2: a layer on rank 0 keeps the estimate's bytes of its half of the sequence, the
        # gradients summed over both ranks are the whole sequence's
        cp = {m.mode: m for m in result.cp_modes}
        assert list(cp) == ["cp 2", "cp 2 full"] and all(m.ok for m in cp.values()), table
        assert cp["cp 2"].gpu_measured == cp["cp 2"].gpu_estimate < gpu["none"]
        assert cp["cp 2 full"].gpu_measured == gpu["full"] / 2, "half the layer inputs"
        assert "gradients equal to the whole sequence's on one process" in table

    def test_mode_check_fails_outside_its_tolerance(self) -> None:
        from xtl.tools._memory_measure import ModeResult

        close = ModeResult("full", {}, 101.0, 100.0, 0.0, 0.0, reference=1000.0, max_grad_diff=0.0)
        assert close.ok and close.gpu_ratio == pytest.approx(1.01) and close.host_ratio is None
        assert not ModeResult("full", {}, 103.0, 100.0, 0.0, 0.0, reference=1000.0, max_grad_diff=0.0).ok
        assert not ModeResult("offload", {}, 30.0, 0.0, 100.0, 100.0, reference=1000.0, max_grad_diff=0.0).ok
        assert not ModeResult("full", {}, 100.0, 100.0, 0.0, 0.0, reference=1000.0, max_grad_diff=1e-3).ok


def _kept_item(est: memory.MemoryEstimate, phase: str = "micro1_forward_end") -> tuple[str, float]:
    return next(item for item in est.phases[phase].items if item[0].startswith("kept by the other"))


I8B = 12288  # Qwen3-8B intermediate size
QD, KD = HEADS * HD, KV * HD
# bytes per token of one Qwen3-8B layer (bf16), from the formulas stated in docs/tools.md
FULL_ACTS = (2 * H * 2 + 4) + (QD + KD) * 2 + (HEADS + KV) * 4 + (2 * QD + 2 * KD) * 2 + HEADS * 4  # attention
FULL_ACTS += (2 * H * 2 + 4) + 3 * I8B * 2  # MLP
SELECTIVE = (H + (QD + 2 * KD) + QD + H) * 2 + HEADS * 4 + (2 * I8B + H) * 2  # input, matmul + attention outputs
CHECKPOINT = H * 2


class TestMemoryModes:
    SEQ = 8192

    def _est(self, **kwargs: object) -> memory.MemoryEstimate:
        return estimate_memory("qwen3-8b", TrainSetup(seq_len=self.SEQ, **kwargs))

    def test_recompute_modes_keep_what_they_save(self) -> None:
        none, selective, full = (self._est(recompute=m) for m in ("none", "selective", "full"))
        assert none.peak_mbn.bytes > selective.peak_mbn.bytes > full.peak_mbn.bytes
        for est, per_token, kind in [
            (none, FULL_ACTS, "all activations"),
            (selective, SELECTIVE, "matmul outputs (selective)"),
            (full, CHECKPOINT, "layer input (full recompute)"),
        ]:
            label, value = _kept_item(est)
            assert value == 35 * self.SEQ * per_token and label.endswith(f"{kind} x 35"), label
        # the default is full recompute, whose figures are unchanged; a boolean is no mode
        assert TrainSetup().recompute == "full"
        with pytest.raises(ToolInputError, match="recompute must be one of none, full, selective; got True"):
            estimate_memory("qwen3-8b", TrainSetup(recompute=True))
        assert full.parts["layer_input_ckpt"]["acts"] == self.SEQ * CHECKPOINT

    def test_every_n_layers_lies_between(self) -> None:
        full, none = self._est(recompute="full"), self._est(recompute="none")
        every2 = self._est(recompute="full", recompute_every_n_layers=2)
        assert full.peak_mbn.bytes < every2.peak_mbn.bytes < none.peak_mbn.bytes
        label, value = _kept_item(every2)  # layers 0, 2, ..., 34 checkpointed; 1, 3, ..., 33 keep everything
        assert value == self.SEQ * (18 * CHECKPOINT + 17 * FULL_ACTS), label
        selective2 = self._est(recompute="selective", recompute_every_n_layers=2)
        assert _kept_item(selective2)[1] == self.SEQ * (18 * SELECTIVE + 17 * FULL_ACTS)

    def test_offload_moves_layer_activations_to_host(self) -> None:
        none, offload = self._est(recompute="none"), self._est(recompute="none", offload=True)
        assert offload.peak_mbn.bytes < none.peak_mbn.bytes
        label, value = _kept_item(offload)
        assert value == 0 and "offloaded" in label
        in_flight = next(v for k, v in offload.phases["micro1_forward_end"].items if k.startswith("offload:"))
        assert in_flight == self.SEQ * FULL_ACTS, "one more layer's tensors: copy or prefetch"
        rope = 2 * HD * 2  # each offloaded layer copies RoPE's cos/sin
        assert offload.host_bytes == 36 * self.SEQ * (FULL_ACTS + rope) and none.host_bytes == 0
        full, full_offload = self._est(), self._est(offload=True)
        assert full_offload.peak_mbn.bytes < full.peak_mbn.bytes
        assert full_offload.host_bytes == 36 * self.SEQ * CHECKPOINT
        every2 = self._est(recompute="none", offload=True, offload_every_n_layers=2)
        assert offload.peak_mbn.bytes < every2.peak_mbn.bytes < none.peak_mbn.bytes
        assert _kept_item(every2)[1] == 17 * self.SEQ * FULL_ACTS  # layers 1, 3, ..., 33 stay on the GPU
        layers = self._est(recompute="none", offload=True, offload_layers=(0, -2))  # -2: layer 34
        assert _kept_item(layers)[1] == 33 * self.SEQ * FULL_ACTS and "layers [0, -2]" in layers.render()

    def test_moe_full_recompute_keeps_the_routing(self) -> None:
        est = estimate_memory("qwen3-30b-a3b", TrainSetup(seq_len=4096, ep=8))
        assert est.parts["layer_input_ckpt"]["acts"] == 4096 * (2048 * 2 + 8 * (4 + 8))  # input, top-k weights + ids
        selective = estimate_memory("qwen3-30b-a3b", TrainSetup(seq_len=4096, ep=8, recompute="selective"))
        none = estimate_memory("qwen3-30b-a3b", TrainSetup(seq_len=4096, ep=8, recompute="none"))
        assert none.peak_mbn.bytes > selective.peak_mbn.bytes > est.peak_mbn.bytes

    def test_zero1_working_set_is_the_rest_of_one_layer(self) -> None:
        setup = dict(nodes=4, zero=1, pp=4, seq_len=4096, chunk_loss=1024)
        for mode in ("full", "selective"):
            est = estimate_memory("qwen3-8b", TrainSetup(**setup, recompute=mode))
            items = dict(est.phases["microN_forward_end"].items)
            per_token = CHECKPOINT if mode == "full" else SELECTIVE
            work = items["recompute / restore working set: the rest of one layer's activations"]
            assert work == 4096 * (FULL_ACTS - per_token)

    @pytest.mark.parametrize(
        "kwargs",
        [{"recompute": "partial"}, {"recompute_every_n_layers": 0}, {"offload": True, "offload_layers": (36,)},
         {"offload": True, "offload_layers": (0,), "offload_every_n_layers": 2}],
    )  # fmt: skip
    def test_invalid_settings(self, kwargs: dict) -> None:
        with pytest.raises(ToolInputError):
            estimate_memory("qwen3-8b", TrainSetup(**kwargs))

    def test_cli_options(self, capsys: pytest.CaptureFixture) -> None:
        def setup(*args: str) -> dict:
            assert memory.main(["qwen3-8b", "--format", "json", *args]) == 0
            return json.loads(capsys.readouterr().out)["setup"]

        assert setup()["recompute"] == "full" and setup("--no-recompute")["recompute"] == "none"
        assert setup("--recompute")["recompute"] == "full"
        got = setup("--recompute", "selective", "--recompute-every-n-layers", "3")
        assert (got["recompute"], got["recompute_every_n_layers"], got["offload"]) == ("selective", 3, False)
        assert setup("--offload")["offload"] is True
        got = setup("--offload-every-n-layers", "2")  # implies --offload
        assert (got["offload"], got["offload_every_n_layers"]) == (True, 2)
        assert setup("--offload-layers", "0,-1")["offload_layers"] == [0, -1]
        assert memory.main(["qwen3-8b", "--recompute", "sometimes"]) == 2
        assert memory.main(["qwen3-8b", "--offload-layers", "a,b"]) == 2
        assert memory.main(["qwen3-8b", "--recompute-every-n-layers", "0"]) == 2
        assert "must be >= 1" in capsys.readouterr().err


def _stated_gpu_memory(recipe: Path) -> int:
    found = re.findall(r"^# gpu-memory: (\d+)GiB$", recipe.read_text(), flags=re.MULTILINE)
    assert len(found) == 1, f"{recipe.name} states its GPU memory once, as '# gpu-memory: <n>GiB'"
    return int(found[0]) * GIB


def _json(capsys: pytest.CaptureFixture, *args: str, code: int = 0) -> dict:
    assert memory.main([*args, "--format", "json"]) == code, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


class TestRecipeConfig:
    def test_reads_the_merged_recipe_and_fragments(self) -> None:
        recipe = memory.read_recipe(
            [ROOT / "configs/qwen3_30b_a3b_sft.yaml", ROOT / "callbacks/activation_offload.yaml"]
        )
        s = recipe.setup
        assert (s["nodes"], s["gpus_per_node"], s["zero"], s["ep"], s["seq_len"], s["micro_batch_size"]) == (
            1, 8, 3, 8, 8192, 1,
        )  # fmt: skip
        assert (s["act_bytes"], s["param_bytes"], s["grad_bytes"]) == (2, 2, 2)  # param_dtype bfloat16
        assert (s["recompute"], s["recompute_every_n_layers"], s["offload"]) == ("full", 1, True)
        assert recipe.model == "env:QWEN3_30B_A3B_PATH" and recipe.micro_batches_per_step == 4
        assert recipe.gpu_memory == 80 * GIB and recipe.gpu_memory_file.endswith("qwen3_30b_a3b_sft.yaml")

    def test_callback_options_and_a_dict_model(self, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
        fragment = tmp_path / "memory.yaml"
        fragment.write_text(
            "# gpu-memory: 2GiB\n"
            "trainer:\n  callbacks+:\n"
            "    - class_path: xtl.callbacks.ActivationCheckpointing\n"
            "      init_args: {mode: selective, every_n_layers: 2}\n"
            "    - class_path: xtl.callbacks.ActivationOffload\n      init_args: {layers: [0, -1]}\n"
        )
        recipe = memory.read_recipe([ROOT / "configs/tiny_sft.yaml", fragment])
        s = recipe.setup
        assert (s["recompute"], s["recompute_every_n_layers"]) == ("selective", 2)
        assert (s["offload"], s["offload_layers"], s["nodes"], s["gpus_per_node"]) == (True, (0, -1), 1, 1)
        assert (s["act_bytes"], s["seq_len"], recipe.gpu_memory) == (2, 512, 2 * GIB)  # bf16-mixed recipe, 512 packs
        data = _json(capsys, "--config", str(ROOT / "configs/tiny_sft.yaml"), "--config", str(fragment))
        assert data["params"]["total"] == model_dims(
            {"model_type": "qwen3", "vocab_size": 1600, "hidden_size": 128, "intermediate_size": 384,
             "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
             "tie_word_embeddings": True}
        ).parameter_counts()["total"]  # fmt: skip
        assert data["gpu_memory"]["fits"] and data["setup"]["gpus_per_node"] == 1

    def test_recipe_equals_the_same_settings_given_as_options(self, capsys: pytest.CaptureFixture) -> None:
        recipe = _json(capsys, "--config", str(ROOT / "configs/qwen3_30b_a3b_sft.yaml"), "qwen3-30b-a3b")
        options = _json(capsys, "qwen3-30b-a3b", "--gpus-per-node", "8", "--ep", "8", "--seq-len", "8192")
        assert recipe["phases"] == options["phases"] and recipe["recipe"]["setup"]["recompute"] == "full"
        # options given on the command line override the recipe's
        mine = _json(
            capsys, "--config", str(ROOT / "configs/qwen3_30b_a3b_sft.yaml"), "--model", "qwen3-30b-a3b",
            "--seq-len", "4096", "--recompute", "selective", "--offload",
        )  # fmt: skip
        assert (mine["setup"]["seq_len"], mine["setup"]["recompute"], mine["setup"]["offload"]) == (
            4096, "selective", True,
        )  # fmt: skip

    def test_model_from_an_env_path(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
    ) -> None:
        recipe = str(ROOT / "configs/qwen3_8b_pretrain.yaml")
        monkeypatch.delenv("QWEN3_8B_PATH", raising=False)
        assert memory.main(["--config", recipe]) == 2
        err = capsys.readouterr().err
        assert "QWEN3_8B_PATH is not set" in err and "name the model on the command line" in err
        assert len(err.strip().splitlines()) == 1
        get_model_config("qwen3-8b").hf_config.save_pretrained(tmp_path / "Qwen3-8B")
        monkeypatch.setenv("QWEN3_8B_PATH", str(tmp_path / "Qwen3-8B"))
        data = _json(capsys, "--config", recipe)
        assert data["model"] == "Qwen3-8B" and data["params"]["total"] == 8_190_735_360

    def test_input_errors(self, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
        recipe = str(ROOT / "configs/qwen3_8b_pretrain.yaml")
        twice = ["--config", recipe, "--config", str(ROOT / "callbacks/activation_checkpointing.yaml"), "qwen3-8b"]
        assert memory.main(twice) == 2
        assert "two callbacks that set recompute (ActivationCheckpointing and" in capsys.readouterr().err
        assert memory.main(["--config", str(tmp_path / "missing.yaml"), "qwen3-8b"]) == 2
        assert "no such file" in capsys.readouterr().err
        bad = tmp_path / "bad.yaml"
        bad.write_text("trainer:\n  max_stepz: 3\n")
        assert memory.main(["--config", recipe, "--config", str(bad), "qwen3-8b"]) == 2
        assert "max_stepz" in capsys.readouterr().err
        assert memory.main(["--config", recipe, "qwen3-8b", "--model", "llama3.1-8b"]) == 2
        ddp = tmp_path / "ddp.yaml"
        ddp.write_text("trainer:\n  strategy: ddp\n")
        assert memory.main(["--config", recipe, "--config", str(ddp), "qwen3-8b"]) == 2
        assert "'ddp' on 8 GPUs is not modelled" in capsys.readouterr().err
        assert memory.main(["--config", str(ROOT / "configs/tiny_sft.yaml"), "--config", str(ddp)]) == 0  # 1 GPU
        bad_layout = tmp_path / "bad_layout.yaml"
        bad_layout.write_text(STRATEGY.format(nodes=1, args="{data_parallel_replicate_size: 3}"))
        assert memory.main(["--config", recipe, "--config", str(bad_layout), "qwen3-8b"]) == 2
        assert "data_parallel_replicate_size (3) x data_parallel_shard_size" in capsys.readouterr().err

    def test_an_hsdp_recipe_shards_within_one_replica(self, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
        """HSDP 2 x 8 on 16 GPUs holds what FSDP over 8 GPUs holds; FSDP over all 16 holds less."""
        recipe = str(ROOT / "configs/qwen3_8b_pretrain.yaml")
        hsdp = tmp_path / "hsdp.yaml"
        hsdp.write_text(STRATEGY.format(nodes=2, args="{data_parallel_replicate_size: 2}"))
        read = memory.read_recipe([recipe, hsdp])
        assert (read.setup["dp_replicate"], read.setup["nodes"], read.setup["gpus_per_node"]) == (2, 2, 8)
        assert "dp_replicate 2 x dp_shard 8" in read.read_from["layout"]
        two_nodes = _json(capsys, "--config", recipe, "--config", str(hsdp), "qwen3-8b")
        one_node = _json(capsys, "--config", recipe, "qwen3-8b")
        options = _json(capsys, "--config", recipe, "qwen3-8b", "--nodes", "2", "--dp-replicate", "2")
        assert two_nodes["phases"] == one_node["phases"] == options["phases"]
        sharded_16 = _json(capsys, "--config", recipe, "qwen3-8b", "--nodes", "2")
        assert sharded_16["peak_micro_batch_n"]["bytes"] < one_node["peak_micro_batch_n"]["bytes"]
        assert memory.main(["qwen3-30b-a3b", "--dp-replicate", "2", "--ep", "8"]) == 2
        assert "needs ZeRO-3 without ep" in capsys.readouterr().err

    def test_a_context_parallel_recipe(self) -> None:
        read = memory.read_recipe([ROOT / "configs/qwen3_8b_long_context.yaml"])
        assert (read.setup["cp"], read.setup["seq_len"], read.setup["gpus_per_node"]) == (4, 65536, 8)
        assert "dp_shard 2 x cp 4" in read.read_from["layout"]

    def test_a_transform_states_its_own_memory_settings(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """The reader asks each model-transform callback, so a callback xtl has never seen is read."""
        (tmp_path / "my_transforms.py").write_text(
            "import lightning.pytorch as pl\nfrom xtl.strategies.parallelize import ModelTransform\n\n\n"
            "class Recompute(pl.Callback, ModelTransform):\n"
            "    def __init__(self, every: int = 1):\n        self.every = every\n\n"
            "    def transform_model(self, model):\n        return model\n\n"
            "    def memory_settings(self):\n"
            "        return {'recompute': 'selective', 'recompute_every_n_layers': self.every}\n"
        )
        monkeypatch.syspath_prepend(str(tmp_path))
        fragment = tmp_path / "mine.yaml"
        fragment.write_text(
            "trainer:\n  callbacks+:\n    - class_path: my_transforms.Recompute\n      init_args: {every: 3}\n"
        )
        read = memory.read_recipe([ROOT / "configs/tiny_sft.yaml", fragment])
        assert (read.setup["recompute"], read.setup["recompute_every_n_layers"]) == ("selective", 3)
        assert read.read_from["recompute"] == "selective (trainer.callbacks: Recompute)"
        assert read.read_from["offload"] == "off (no callback in trainer.callbacks sets it)"


STRATEGY = """trainer:
  num_nodes: {nodes}
  strategy:
    class_path: xtl.strategies.FSDPStrategy
    init_args: {args}
"""

RECIPES = {
    "qwen3_8b_pretrain.yaml": "qwen3-8b",
    "llama3.1_8b_sft.yaml": "llama3.1-8b",
    "qwen3_30b_a3b_sft.yaml": "qwen3-30b-a3b",
    "qwen3_8b_long_context.yaml": "qwen3-8b",
}


class TestRecipes:
    @pytest.mark.parametrize(("name", "alias"), RECIPES.items())
    def test_estimate_fits_the_stated_gpu_memory(self, name: str, alias: str, capsys: pytest.CaptureFixture) -> None:
        recipe = ROOT / "configs" / name
        stated = _stated_gpu_memory(recipe)
        text = recipe.read_text()
        assert "callbacks/activation_offload.yaml" in text, "the recipe says how to add offload"
        data = _json(capsys, "--config", str(recipe), alias)
        assert (data["setup"]["recompute"], data["setup"]["offload"]) == ("full", False)  # checkpointing is on
        peak = max(data["peak_micro_batch_1"]["bytes"], data["peak_micro_batch_n"]["bytes"])
        assert peak <= memory.USABLE_FRACTION * stated, f"{name}: {peak / GIB:.1f} GiB"
        assert data["gpu_memory"] == {
            "bytes": stated, "usable_bytes": memory.USABLE_FRACTION * stated, "fits": True, "peak_bytes": peak,
            "source": f"`# gpu-memory:` line of {recipe}",
        }  # fmt: skip
        offload = str(ROOT / "callbacks/activation_offload.yaml")
        with_offload = _json(capsys, "--config", str(recipe), "--config", offload, alias)
        assert with_offload["peak_micro_batch_n"]["bytes"] < peak and with_offload["host_offload_bytes"] > 0

    def test_a_peak_above_the_gpu_memory_fails(self, capsys: pytest.CaptureFixture) -> None:
        recipe = str(ROOT / "configs/qwen3_30b_a3b_sft.yaml")
        data = _json(capsys, "--config", recipe, "qwen3-30b-a3b", "--no-recompute", code=1)
        assert not data["gpu_memory"]["fits"] and data["peak_micro_batch_n"]["bytes"] > 80 * GIB
        assert memory.main(["qwen3-8b", "--seq-len", "8192", "--gpu-memory", "24GiB"]) == 1
        assert "EXCEEDS" in capsys.readouterr().out
        assert memory.main(["qwen3-8b", "--gpu-memory", "80"]) == 2


class TestMemoryCli:
    def test_text_and_json(self, capsys: pytest.CaptureFixture) -> None:
        assert memory.main(["qwen3-8b", "--seq-len", "32768", "--chunk-loss", "1024"]) == 0
        text = capsys.readouterr().out
        assert "micro1_forward_end" in text and "layer_attn" in text and "total 8.1907B" in text
        assert memory.main(["qwen3-30b-a3b", "--ep", "8", "--format", "json"]) == 0
        data = json.loads(capsys.readouterr().out)
        assert data["params"]["total"] > 30e9 and data["peak_micro_batch_n"]["phase"] in data["phases"]

    def test_config_path(self, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
        get_model_config("llama3.1-8b").hf_config.save_pretrained(tmp_path)
        assert memory.main([str(tmp_path), "--format", "json"]) == 0
        assert json.loads(capsys.readouterr().out)["params"]["total"] == pytest.approx(8.03e9, rel=1e-3)

    def test_exit_codes(self, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
        assert memory.main(["--help"]) == 0
        assert "examples:" in capsys.readouterr().out
        assert memory.main(["no-such-model"]) == 2
        assert "qwen3-30b-a3b" in capsys.readouterr().err
        assert memory.main([str(tmp_path)]) == 2
        assert "no config.json" in capsys.readouterr().err
        assert memory.main([]) == 2
        assert memory.main(["qwen3-8b", "--zero", "2"]) == 2
        (tmp_path / "config.json").write_text("{}")
        assert memory.main([str(tmp_path)]) == 2
        assert "lacks a supported model_type" in capsys.readouterr().err
        (tmp_path / "config.json").write_text('{"model_type": "qwen3", "hidden_size": "wide"}')
        assert memory.main([str(tmp_path)]) == 2
        assert "invalid field" in capsys.readouterr().err

    def test_measure_flag(self, capsys: pytest.CaptureFixture) -> None:
        assert memory.main(["--measure", "--seq-len", "128", "--format", "json"]) == 0
        data = json.loads(capsys.readouterr().out)
        assert data["ok"] and data["tolerance"] == 0.03 and data["config"]["seq_len"] == 128
        assert [m["mode"] for m in data["modes"]] == ["none", "full", "selective", "full every 2", "offload",
                                                      "full+offload"]  # fmt: skip
        assert all(m["ok"] and m["tolerance"] == 0.02 for m in data["modes"])


# ---- LoRA / QLoRA ---------------------------------------------------------------------------------------------------

# configs/tiny_sft.yaml's model: h 128, 4 heads x 32, 2 KV heads, I 384, 4 layers, vocab 1600, tied embeddings
TINY_SFT = dict(
    model_type="qwen3", vocab_size=1600, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
)  # fmt: skip
# (in, out) of q, k, v, o and gate, up, down in that model
TINY_SFT_ATTN = [(128, 128), (128, 64), (128, 64), (128, 128)]
TINY_SFT_MLP = [(128, 384), (128, 384), (384, 128)]


def _nf4_bytes(numel: int) -> int:
    """torchao's NF4 storage: 4-bit codes, int8 scalers per 64, an fp32 factor per 16384, fp32 mean, 16 fp32 codes."""
    return numel // 2 + numel // 64 + 4 * numel // 16384 + 4 + 64


def _lora_est(rank: int = 8, **kwargs: object) -> memory.MemoryEstimate:
    setup = dict(nodes=1, gpus_per_node=1, seq_len=512, recompute="none", lora_rank=rank) | kwargs
    return estimate_memory(model_dims(TINY_SFT), TrainSetup(**setup))


class TestLoRA:
    def test_adapter_parameters_and_their_states_by_hand(self) -> None:
        r, layers = 8, 4
        attn = sum(r * (i + o) for i, o in TINY_SFT_ATTN)  # 6,656 per layer
        mlp = sum(r * (i + o) for i, o in TINY_SFT_MLP)  # 12,800 per layer
        est, full = _lora_est(r), _lora_est(0)
        assert est.params["lora_adapters"] == layers * (attn + mlp) == 77_824
        assert "lora_adapters" not in full.params
        parts = est.parts
        # gradients, master copies and two Adam moments exist for the adapters only (dp 1)
        for row, count in (("layer_attn", attn), ("layer_mlp", mlp)):
            assert parts[row]["grads"] == 2 * count and parts[row]["master_grads"] == 4 * count
            assert parts[row]["opt_states"] == 8 * count
        assert parts["all_attn"]["opt_states"] + parts["all_mlp"]["opt_states"] == 8 * 77_824
        assert parts["embed"]["opt_states"] == parts["head"]["opt_states"] == parts["embed"]["grads"] == 0
        # the frozen weights are stored once, in the compute dtype (2 bytes), besides the adapters' fp32 masters
        frozen = est.params["total"]
        stored = sum(parts[row]["master_params"] for row in ("embed", "head", "all_attn", "all_mlp"))
        assert stored == 2 * frozen + 4 * 77_824
        assert est.peak_mbn.bytes < full.peak_mbn.bytes
        assert _lora_est(r, frozen_bytes=4).parts["embed"]["master_params"] == 4 * 1600 * 128

    def test_adapter_activations(self) -> None:
        tokens, r = 512, 8
        outs = sum(o for _, o in TINY_SFT_ATTN + TINY_SFT_MLP)  # 1,344
        for mode, per_token in (("none", 7 * r), ("selective", 7 * r + outs), ("full", 0)):
            lora, full = _lora_est(r, recompute=mode), _lora_est(0, recompute=mode)
            grown = _kept_item(lora)[1] - _kept_item(full)[1]  # the 3 layers before the last
            assert grown == 3 * tokens * per_token * 2, mode

    def test_qlora_stores_the_adapted_weights_in_nf4(self) -> None:
        est, lora = _lora_est(8, qlora=True), _lora_est(8)
        # q, o (128 x 128), gate, up, down (128 x 384) are multiples of 16384 weights; k and v (128 x 64) are not
        nf4 = [128 * 128, 128 * 128, 128 * 384, 128 * 384, 384 * 128]
        assert est.params["nf4_weights"] == 4 * sum(nf4)
        nf4_bytes = 4 * sum(_nf4_bytes(n) for n in nf4)
        saved = 4 * sum(2 * n for n in nf4) - nf4_bytes  # bf16 weights replaced by NF4
        stored = [sum(e.parts[row]["master_params"] for row in ("all_attn", "all_mlp")) for e in (lora, est)]
        assert stored[0] - stored[1] == saved
        assert 4.127 < 8 * nf4_bytes / (4 * sum(nf4)) < 4.15  # 4 + 8/64 + 32/16384 bits, + 68 bytes a tensor
        items = dict(est.phases["micro1_forward_end"].items)
        assert items["NF4 dequantization working set: 20 bytes x the largest NF4 weight"] == 20 * 128 * 384
        everything = _lora_est(8, qlora=True, qlora_all_linear=True, lora_targets=("q_proj",))
        assert everything.params["nf4_weights"] == est.params["nf4_weights"]
        assert _lora_est(8, qlora=True, lora_targets=("q_proj",)).params["nf4_weights"] == 4 * 128 * 128

    def test_nf4_bytes_equal_torchao_storage(self) -> None:
        from torch import nn

        from xtl.module.nf4 import nf4_nbytes, quantize_linear
        from xtl.tools._memory_lora import nf4_bytes

        for fan_in, fan_out in ((128, 128), (384, 128), (256, 512)):
            layer = nn.Linear(fan_in, fan_out, bias=False)
            quantize_linear(layer)
            assert nf4_bytes(fan_in * fan_out) == nf4_nbytes(layer.weight) == _nf4_bytes(fan_in * fan_out)

    @pytest.mark.parametrize(
        ("fan_in", "fan_out", "shard"), [(128, 128, 2), (384, 128, 4), (128, 384, 3), (64, 256, 8)]
    )
    def test_nf4_shard_bytes_equal_the_sharded_tensors(self, fan_in: int, fan_out: int, shard: int) -> None:
        # what each FSDP rank stores (xtl.module.nf4.nf4_rows: the tensors of a 2-rank run in
        # tests/callbacks/test_qlora.py::TestFSDP) and the weight torchao's FSDP extension gathers from them
        from types import SimpleNamespace

        from torchao.quantization import to_nf4

        from xtl.module.nf4 import nf4_nbytes, nf4_rows
        from xtl.tools._memory_lora import nf4_shard_bytes, nf4_shards

        assert nf4_shards(fan_in, fan_out, shard)
        whole = to_nf4(torch.randn(fan_out, fan_in, generator=torch.Generator().manual_seed(0)))
        rows = fan_out // shard
        shards = [nf4_rows(whole, r * rows, rows) for r in range(shard)]
        mesh = SimpleNamespace(get_group=lambda: SimpleNamespace(size=lambda: shard))
        inputs = [part.fsdp_pre_all_gather(mesh) for part in shards]
        outputs = tuple(torch.cat(parts) for parts in zip(*(tensors for tensors, _ in inputs)))
        gathered, _ = shards[0].fsdp_post_all_gather(outputs, inputs[0][1], torch.float32)
        stored = {nf4_nbytes(part) for part in shards}
        assert nf4_shard_bytes(fan_in, fan_out, shard) == (stored.pop(), nf4_nbytes(gathered)) and not stored
        assert nf4_shard_bytes(fan_in, fan_out, 1) == (_nf4_bytes(fan_in * fan_out),) * 2

    def test_qlora_on_several_gpus_shards_the_nf4_weights_adapters_and_states(self) -> None:
        from xtl.tools._memory_lora import nf4_shard_bytes

        one, eight = (_lora_est(8, qlora=True, gpus_per_node=n) for n in (1, 8))
        assert one.params == eight.params
        nf4 = [(128, 128), (128, 128), (128, 384), (128, 384), (384, 128)]  # (in, out) of q, o, gate, up, down
        dims = model_dims(TINY_SFT)
        dense = 2 * (dims.attention_params() + dims.mlp_params(0) - sum(i * o for i, o in nf4))  # k, v, the norms
        adapters = 8 * sum(i + o for i, o in TINY_SFT_ATTN + TINY_SFT_MLP)
        for est, gpus in ((one, 1), (eight, 8)):
            rows = [est.parts[row] for row in ("all_attn", "all_mlp")]
            stored = sum(nf4_shard_bytes(i, o, gpus)[0] for i, o in nf4)  # each GPU's NF4 shards
            # the other 2-byte frozen weights, the adapters' fp32 master copies: all divided by the GPUs
            assert sum(r["master_params"] for r in rows) == 4 * (stored + (dense + 4 * adapters) / gpus)
            assert sum(r["opt_states"] for r in rows) == 4 * 8 * adapters / gpus
            gathered = sum(nf4_shard_bytes(i, o, gpus)[1] for i, o in nf4[2:])  # one layer's MLP, gathered
            assert est.parts["layer_mlp"]["params"] == gathered + 2 * 8 * (3 * 128 + 3 * 384) + 2 * 128  # + norm
        # three GPUs cannot split the 128 rows of q, o and down into NF4 shards: those stay 2-byte weights
        three = _lora_est(8, qlora=True, gpus_per_node=3)
        assert three.params["nf4_weights"] == 4 * 2 * 128 * 384

    def test_qlora_refuses_what_xtl_does_not_shard_it_with(self, capsys: pytest.CaptureFixture) -> None:
        for option in (["--tp", "2"], ["--zero", "1"]):
            assert memory.main(["qwen3-8b", "--gpus-per-node", "8", "--lora-rank", "8", "--qlora", *option]) == 2
            assert "xtl's QLoRA shards its NF4 weights with FSDP (--zero 3)" in capsys.readouterr().err

    @pytest.mark.parametrize("variant", sorted(TINY_HF_CONFIGS))
    def test_linear_layers_and_adapters_equal_the_built_model(self, variant: str) -> None:
        from torch import nn

        from xtl.callbacks.lora import DEFAULT_TARGETS, LoRA
        from xtl.tools import _memory_lora

        assert _memory_lora.DEFAULT_TARGETS == DEFAULT_TARGETS
        fields = {**_TINY, **TINY_HF_CONFIGS[variant]}
        dims = model_dims(fields)
        cls = MODEL_TYPES[fields["model_type"]]
        with torch.device("meta"):
            model = LoRA(rank=4).transform_model(cls.from_hf_config(cls.hf_config_class.from_dict(fields)).build())
        for i, layer in enumerate(model.layers):
            built = {
                name: (m.in_features, m.out_features)
                for name, m in layer.named_modules()
                if isinstance(m, nn.Linear) and not name.endswith(("lora_A", "lora_B"))
            }
            expected = {
                name: (fan_in, fan_out) for name, (fan_in, fan_out, _) in _memory_lora.layer_linears(dims, i).items()
            }
            assert built == expected, f"layer {i}"
        adapters = sum(t.numel() for t in model.adapter_tensors().values())
        est = estimate_memory(dims, TrainSetup(nodes=1, gpus_per_node=1, seq_len=64, lora_rank=4))
        assert est.params["lora_adapters"] == adapters

    def test_lora_modes_of_measure_agree_with_the_callback(self) -> None:
        from xtl.tools._memory_measure import LORA_MODES, compare_modes

        results = {m.mode: m for m in compare_modes(memory._layers_kept_bytes, 128, 0, LORA_MODES)}
        assert list(results) == list(LORA_MODES)
        for m in results.values():
            assert m.ok and m.gpu_measured == m.gpu_estimate and m.max_grad_diff == 0.0, m
        # 7 adapted layers keep the fp32 lora_A output, rank 8, per token; full recompute keeps the input only
        none = compare_modes(memory._layers_kept_bytes, 128, 0, {"none": {"recompute": "none"}})[0]
        assert results["lora"].gpu_measured - none.gpu_measured == 128 * 7 * 8 * 4
        assert results["lora full"].gpu_measured == 128 * 64 * 4

    def test_cli_options(self, capsys: pytest.CaptureFixture) -> None:
        base = ["qwen3-8b", "--gpus-per-node", "1", "--seq-len", "4096"]
        full, lora = _json(capsys, *base), _json(capsys, *base, "--lora-rank", "16")
        qlora = _json(capsys, *base, "--lora-rank", "16", "--qlora")
        assert (lora["setup"]["lora_rank"], lora["setup"]["qlora"], qlora["setup"]["qlora"]) == (16, False, True)
        peaks = [d["peak_micro_batch_n"]["bytes"] / GIB for d in (full, lora, qlora)]
        assert peaks[0] > 100 > peaks[1] > 20 > peaks[2] > 10, peaks  # 127.6, 21.4, 12.5 GiB
        # 16 x (in + out) over q/k/v/o/gate/up/down of 36 layers
        per_layer = 16 * (2 * (H + QD) + 2 * (H + KD) + 3 * (H + I8B))
        assert lora["params"]["lora_adapters"] == 36 * per_layer
        some = _json(capsys, *base, "--lora-rank", "16", "--lora-targets", "q_proj,v_proj", "--frozen-bytes", "4")
        assert some["params"]["lora_adapters"] == 36 * 16 * (2 * H + QD + KD)
        assert some["setup"]["lora_targets"] == ["q_proj", "v_proj"] and some["setup"]["frozen_bytes"] == 4
        assert memory.main([*base, "--qlora"]) == 2
        assert "give a LoRA rank" in capsys.readouterr().err
        assert memory.main([*base, "--lora-rank", "8", "--lora-targets", "wq"]) == 2
        assert "match no linear layer" in capsys.readouterr().err
        ep = _json(capsys, "deepseek-v3", "--nodes", "4", "--ep", "32", "--lora-rank", "8", "--qlora")
        assert ep["setup"]["gpus"] == 32 and ep["params"]["nf4_weights"] > 0  # FSDP QLoRA with experts split
        assert memory.main(["qwen3-8b", "--seq-len", "4096", "--lora-rank", "8", "--qlora"]) == 0
        text = capsys.readouterr().out
        assert "gpus 8," in text, "--qlora alone: the default layout, sharded"
        assert "lora: rank 8" in text and "NF4 for the adapted layers" in text

    def test_recipe_with_the_lora_and_qlora_fragments(self, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
        recipe, lora, qlora = (
            str(ROOT / f) for f in ("configs/tiny_sft.yaml", "callbacks/lora.yaml", "callbacks/qlora.yaml")
        )
        s = memory.read_recipe([recipe, lora]).setup
        assert (s["lora_rank"], s["qlora"], s["frozen_bytes"]) == (8, False, 4)  # param_dtype float32
        assert s["lora_targets"] == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
        read = memory.read_recipe([recipe, lora, qlora])
        assert read.setup["qlora"] and "QLoRA" in read.read_from["qlora"]
        data = _json(capsys, "--config", recipe, "--config", lora, "--config", qlora)
        options = _json(
            capsys, "--config", recipe, "--lora-rank", "8", "--qlora", "--frozen-bytes", "4",
        )  # fmt: skip
        assert data["phases"] == options["phases"] and data["params"]["lora_adapters"] == 77_824
        # a LoRA callback of its own settings, and an FSDP recipe (fp32 parameters, trained or frozen)
        inline = tmp_path / "lora_inline.yaml"
        inline.write_text(
            "trainer:\n  callbacks+:\n    - class_path: xtl.callbacks.LoRA\n"
            "      init_args: {rank: 4, target_modules: [q_proj]}\n"
        )
        s = memory.read_recipe([recipe, inline, qlora]).setup
        assert (s["lora_rank"], s["lora_targets"], s["qlora"]) == (4, ("q_proj",), True)
        fsdp = memory.read_recipe([str(ROOT / "configs/qwen3_8b_pretrain.yaml"), lora])
        assert fsdp.setup["frozen_bytes"] == 4 and "FSDPStrategy" in fsdp.read_from["frozen weights"]
        # a run applies one LoRA; QLoRA needs one
        assert memory.main(["--config", recipe, "--config", lora, "--config", str(inline)]) == 2
        assert "two callbacks that set lora_rank (LoRA and LoRA)" in capsys.readouterr().err
        assert memory.main(["--config", recipe, "--config", qlora]) == 2
        assert "needs a LoRA callback" in capsys.readouterr().err
