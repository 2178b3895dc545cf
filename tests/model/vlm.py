"""Tiny Qwen3-VL / Qwen3-VL-MoE checkpoints and image+text inputs shared by the VLM tests (no hub access)."""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from transformers import (
    PreTrainedModel,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMoeConfig,
    Qwen3VLMoeForConditionalGeneration,
)

from xtl.model import get_model_config_from_hf

IMAGE, VIDEO, VISION_START, VISION_END = 150, 151, 152, 153
_TEXT = dict(
    vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2], "mrope_interleaved": True,
    },
)  # fmt: skip
# patch 14, merge 2: an (h, w)-patch image is h*w patches and h*w/4 LM tokens; a 4x4 learned position grid.
_VISION = dict(
    depth=2, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=14, spatial_merge_size=2,
    temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=16, deepstack_visual_indexes=[0, 1],
)  # fmt: skip
_TOKENS = dict(
    image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END
)

# name -> (HF config class, HF model class, text overrides)
VLM_VARIANTS: dict[str, tuple[type, type, dict]] = {
    "qwen3_vl": (Qwen3VLConfig, Qwen3VLForConditionalGeneration, {}),
    "qwen3_vl_moe": (
        Qwen3VLMoeConfig,
        Qwen3VLMoeForConditionalGeneration,
        dict(moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[2]),
    ),
}
VARIANTS = sorted(VLM_VARIANTS)
PATCH_DIM = 3 * 2 * 14 * 14


def build_tiny_vlm(variant: str, seed: int = 0) -> PreTrainedModel:
    """A random fp32 transformers VLM with non-trivial norms, biases and sharp routers."""
    config_cls, model_cls, text = VLM_VARIANTS[variant]
    config = config_cls(
        text_config={**_TEXT, **text}, vision_config=_VISION, **_TOKENS,
        attn_implementation="eager", experts_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(0.5 * torch.randn_like(p))
            elif name.endswith(("experts.gate_up_proj", "experts.down_proj", "pos_embed.weight")):
                p.copy_(0.05 * torch.randn_like(p))
    return model.eval()


@functools.cache
def save_tiny_vlm(variant: str, dtype: torch.dtype, root: Path) -> Path:
    """Save :func:`build_tiny_vlm` under ``root`` once per (variant, dtype); return the directory."""
    path = root / f"{variant}_{str(dtype).split('.')[-1]}"
    if dtype == torch.float32:
        build_tiny_vlm(variant).save_pretrained(path)
    else:
        model_cls = VLM_VARIANTS[variant][1]
        model_cls.from_pretrained(save_tiny_vlm(variant, torch.float32, root), dtype=dtype).save_pretrained(path)
    return path


def load_pair(path: Path, dtype: torch.dtype):
    """The transformers model (eager attention and experts) and the xtl model of the checkpoint at ``path``."""
    model_cls = VLM_VARIANTS[path.name.rsplit("_", 1)[0]][1]
    hf = model_cls.from_pretrained(path, attn_implementation="eager", experts_implementation="eager", dtype=dtype)
    with torch.device("meta"):
        model = get_model_config_from_hf(path).build()
    model.from_hf(path)
    return hf.eval(), model.to(dtype).eval()


def image_text_batch(dtype: torch.dtype = torch.float32, seed: int = 1) -> dict[str, torch.Tensor]:
    """One row: text, a 4x4-patch image (4 tokens), text, a 4x6-patch image (6 tokens), text; labels on all."""
    g = torch.Generator().manual_seed(seed)
    grid = torch.tensor([[1, 4, 4], [1, 4, 6]])
    pixel_values = torch.randn(16 + 24, PATCH_DIM, generator=g).to(dtype)

    def image(n: int) -> list[int]:
        return [VISION_START] + [IMAGE] * n + [VISION_END]

    ids = [5, 6, *image(4), 7, 8, 9, *image(6), 10, 11, 12]
    input_ids = torch.tensor([ids])
    labels = torch.randint(0, 150, input_ids.shape, generator=g)
    return dict(
        input_ids=input_ids,
        pixel_values=pixel_values,
        image_grid_thw=grid,
        mm_token_type_ids=(input_ids == IMAGE).int(),
        labels=labels,
    )
