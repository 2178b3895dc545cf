"""Shared fixtures: tiny random HF checkpoints built from transformers config classes (no hub access)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

if os.environ.get("PYTEST_XDIST_WORKER"):  # two test workers share the 2 cores: one thread each (and their children)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

TINY = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)

# name -> (HF config class, HF model class, overrides)
TINY_VARIANTS: dict[str, tuple[type, type, dict]] = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "llama_llama3_rope": (
        LlamaConfig,
        LlamaForCausalLM,
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "llama_linear_rope": (
        LlamaConfig,
        LlamaForCausalLM,
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}},
    ),
    "llama_dynamic_rope": (
        LlamaConfig,
        LlamaForCausalLM,
        {
            "max_position_embeddings": 16,
            "rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
        },
    ),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen2_tied": (Qwen2Config, Qwen2ForCausalLM, {"tie_word_embeddings": True}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 24}),
    "qwen3_tied": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16, "tie_word_embeddings": True}),
    "qwen3_yarn": (
        Qwen3Config,
        Qwen3ForCausalLM,
        {
            "head_dim": 16,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 1000000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "qwen3_sliding": (
        Qwen3Config,
        Qwen3ForCausalLM,
        {"head_dim": 16, "use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1},
    ),
}


def build_tiny_hf(variant: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> PreTrainedModel:
    """A randomly initialized transformers model of ``variant`` with eager attention."""
    config_cls, model_cls, overrides = TINY_VARIANTS[variant]
    config = config_cls(**{**TINY, **overrides}, attn_implementation="eager")
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype).eval()
    with torch.no_grad():  # make norms non-trivial so a wrong norm wiring cannot hide
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: ``tiny_hf_dir(variant, dtype=torch.float32) -> Path`` of a saved tiny HF checkpoint (cached)."""
    cache: dict[tuple[str, torch.dtype], Path] = {}

    def make(variant: str, dtype: torch.dtype = torch.float32) -> Path:
        key = (variant, dtype)
        if key not in cache:
            path = tmp_path_factory.mktemp(f"hf_{variant}_{str(dtype).split('.')[-1]}")
            build_tiny_hf(variant, dtype).save_pretrained(path)
            cache[key] = path
        return cache[key]

    return make


@pytest.fixture
def hf_impl(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the test with ``XTL_HF_IMPL=1``."""
    monkeypatch.setenv("XTL_HF_IMPL", "1")


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tokenization cache shared by the training and CLI tests."""
    return tmp_path_factory.mktemp("xtl_cache")


# what a launcher (or Lightning inside an in-process run) leaves in os.environ for the processes it starts
LAUNCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK")


@pytest.fixture(autouse=True)
def _no_process_group_left() -> Iterator[None]:
    """Destroy a default process group a test leaves behind (an in-process fit on a sharded strategy keeps its
    group for the next trainer): a later test that starts its own group would find one (the test workers run tests
    in varying orders)."""
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _fresh_launch_environment() -> Iterator[None]:
    """Restore the launch variables after each test: an in-process run leaves ``MASTER_PORT`` set, and a later
    subprocess run would inherit a port that may still be taken."""
    saved = {name: os.environ.get(name) for name in LAUNCH_ENV}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
