"""Helpers for the tool tests: tiny safetensors checkpoints (names and shapes of real model families)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

ShardSpec = dict[str, dict[str, torch.Tensor]]


def write_checkpoint(directory: Path, shards: ShardSpec, config: dict | None = None, index: bool = True) -> Path:
    """Write ``shards`` (file name -> tensors) plus an index and ``config.json`` into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for file_name, tensors in shards.items():
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / file_name))
        weight_map.update(dict.fromkeys(tensors, file_name))
    if index:
        total = sum(t.numel() * t.element_size() for ts in shards.values() for t in ts.values())
        data = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / "model.safetensors.index.json").write_text(json.dumps(data))
    (directory / "config.json").write_text(json.dumps(config or {"model_type": "qwen3_moe", "hidden_size": 64}))
    return directory


def tiny_moe_tensors(seed: int = 0, layers: int = 2) -> dict[str, torch.Tensor]:
    """Names and shapes of a tiny Qwen3-MoE-like model (plus fused 3D experts and an MTP block), bf16."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)

    t = {"model.embed_tokens.weight": rand(300, 160), "lm_head.weight": rand(300, 160), "model.norm.weight": rand(160)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t |= {
            p + "input_layernorm.weight": rand(160),
            p + "post_attention_layernorm.weight": rand(160),
            p + "self_attn.q_proj.weight": rand(256, 160),
            p + "self_attn.k_proj.weight": rand(130, 160),
            p + "self_attn.v_proj.weight": rand(130, 160),
            p + "self_attn.o_proj.weight": rand(160, 256),
            p + "self_attn.q_norm.weight": rand(64),
            p + "self_attn.k_norm.weight": rand(64),
            p + "self_attn.q_proj.bias": rand(256),
            p + "mlp.gate.weight": rand(4, 160),
            p + "mlp.experts.0.gate_proj.weight": rand(200, 160),
            p + "mlp.experts.0.up_proj.weight": rand(200, 160),
            p + "mlp.experts.0.down_proj.weight": rand(160, 200),
            p + "mlp.shared_expert.gate_proj.weight": rand(200, 160),
            p + "mlp.shared_expert_gate.weight": rand(1, 160),
            p + "mlp.experts.gate_up_proj": rand(3, 160, 400),
            p + "mlp.experts.down_proj": rand(3, 200, 160),
        }
    t |= {
        "mtp.layers.0.self_attn.q_proj.weight": rand(256, 160),
        "mtp.fc.weight": rand(160, 320),
        "model.visual.blocks.0.attn.qkv.weight": rand(192, 64),
    }
    return t
