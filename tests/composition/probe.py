"""A callback that records what the optional features did to a composition-matrix run (rank 0 writes it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from torch import nn
from torch.distributed.tensor import DTensor

from xtl.callbacks import ActivationOffload
from xtl.callbacks.compile import compiled_frames
from xtl.utils import atomic_write_bytes


class Probe(pl.Callback):
    """Write ``<default_root_dir>/probe.json`` at the end of the fit.

    It holds: ``calls`` (part -> forward calls of each block's first linear layer: a recomputing block is called
    again in backward), ``trainable`` / ``total`` parameters, ``float8`` (fp8 linear layers), ``nf4`` (NF4
    weights), ``fused`` (fused projections), ``compiled_frames`` (frames Dynamo compiled during the fit),
    ``offloaded_bytes``, ``files`` (what the run wrote under its root), ``optimizer`` (its class, the
    parameters in Muon groups and those of them Muon splits into HF matrices), ``reference`` (an objective's
    reference policy: mode, frozen model, precomputed tables, whether it moved), ``head_outputs`` (the rows of the
    output head: 1 for a reward model's scalar head) and ``on_policy_steps`` (distillation's steps on the student's
    own completions).
    """

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Hook the blocks and note the compile counter and the reference's starting weights."""
        self.frames = compiled_frames()
        self.reference_start = _reference_sum(pl_module)
        self.calls: dict[str, list[int]] = {}
        for part, stack in pl_module.model.layer_stacks().items():
            counts = self.calls.setdefault(part, [0] * len(stack))
            for i, block in enumerate(stack):
                first = next(m for m in block.modules() if isinstance(m, nn.Linear))
                first.register_forward_pre_hook(_counter(counts, i))

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Write the record (rank 0)."""
        model = pl_module.model
        params = list(model.parameters())
        offload = [cb for cb in trainer.callbacks if isinstance(cb, ActivationOffload)]
        root = Path(trainer.default_root_dir)
        record = {
            "calls": self.calls,
            "trainable": sum(p.numel() for p in params if p.requires_grad),
            "total": sum(p.numel() for p in params),
            "float8": sum(type(m).__name__ == "Float8Linear" for m in model.modules()),
            "fused": sum(len(getattr(m, "fused_parts", None) or {}) for m in model.modules()),
            "nf4": sum(type(_local(p)).__name__ == "NF4Tensor" or type(p).__name__ == "NF4Tensor" for p in params),
            "compiled_frames": compiled_frames() - self.frames,
            "offloaded_bytes": sum(cb.stats.offloaded_bytes for cb in offload),
            "files": sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()),
            "optimizer": _optimizer(trainer),
            "reference": _reference(pl_module, self.reference_start),
            "head_outputs": model.text_model().lm_head.weight.shape[0],
            "on_policy_steps": getattr(pl_module, "_on_policy_steps", None),
            "loader": type(trainer.train_dataloader).__name__,
        }
        if trainer.is_global_zero:
            atomic_write_bytes(root / "probe.json", json.dumps(record).encode())


def _local(param: nn.Parameter) -> Any:
    """A parameter's data (this rank's shard of an FSDP ``DTensor``: sharded NF4 weights are NF4 shards)."""
    return param.to_local() if isinstance(param, DTensor) else param.data


def _optimizer(trainer: pl.Trainer) -> dict[str, Any]:
    """The class of the run's optimizer, how many parameters its Muon groups hold (``use_muon``) and how many of
    them stack several HF matrices (Muon's ``matrix_rows``)."""
    optimizer = trainer.optimizers[0]
    groups = [g for g in optimizer.param_groups if g.get("use_muon")]
    return {
        "class": type(optimizer).__name__,
        "muon_params": sum(len(g["params"]) for g in groups),
        "split_matrices": len(getattr(optimizer, "matrix_rows", {})),
    }


def _reference(pl_module: pl.LightningModule, start: float | None) -> dict[str, Any] | None:
    """The objective's reference: its mode, whether it holds a frozen model, the precomputed tables and whether the
    frozen model moved during the fit (this rank's shards)."""
    reference = getattr(pl_module, "reference", None)
    if reference is None:
        return None
    precomputed = getattr(pl_module, "precomputed", None)
    end = _reference_sum(pl_module)
    return {
        "mode": reference.mode,
        "frozen": reference.frozen is not None,
        "tables": sorted(precomputed.tables) if precomputed is not None else [],
        "moved": start is not None and end != start,
    }


def _reference_sum(pl_module: pl.LightningModule) -> float | None:
    reference = getattr(pl_module, "reference", None)
    if reference is None or reference.frozen is None:
        return None
    local = (p.to_local() if isinstance(p, DTensor) else p for p in reference.frozen.parameters())
    return float(sum(t.detach().float().sum() for t in local))


def _counter(counts: list[int], index: int) -> Any:
    def hook(module: nn.Module, args: Any) -> None:
        counts[index] += 1

    return hook
