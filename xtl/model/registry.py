"""Model registry: ``model_type`` -> config family, alias -> size-specific config."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

from xtl.model.config import TransformerConfig, read_hf_config_dict


class _Registry(Mapping):
    """A name -> config class table that imports the built-in families on first read (not at import time)."""

    def __init__(self) -> None:
        self._entries: dict[str, type[TransformerConfig]] = {}

    def __getitem__(self, key: str) -> type[TransformerConfig]:
        _ensure_builtin()
        return self._entries[key]

    def __iter__(self) -> Iterator[str]:
        _ensure_builtin()
        return iter(self._entries)

    def __len__(self) -> int:
        _ensure_builtin()
        return len(self._entries)


MODEL_TYPES: Mapping[str, type[TransformerConfig]] = _Registry()
ALIASES: Mapping[str, type[TransformerConfig]] = _Registry()


def register_model_type(config_cls: type[TransformerConfig]) -> type[TransformerConfig]:
    """Register a family config under its transformers ``model_type`` (usable as a class decorator)."""
    MODEL_TYPES._entries[config_cls.hf_config_class.model_type] = config_cls
    return config_cls


def register_alias(alias: str, config_cls: type[TransformerConfig]) -> None:
    """Register a size-specific config under ``alias`` (case, ``-`` and ``_`` are ignored on lookup)."""
    ALIASES._entries[normalize_alias(alias)] = config_cls


def normalize_alias(alias: str) -> str:
    """Lower-case and drop ``-`` and ``_``: ``Qwen3-8B``, ``qwen3_8b`` and ``qwen38b`` are the same key."""
    return alias.lower().replace("-", "").replace("_", "")


def alias_names() -> dict[str, type[TransformerConfig]]:
    """Display name -> config class for every registered alias (display names as registered)."""
    _ensure_builtin()
    return dict(_DISPLAY_NAMES)


def get_model_config(alias: str) -> TransformerConfig:
    """The size-specific config registered under ``alias``.

    Raises:
        KeyError: Unknown alias (the message lists the known ones).
    """
    _ensure_builtin()
    key = normalize_alias(alias)
    if key not in ALIASES:
        known = ", ".join(sorted(_DISPLAY_NAMES))
        raise KeyError(f"unknown model alias {alias!r}; known aliases: {known}")
    return ALIASES[key]()


def get_model_config_from_hf(hf_path: str | Path) -> TransformerConfig:
    """Read an HF model directory's config, dispatching on its ``model_type`` only.

    Raises:
        ValueError: The ``model_type`` is not supported (the message lists the supported ones).
    """
    model_type = read_hf_config_dict(hf_path).get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"{Path(hf_path) / 'config.json'}: model_type {model_type!r} is not supported by xtl; supported: "
            f"{', '.join(sorted(MODEL_TYPES))}"
        )
    return MODEL_TYPES[model_type].from_hf(hf_path)


_DISPLAY_NAMES: dict[str, type[TransformerConfig]] = {}
_BUILTIN_LOADED = False


def _ensure_builtin() -> None:
    """Register the built-in families once, on first use (importing them loads transformers' modeling code)."""
    global _BUILTIN_LOADED
    if not _BUILTIN_LOADED:
        _BUILTIN_LOADED = True
        _register_builtin()


def _register_builtin() -> None:
    import xtl.model.dense as dense

    for cls in (dense.LlamaDenseConfig, dense.Qwen2DenseConfig, dense.Qwen3DenseConfig):
        register_model_type(cls)
    for name, cls in {
        "qwen3-0.6b": dense.Qwen3Dense0P6BConfig,
        "qwen3-1.7b": dense.Qwen3Dense1P7BConfig,
        "qwen3-4b": dense.Qwen3Dense4BConfig,
        "qwen3-8b": dense.Qwen3Dense8BConfig,
        "qwen3-14b": dense.Qwen3Dense14BConfig,
        "qwen3-32b": dense.Qwen3Dense32BConfig,
        "llama3.2-1b": dense.Llama32_1BConfig,
        "llama3.2-3b": dense.Llama32_3BConfig,
        "llama3.1-8b": dense.Llama31_8BConfig,
        "llama3.1-70b": dense.Llama31_70BConfig,
        "qwen2.5-0.5b": dense.Qwen25_0P5BConfig,
        "qwen2.5-7b": dense.Qwen25_7BConfig,
    }.items():
        register_display_alias(name, cls)
    _register_moe()
    _register_compose()


def _register_moe() -> None:
    import xtl.model.moe as moe

    for cls in (moe.Qwen3MoEConfig, moe.DeepSeekV3Config, moe.GptOssMoEConfig):
        register_model_type(cls)
    for name, cls in {
        "qwen3-30b-a3b": moe.Qwen3MoE30BA3Config,
        "qwen3-235b-a22b": moe.Qwen3MoE235BA22Config,
        "deepseek-v3": moe.DeepSeekV3_671BConfig,
        "gpt-oss-20b": moe.GptOss20BConfig,
        "gpt-oss-120b": moe.GptOss120BConfig,
    }.items():
        register_display_alias(name, cls)


def _register_compose() -> None:
    import xtl.model.compose as compose

    for cls in (compose.Qwen3VLConfig, compose.Qwen3VLMoeConfig):
        register_model_type(cls)


def register_display_alias(name: str, config_cls: type[TransformerConfig]) -> None:
    """Register ``name`` as an alias and as the display name listed in docs and error messages."""
    register_alias(name, config_cls)
    _DISPLAY_NAMES[name] = config_cls
