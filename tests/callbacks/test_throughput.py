"""Tests for the ``Throughput`` callback: FLOPs per token from the shared model dimensions, and what it logs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from xtl.callbacks.throughput import Throughput
from xtl.model import get_model_config
from xtl.model.compose import Qwen3VLConfig, Qwen3VLVisionConfig
from xtl.model.dense import LlamaDenseConfig, Qwen3DenseConfig
from xtl.model.dims import VisionDims
from xtl.model.moe import DeepSeekV3Config, Qwen3MoEConfig
from xtl.module.vision import VisionTower
from xtl.tools.memory import estimate_memory
from xtl.train import step as step_module

# Tiny Llama: h 16, 4 heads of 4 dims, 2 key/value heads, MLP 32, 2 layers, vocab 100.
TINY = dict(
    vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2,
)  # fmt: skip


class TestFlopsPerToken:
    @pytest.mark.parametrize(
        ("alias", "qk_dim", "v_dim"), [("qwen3-8b", 128, 128), ("qwen3-30b-a3b", 128, 128), ("deepseek-v3", 192, 128)]
    )
    def test_equals_the_memory_tools_parameter_count(self, alias: str, qk_dim: int, v_dim: int) -> None:
        config, seq = get_model_config(alias), 4096
        params = estimate_memory(alias).params  # activated = top-k routed experts only; MLA q/k dims nope + rope
        tied_head = config.vocab_size * config.hidden_size if config.tie_word_embeddings else 0
        n = params["activated"] - params["embedding"] + tied_head
        attn = 6 * config.num_hidden_layers * config.num_attention_heads * (qk_dim + v_dim) * seq / 2
        assert Throughput().flops_per_token(config, seq) == pytest.approx(6 * n + attn, rel=1e-12)
        if params["experts"]:
            assert n < 0.2 * (params["total"] - params["embedding"])  # far below the total for MoE

    def test_tiny_dense_by_hand(self) -> None:
        # per layer: input norm 16 + q 16*16 + k 16*8 + v 16*8 + o 16*16 = 784; MLP: norm 16 + 3*16*32 = 1552
        # N = 2 * (784 + 1552) + final norm 16 + head 100*16 = 6288
        # attention at L = 10: 6 * 4 heads * (4 + 4) dims * L/2 keys * 2 layers = 1920
        assert Throughput().flops_per_token(LlamaDenseConfig(**TINY), 10) == 6 * 6288 + 1920
        tied = LlamaDenseConfig(**TINY, tie_word_embeddings=True)
        assert Throughput().flops_per_token(tied, 10) == 6 * 6288 + 1920, "a tied head costs the same matmul"

    def test_tiny_moe_by_hand(self) -> None:
        moe = Qwen3MoEConfig(**TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, head_dim=4)
        # attention 784 + q/k norms 2*4 = 792; MoE: norm 16 + router 4*16 + 2 of 4 experts * 3*16*8 = 848
        # N = 2 * (792 + 848) + 16 + 1600 = 4896
        assert Throughput().flops_per_token(moe, 10) == 6 * 4896 + 1920

    def test_tiny_mla_attention_by_hand(self) -> None:
        fields = dict(q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=6, qk_rope_head_dim=2, v_head_dim=5)
        mla = DeepSeekV3Config(**TINY, **fields, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1)
        flops = Throughput().flops_per_token
        # only the attention term grows with L: 6 * 4 heads * (6 + 2 + 5) * (L/2) * 2 layers per token
        assert flops(mla, 20) - flops(mla, 10) == pytest.approx(6 * 4 * 13 * 5 * 2)

    def test_sliding_window_layers_attend_to_fewer_keys(self) -> None:
        full = Qwen3DenseConfig(**TINY, head_dim=4)
        windowed = Qwen3DenseConfig(**TINY, head_dim=4, use_sliding_window=True, sliding_window=4, max_window_layers=1)
        # layer 1 slides with w = 4 at L = 10: w - w^2 / 2L = 3.2 keys per query instead of L/2 = 5
        diff = Throughput().flops_per_token(full, 10) - Throughput().flops_per_token(windowed, 10)
        assert diff == pytest.approx(6 * 4 * 8 * (5 - 3.2))


class TestLogging:
    def test_logs_tflops_and_mfu_over_the_window_of_logged_steps(self, monkeypatch: pytest.MonkeyPatch) -> None:
        clock = iter([0.0, 100.0, 104.0])  # construction, train start, the logged step
        monkeypatch.setattr(step_module, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
        logged = []
        logger = SimpleNamespace(log_metrics=lambda metrics, step: logged.append((metrics, step)))
        connector = SimpleNamespace(should_update_logs=False)
        trainer = SimpleNamespace(loggers=[logger], global_step=7, _logger_connector=connector)
        config = LlamaDenseConfig(**TINY)
        module = SimpleNamespace(model_config=config, device=torch.device("cpu"))
        batch = [
            SimpleNamespace(num_real_tokens=30, seq_ctx=SimpleNamespace(pack_len=10, extras={})),
            SimpleNamespace(num_real_tokens=8, seq_ctx=SimpleNamespace(pack_len=8, extras={})),
        ]
        callback = Throughput(peak_tflops=1e-6)
        callback.on_train_start(trainer, module)  # clock 100
        callback.on_train_batch_end(trainer, module, None, batch, 0)
        assert logged == [], "a step the loggers do not write logs nothing (and waits for nothing)"
        connector.should_update_logs = True
        callback.on_train_batch_end(trainer, module, None, batch, 1)  # clock 104: two steps in 4 s
        ((metrics, step),) = logged
        tflops = 2 * 38 * (6 * 6288 + 1920) / 4.0 / 1e12  # longest sequence of each step: 10 tokens
        assert step == 7
        assert metrics["train/tflops_per_device"] == pytest.approx(tflops)
        assert metrics["train/mfu"] == pytest.approx(tflops / 1e-6)


class TestVisionFlops:
    VISION = dict(
        depth=2, hidden_size=8, intermediate_size=16, num_heads=2, in_channels=3, patch_size=2, temporal_patch_size=2,
        spatial_merge_size=2, out_hidden_size=12, num_position_embeddings=16, deepstack_visual_indexes=[0],
    )  # fmt: skip

    def test_an_image_costs_six_flops_per_weight_and_row_plus_frame_attention(self) -> None:
        tower = VisionTower(Qwen3VLVisionConfig(**self.VISION))
        blocks = ("patch_embed.proj.weight", "attn.qkv.weight", "attn.proj.weight", "linear_fc1.weight", "fc2.weight")
        per_patch = sum(p.numel() for n, p in tower.named_parameters() if n.endswith(blocks) and "merger" not in n)
        per_token = sum(
            p.numel() for n, p in tower.named_parameters() if "merger" in n and n.endswith("weight") and p.dim() == 2
        )
        assert (per_patch, per_token) == (24 * 8 + 2 * (4 * 64 + 2 * 8 * 16), 2 * (32 * 32 + 32 * 12))
        # one 1 x 4 x 4 image: 16 patches, 4 merged tokens, each patch attends to the 16 of its frame in 2 blocks
        expected = 6 * (16 * per_patch + 4 * per_token) + 12 * 2 * 8 * 16 * 16
        assert VisionDims.from_config(Qwen3VLVisionConfig(**self.VISION)).flops_per_image(1, 4, 4) == expected

    def test_the_callback_adds_the_images_of_the_logged_window(self, monkeypatch: pytest.MonkeyPatch) -> None:
        clock = iter([0.0, 100.0, 102.0])
        monkeypatch.setattr(step_module, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
        logged = []
        logger = SimpleNamespace(log_metrics=lambda metrics, step: logged.append(metrics))
        trainer = SimpleNamespace(
            loggers=[logger], global_step=1, _logger_connector=SimpleNamespace(should_update_logs=True)
        )
        rope = {"rope_type": "default", "rope_theta": 1e4, "params": {"mrope_section": [2, 1, 1]}}
        config = Qwen3VLConfig(text_config={**TINY, "head_dim": 8, "rope": rope}, vision_config=self.VISION)
        module = SimpleNamespace(model_config=config, device=torch.device("cpu"))
        grid = torch.tensor([[1, 4, 4], [1, 2, 4]])
        batch = [
            SimpleNamespace(num_real_tokens=10, seq_ctx=SimpleNamespace(pack_len=10, extras={"image_grid_thw": grid}))
        ]
        callback = Throughput()
        callback.on_train_start(trainer, module)
        callback.on_train_batch_end(trainer, module, None, batch, 0)
        vision = VisionDims.from_config(config)
        text = 10 * callback.flops_per_token(config, 10)
        images = vision.flops_per_image(1, 4, 4) + vision.flops_per_image(1, 2, 4)
        assert logged[0]["train/tflops_per_device"] == pytest.approx((text + images) / 2.0 / 1e12)
        assert text == 10 * callback.flops_per_token(config.text_config, 10)
