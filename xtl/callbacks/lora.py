"""LoRA finetuning as a model transform: frozen base weights, trainable low-rank adapters."""

from __future__ import annotations

import fnmatch
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from xtl.errors import ConfigError
from xtl.model import BaseModel
from xtl.model.base import has_fused_projections
from xtl.model.hf.peft_adapter import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    hf_module_path,
    load_peft_adapter,
    merge_lora_transform,
    peft_module_paths,
    peft_target_matches,
    peft_target_modules,
    read_adapter_config,
    save_peft_adapter,
)
from xtl.module.lora import (
    LORA_INITS,
    adapters_disabled,
    add_lora,
    keep_starting_adapters,
    lora_layers,
    starting_adapters,
)
from xtl.strategies.parallelize import HFExportRequest, ModelTransform, ReferenceViews, TransformStage
from xtl.utils import resolve_path

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LoraExport = Literal["merged", "adapter", "both"]
LORA_EXPORTS: tuple[str, ...] = ("merged", "adapter", "both")


class LoRA(pl.Callback, ModelTransform):
    """Freeze the model and train low-rank adapters on the selected linear layers (PEFT's LoRA).

    Applied first in the strategy's ``parallelize`` sequence (stage MODEL, on the ``meta`` model): every parameter
    is frozen, then each ``nn.Linear`` whose name matches ``target_modules`` gets ``lora_A``/``lora_B`` factors
    (:mod:`xtl.module.lora`). Base parameter names do not change, so HF weights load as before; the adapters
    initialize themselves after the load (``B = 0``: the first forward equals the base model's). Only the adapters
    get gradients, optimizer state and weight decay; Lightning checkpoints keep only trainable parameters (the
    frozen ones come back from the model source on resume: :meth:`skipped_checkpoint_keys`). The number of
    trainable parameters is printed at the start of the fit.

    With the default targets a dense model adapts attention (q/k/v/o) and MLP projections; an MoE model adapts
    attention, dense MLPs and shared experts (grouped routed experts are not ``nn.Linear`` and stay frozen).

    With ``adapter_path`` training continues from a PEFT LoRA adapter: its ``adapter_config.json`` replaces
    ``rank``, ``alpha``, ``dropout``, ``target_modules`` and ``use_rslora`` (the arguments given here are ignored;
    ``target_modules`` then follow PEFT's rule on the HF module names), and its ``adapter_model.safetensors`` is
    loaded into the adapters once the model's weights are loaded (:meth:`after_weights`). Settings xtl cannot
    reproduce (DoRA, biases, ``modules_to_save``, per-module ranks, ...) are refused with the file and key named.

    An HF export (:class:`~xtl.callbacks.HFExport`) of the adapted model is written as ``export`` says
    (:meth:`export_hf`): ``merged`` writes the HF model with each adapted weight replaced by
    ``W + scaling * B @ A`` (fp32 math, then the export dtype); ``adapter`` writes a PEFT adapter directory instead
    (``adapter_config.json`` + ``adapter_model.safetensors``, loadable with ``peft.PeftModel.from_pretrained`` on
    the base model; the factors keep their parameter dtype unless the export sets one); ``both`` writes the merged
    model with the adapter in its ``adapter`` subdirectory.

    QLoRA (frozen base weights in 4-bit NF4) is the :class:`~xtl.callbacks.QLoRA` callback beside this one
    (``callbacks/qlora.yaml``).

    Args:
        rank: Adapter rank ``r``.
        alpha: ``lora_alpha``; the update is scaled by ``alpha / r`` (``alpha / sqrt(r)`` with ``use_rslora``).
        dropout: Dropout on the adapter input during training.
        target_modules: Layer names or ``fnmatch`` patterns, matched against the full module name
            (``layers.0.self_attn.q_proj``) or its last part (``q_proj``).
        use_rslora: Rank-stabilized scaling ``alpha / sqrt(r)``.
        init: ``kaiming`` (PEFT's default) or ``gaussian`` initialization of ``lora_A``; ``lora_B`` starts at zero.
        adapter_path: A PEFT LoRA adapter directory to continue from (overrides the settings above).
        export: What an HF export writes: ``merged``, ``adapter`` or ``both`` (see above).

    Raises:
        ConfigError: A setting is out of range, or ``adapter_path``'s config is missing or unsupported.
    """

    transform_stage = TransformStage.MODEL

    def __init__(
        self,
        rank: int = 8,
        alpha: float = 16.0,
        dropout: float = 0.0,
        target_modules: list[str] | None = None,
        use_rslora: bool = False,
        init: str = "kaiming",
        adapter_path: str | None = None,
        export: LoraExport = "merged",
    ) -> None:
        if rank < 1:
            raise ConfigError(f"LoRA.rank must be >= 1, got {rank}")
        if not 0.0 <= dropout < 1.0:
            raise ConfigError(f"LoRA.dropout must be in [0, 1), got {dropout}")
        if init not in LORA_INITS:
            raise ConfigError(f"LoRA.init must be one of {LORA_INITS}, got {init!r}")
        if export not in LORA_EXPORTS:
            raise ConfigError(f"LoRA.export must be one of {LORA_EXPORTS}, got {export!r}")
        self.rank = rank
        self.alpha = alpha
        self.dropout = dropout
        self.target_modules = list(target_modules) if target_modules is not None else list(DEFAULT_TARGETS)
        self.use_rslora = use_rslora
        self.init = init
        self.adapter_path = adapter_path
        self.export = export
        self._peft_targets: list[str] | str | None = None  # target_modules of the adapter's config (PEFT's rule)
        if adapter_path is not None:
            self._use_adapter_config(Path(resolve_path(adapter_path)))

    def transform_model(self, model: BaseModel) -> BaseModel:
        """Freeze every parameter and attach adapters to the matching linear layers (in place).

        Raises:
            ConfigError: The model fuses its projections (adapters are per HF projection) or no layer matches.
        """
        if has_fused_projections(model):
            raise ConfigError(
                "LoRA adapts the separate q/k/v and gate/up projections that fused_projections joins; "
                "set model.init_args.model_overrides.fused_projections: false"
            )
        model.requires_grad_(False)
        head = model.text_model().lm_head
        targets = [
            (name, m)
            for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and self._is_target(model, name, m is head)
        ]
        if not targets:
            linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)})
            where = "LoRA.target_modules" if self._peft_targets is None else f"target_modules of {self._config_file}"
            raise ConfigError(
                f"{where} {self.target_modules} match no linear layer of {type(model).__name__}; "
                f"its linear layers are named {linear}"
            )
        for _, layer in targets:
            add_lora(layer, self.rank, self.alpha, self.dropout, self.use_rslora, self.init)
        return model

    def matches(self, name: str) -> bool:
        """Whether the module ``name`` is a target."""
        last = name.rsplit(".", 1)[-1]
        return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(last, p) for p in self.target_modules)

    def after_weights(self, model: BaseModel) -> BaseModel:
        """Load ``adapter_path``'s factors into the adapters (initialized with the weights, overwritten here) and
        keep a frozen copy of them: the starting adapters of :meth:`reference_views`."""
        if self.adapter_path is not None:
            load_peft_adapter(model, self._config_file.parent)
            keep_starting_adapters(model)
            rank_zero_info(f"LoRA: loaded adapter {self._config_file.parent}")
        return model

    def reference_views(self, model: BaseModel) -> ReferenceViews:
        """The adapted model as it started, without a second copy: with its adapters off when they start fresh
        (``B = 0``: the base model), else with the frozen copy of the loaded adapter (as TRL keeps a ``ref`` adapter);
        and the base model (adapters off), which is the starting policy only for fresh adapters."""
        fresh = self.adapter_path is None
        return ReferenceViews(
            start=lambda: adapters_disabled(model) if fresh else starting_adapters(model),
            base=lambda: adapters_disabled(model),
            base_is_start=fresh,
            why_base_is_not_start=""
            if fresh
            else f"LoRA.adapter_path ({self.adapter_path}) continues from a trained "
            "adapter, so the model with its adapters off is not the starting policy",
            describe_start="the model with its LoRA adapters off"
            if fresh
            else f"the model with a frozen copy of the LoRA adapter it started from ({self.adapter_path})",
        )

    def weight_files(self) -> list[Path]:
        """The adapter's safetensors file when continuing from one."""
        return [self._config_file.parent / ADAPTER_WEIGHTS] if self.adapter_path is not None else []

    def skipped_checkpoint_keys(self, model: BaseModel) -> set[str]:
        """The frozen parameters (every name of a tied one): the model source rebuilds them on resume."""
        params = model.named_parameters(remove_duplicate=False)
        return {name for name, param in params if not param.requires_grad}

    def export_hf(self, model: BaseModel, request: HFExportRequest) -> list[Path]:
        """Write the merged model, the PEFT adapter or both (``export``) for ``request.target``."""
        written = []
        if self.export in ("merged", "both"):
            request.write_model(request.target, merge_lora_transform(model))
            written.append(request.target)
        if self.export in ("adapter", "both"):
            adapter_dir = request.target / "adapter" if self.export == "both" else request.target
            config = self.adapter_config(peft_target_modules(model, peft_module_paths(model)))
            save_peft_adapter(model, adapter_dir, config, source_dir=model.source_dir, dtype=request.dtype)
            written.append(adapter_dir)
        return written

    def memory_settings(self) -> dict[str, Any]:
        """The adapter rank and the adapted layers, for ``xtl memory --config``."""
        return {"lora_rank": self.rank, "lora_targets": tuple(self.target_modules)}

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Print how many parameters train."""
        trainable, total = trainable_parameters(pl_module.model)
        layers = sum(1 for _ in lora_layers(pl_module.model))
        rank_zero_info(
            f"LoRA: r={self.rank}, alpha={self.alpha:g} on {layers} layers; trainable parameters {trainable:,} of "
            f"{total:,} ({100.0 * trainable / max(total, 1):.2f}%)"
        )

    def adapter_config(self, target_modules: list[str]) -> dict[str, Any]:
        """PEFT's ``adapter_config.json`` content for these settings and the adapted (HF) module names."""
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": self.rank,
            "lora_alpha": self.alpha,
            "lora_dropout": self.dropout,
            "target_modules": sorted(target_modules),
            "use_rslora": self.use_rslora,
            "init_lora_weights": True if self.init == "kaiming" else "gaussian",
            "bias": "none",
            "fan_in_fan_out": False,
            "modules_to_save": None,
            "inference_mode": True,
        }

    def _use_adapter_config(self, adapter_dir: Path) -> None:
        config = read_adapter_config(adapter_dir)
        self._config_file = adapter_dir / ADAPTER_CONFIG
        self.rank = config["r"]
        self.alpha = config["lora_alpha"]
        self.dropout = config.get("lora_dropout", 0.0)
        self.use_rslora = bool(config.get("use_rslora", False))
        targets = config["target_modules"]
        self._peft_targets = targets if isinstance(targets, str) else list(targets)
        self.target_modules = [targets] if isinstance(targets, str) else list(targets)
        if config.get("init_lora_weights") == "gaussian":
            self.init = "gaussian"

    def _is_target(self, model: BaseModel, name: str, is_head: bool) -> bool:
        if self._peft_targets is None:
            return self.matches(name)
        if self._peft_targets == "all-linear" and is_head:  # PEFT skips the output layer
            return False
        try:
            path = hf_module_path(model, name)
        except ConfigError:  # no HF linear of its own: never a PEFT target
            return False
        return peft_target_matches(self._peft_targets, path)


def trainable_parameters(model: nn.Module) -> tuple[int, int]:
    """``(trainable, total)`` parameter counts (global sizes for sharded parameters)."""
    trainable = total = 0
    for param in model.parameters():
        total += param.numel()
        trainable += param.numel() if param.requires_grad else 0
    return trainable, total
