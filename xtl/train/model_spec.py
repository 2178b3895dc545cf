"""Turn the ``model:`` value of a recipe into a model config (and the HF directory to load weights from)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from xtl.errors import ConfigError, did_you_mean
from xtl.model import MODEL_TYPES, TransformerConfig, get_model_config, get_model_config_from_hf
from xtl.utils import resolve_pretrained

# the HF export the tiny recipes (DPO, KTO, GRPO, ...) start from, and the command that writes it (README)
SFT_EXPORT = "runs/tiny_sft_export/hf/final"
SFT_EXPORT_COMMAND = (
    "xtl fit --config configs/tiny_sft.yaml --config callbacks/hf_export.yaml --trainer.default_root_dir "
    "runs/tiny_sft_export"
)


def resolve_model_config(
    model: str | dict[str, Any], overrides: dict[str, Any] | None = None
) -> tuple[TransformerConfig, Path | None]:
    """Resolve a model spec.

    Args:
        model: An HF model directory (config and weights), ``env:VAR`` naming one, a Hugging Face hub id
            (``Qwen/Qwen3-0.6B``: the local HF cache or a download), a registered alias
            (``qwen3-8b``: its config, random init), or a dict ``{"model_type": ..., <config fields>}``.
        overrides: Config fields to replace (e.g. ``{"attn_impl": "sdpa"}``).

    Returns:
        ``(config, hf_dir)`` where ``hf_dir`` is the directory to load weights from, or ``None``.

    Raises:
        ConfigError: Unknown model type, unknown config field, or a path/alias that resolves to nothing.
    """
    hf_dir: Path | None = None
    if isinstance(model, dict):
        fields = dict(model)
        model_type = fields.pop("model_type", None)
        if model_type not in MODEL_TYPES:
            hint = did_you_mean(str(model_type), MODEL_TYPES)
            raise ConfigError(
                f"model.init_args.model.model_type {model_type!r} is not supported{hint}; "
                f"use one of {', '.join(sorted(MODEL_TYPES))}"
            )
        config = _construct(MODEL_TYPES[model_type], fields, "model.init_args.model")
    else:
        value = resolve_pretrained(model, "model.init_args.model")
        if Path(value).is_dir():
            hf_dir = Path(value)
            config = get_model_config_from_hf(hf_dir)
        else:
            missing = missing_model_message(value)
            if missing:
                raise ConfigError(missing)
            try:
                config = get_model_config(value)
            except KeyError as err:
                raise ConfigError(
                    f"model {model!r} is neither an HF model directory nor a known alias: {err.args[0]}"
                ) from None
    if overrides:
        values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
        if "num_hidden_layers" in overrides:  # per-layer lists follow the new depth
            values.update(dict.fromkeys(config.per_layer_fields, None))
        config = _construct(type(config), {**values, **overrides}, "model.init_args.model_overrides")
    return config, hf_dir


def missing_model_message(value: str) -> str | None:
    """Why the model path ``value`` cannot be loaded when it names nothing on disk, or ``None``: a value that is not
    a path (a registered alias) or that exists.

    A path is a value with a path separator or starting with ``.`` or ``~``. The message says how to create the
    path where it is a run's HF export (``<run folder>/hf/<name>``), with the command when it is the SFT export the
    tiny recipes start from.
    """
    if Path(value).expanduser().exists() or not ("/" in value or os.sep in value or value.startswith((".", "~"))):
        return None
    message = f"model.init_args.model: model path {value!r} does not exist (working directory: {Path.cwd()})"
    parts = Path(value).parts
    if Path(value).as_posix().endswith(SFT_EXPORT):
        return f"{message}; create it first: it is the SFT recipe's export, `{SFT_EXPORT_COMMAND}` (see README)"
    if "hf" in parts[:-1]:
        run = Path(*parts[: len(parts) - 1 - parts[::-1].index("hf")])
        return (
            f"{message}; create it first: it is the HF export of the run in {run} (a fit with the HFExport "
            "callback, e.g. --config callbacks/hf_export.yaml; see README)"
        )
    return f"{message}; fix the path"


def _construct(cls: type[TransformerConfig], fields: dict[str, Any], where: str) -> TransformerConfig:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(fields) - known)
    owners = sorted(
        t for t, c in MODEL_TYPES.items() if unknown and unknown[0] in {f.name for f in dataclasses.fields(c)}
    )
    if owners:  # a field of other families (e.g. mtp_layers): say so briefly
        raise ConfigError(
            f"{where}: {unknown[0]} is a setting of {', '.join(owners)} models only, not of {cls.__name__}; remove it"
        )
    if unknown:
        hints = "".join(did_you_mean(name, known) for name in unknown)
        raise ConfigError(
            f"{where}: unknown field(s) {unknown} for {cls.__name__}{hints}; fix the key "
            f"(valid fields: {', '.join(sorted(known))})"
        )
    try:
        return cls(**fields)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{where}: {err}") from None
