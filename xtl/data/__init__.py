"""The data seam: sources -> tokenize (cached) -> pack -> sample -> collate into step batches.

``XTLDataModule`` (a ``LightningDataModule``) is imported lazily so that the rest of ``xtl.data`` never imports
Lightning.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from xtl.data.cache import DEFAULT_CACHE_DIR, TokenizedCache, build_cache, cache_key, load_cache
from xtl.data.collate import MicroBatch, StepCollator, collate_pack
from xtl.data.consumer import DataConsumer
from xtl.data.dataset import MixedDataset
from xtl.data.item import IGNORE_INDEX, DataError, DataFileNotFoundError, DataItem
from xtl.data.loader import ResumableDataLoader
from xtl.data.packing import (
    Pack,
    PackedDataset,
    PackPlan,
    best_fit_pack,
    hard_pack,
    load_plan,
    plan_fingerprint,
    preset_pack,
    save_plan,
)
from xtl.data.preference import PreferenceTokenizeFn, check_pair_plan, parse_preference_row
from xtl.data.sampler import EvalStepSampler, RankSteps, StepSampler, load_preset_order
from xtl.data.sources import FileHashMemo, HFSource, JsonlSource, Source, SourceSpec, hash_file, open_source
from xtl.data.templates import TEMPLATES, ChatTemplate, Rendered, get_template
from xtl.data.tiny import build_bpe_tokenizer, tiny_assets_dir
from xtl.data.tokenize import ChatTokenizeFn, PretrainTokenizeFn, TokenizeFn, tokenizer_fingerprint
from xtl.data.tokenize_fn import build_tokenize_fn
from xtl.data.unpaired import UnpairedPreferenceTokenizeFn, parse_unpaired_row

if TYPE_CHECKING:
    from xtl.data.datamodule import XTLDataModule

__all__ = [
    "DEFAULT_CACHE_DIR",
    "IGNORE_INDEX",
    "TEMPLATES",
    "ChatTemplate",
    "ChatTokenizeFn",
    "DataConsumer",
    "DataError",
    "DataFileNotFoundError",
    "DataItem",
    "EvalStepSampler",
    "FileHashMemo",
    "HFSource",
    "JsonlSource",
    "MicroBatch",
    "MixedDataset",
    "Pack",
    "PackPlan",
    "PackedDataset",
    "PreferenceTokenizeFn",
    "PretrainTokenizeFn",
    "RankSteps",
    "Rendered",
    "ResumableDataLoader",
    "Source",
    "SourceSpec",
    "StepCollator",
    "StepSampler",
    "TokenizeFn",
    "TokenizedCache",
    "UnpairedPreferenceTokenizeFn",
    "XTLDataModule",
    "best_fit_pack",
    "build_bpe_tokenizer",
    "build_cache",
    "build_tokenize_fn",
    "cache_key",
    "check_pair_plan",
    "collate_pack",
    "get_template",
    "hard_pack",
    "hash_file",
    "load_cache",
    "load_plan",
    "load_preset_order",
    "open_source",
    "parse_preference_row",
    "parse_unpaired_row",
    "plan_fingerprint",
    "preset_pack",
    "save_plan",
    "tiny_assets_dir",
    "tokenizer_fingerprint",
]


def __getattr__(name: str) -> Any:
    if name == "XTLDataModule":
        from xtl.data.datamodule import XTLDataModule

        return XTLDataModule
    raise AttributeError(f"module 'xtl.data' has no attribute {name!r}")
