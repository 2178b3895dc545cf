"""Fixtures for training tests: a tiny model spec, the embedded tiny data, and a CPU trainer."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest

from xtl.data import XTLDataModule

TINY_MODEL = {
    "model_type": "qwen3",
    "vocab_size": 1600,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
    "attn_impl": "sdpa",
}


@pytest.fixture
def make_datamodule(data_cache: Path):
    """Factory of datamodules over the embedded tiny SFT set (128-token packs, 2 micro-batches per step)."""

    def make(**overrides) -> XTLDataModule:
        kwargs = dict(
            sources=[{"path": "tiny:sft_train.jsonl", "kind": "chat"}],
            tokenizer="tiny:",
            template="qwen3",
            pack_max_length=128,
            micro_batches_per_step=2,
            seed=0,
            cache_dir=str(data_cache),
            progress=False,
        )
        kwargs.update(overrides)
        return XTLDataModule(**kwargs)

    return make


@pytest.fixture
def make_trainer(tmp_path: Path):
    """Factory of single-process CPU trainers writing under ``tmp_path``."""

    def make(max_steps: int, callbacks: list | None = None, **kwargs) -> pl.Trainer:
        kwargs.setdefault("accelerator", "cpu")
        return pl.Trainer(
            devices=1,
            max_steps=max_steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            default_root_dir=tmp_path,
            callbacks=callbacks or [],
            **kwargs,
        )

    return make
