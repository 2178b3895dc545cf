"""``reference: precomputed``: the tables of reference log-probabilities of a preference run, read from the data
cache or computed once before the first step.

:class:`PrecomputedReference` holds one :class:`~xtl.train.reference_cache.ReferenceTable` per preference set of the
run (the training set and each validation set). :meth:`PrecomputedReference.prepare` reads the stored tables every
rank finds under ``<cache_dir>/reference`` with their key (reference weights, model config, numerics, data, code:
:mod:`xtl.train.reference_cache`), and computes the others in one pass without gradient: each data-parallel rank
forwards its share of the packs (under context parallelism each rank its share of every pack, the group's sums make
the pairs whole), the shares are summed so that every rank holds the whole tables, and local rank 0 stores them.
The reference is the starting policy (:meth:`~xtl.train.reference.ReferencePolicy.starting_policy`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from xtl.data.collate import MicroBatch
from xtl.data.datamodule import PackedSplit, XTLDataModule
from xtl.data.sources import FileHashMemo
from xtl.errors import ConfigError
from xtl.strategies.parallelize import TransformStage
from xtl.train.reference_cache import (
    ReferenceTable,
    compute_reference_table,
    load_reference_table,
    pair_offsets,
    reference_key,
    reference_table_path,
    save_reference_table,
    weights_fingerprint,
)

if TYPE_CHECKING:
    from xtl.train.base import LanguageModule

TRAIN_SET = "train"
PairLogps = Callable[[nn.Module, MicroBatch, "dist.ProcessGroup | None"], tuple[torch.Tensor, torch.Tensor]]


class PrecomputedReference:
    """The reference tables of a preference run.

    Args:
        module: The objective (its trainer, datamodule, strategy and reference policy).
        pair_logps: ``(model, micro-batch or context-parallel share, context-parallel group) -> (chosen, rejected)``
            summed log-probabilities of the micro-batch's pairs, whole over the group.
        code: Functions the log-probabilities come from (their source is part of the tables' key).
    """

    def __init__(self, module: LanguageModule, pair_logps: PairLogps, code: tuple[Callable[..., Any], ...]) -> None:
        self.module = module
        self.pair_logps = pair_logps
        self.code = code
        self.tables: dict[str, ReferenceTable] = {}  # set ("train", "val/<idx>") -> table, on device

    def lookup(self, dataset: str, pack_index: int, pairs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The chosen and rejected reference log-probabilities of the pairs of pack ``pack_index`` of ``dataset``
        (``train`` or ``val/<dataloader_idx>``).

        Raises:
            RuntimeError: No table was prepared for ``dataset``.
        """
        if dataset not in self.tables:
            raise RuntimeError(f"reference: precomputed, but no reference table was prepared for {dataset}")
        return self.tables[dataset].lookup(pack_index, pairs)

    def prepare(self) -> None:
        """Read or compute the table of every preference set of the run that has none yet (the training set when
        fitting, each validation set), all at once, before the first step.

        Raises:
            ConfigError: The run's data is not an :class:`~xtl.data.XTLDataModule`.
        """
        trainer = self.module.trainer
        datamodule = trainer.datamodule
        if not isinstance(datamodule, XTLDataModule):
            raise ConfigError(
                "model.init_args.reference: precomputed reads the pairs from xtl.data.XTLDataModule (the data: "
                "section of the recipe); with other data use reference: live"
            )
        datamodule.setup()
        sets: dict[str, PackedSplit] = {}
        if trainer.state.fn == "fit" and datamodule.train_split is not None:
            sets[TRAIN_SET] = datamodule.train_split
        for index, name in enumerate(datamodule.val_set_names):
            sets[f"val/{index}"] = datamodule.val_splits[name]
        missing = {name: split for name, split in sets.items() if split.pairs and name not in self.tables}
        if missing:
            keys = self._keys(datamodule, missing)
            to_compute = self._read(missing, keys, datamodule.cache_dir)
            if to_compute:
                self._compute(datamodule, {name: missing[name] for name in to_compute}, keys)

    # ---- private ---------------------------------------------------------------------------------------------

    def _keys(self, datamodule: XTLDataModule, sets: dict[str, PackedSplit]) -> dict[str, str]:
        """The cache key of each set's table: reference weights, model config, numerics, data, code."""
        module = self.module
        transforms = [t for t in module.model_transforms if t.transform_stage == TransformStage.MODEL]
        memo = FileHashMemo(datamodule.cache_dir / "fingerprints")
        weights = None
        if module.global_rank == 0:  # one rank reads the weights' files
            weights = weights_fingerprint(module.hf_dir, module.hparams.seed, memo)
            weights["transforms"] = {str(f): memo.hash(f) for t in transforms for f in t.weight_files()}
        common = {
            "weights": module.trainer.strategy.broadcast(weights, src=0),
            "model": dataclasses.asdict(module.model_config),
            "param_dtype": module.hparams.param_dtype,
            "gathered_dtype": str(module.parallelizer.gathered_dtype),  # FSDP's mixed-precision compute dtype
            "precision": str(module.trainer.precision),
            "device": module.device.type,
            "transforms": [_describe(t) for t in transforms],
            "pad_to": datamodule.pack_max_length if datamodule.pad_to_max_length else None,
        }
        return {name: reference_key({**common, "data": split.key}, code=self.code) for name, split in sets.items()}

    def _read(self, sets: dict[str, PackedSplit], keys: dict[str, str], cache_dir: Path) -> list[str]:
        """Take the stored tables every rank finds (a sharded forward needs every rank: all read or all compute);
        returns the sets left to compute."""
        module = self.module
        stored = {
            name: load_reference_table(reference_table_path(cache_dir, keys[name]), keys[name], pair_offsets(s.plan))
            for name, s in sets.items()
        }
        everywhere = torch.tensor([float(table is not None) for table in stored.values()], device=module.device)
        group = module.parallelizer.data_group()
        if group is not None:
            dist.all_reduce(everywhere, op=dist.ReduceOp.MIN, group=group)
        left = []
        for (name, table), found in zip(stored.items(), everywhere.tolist()):
            if table is None or not found:
                left.append(name)
                continue
            self.tables[name] = table.to(module.device)
            rank_zero_info(
                f"xtl preference: reference log-probabilities of {self._set_name(name)} ({table.num_pairs} pairs) "
                f"read from {reference_table_path(cache_dir, keys[name])}"
            )
        return left

    def _compute(self, datamodule: XTLDataModule, sets: dict[str, PackedSplit], keys: dict[str, str]) -> None:
        """One pass over the packs of ``sets`` without gradient, sharded over the data-parallel ranks (every rank
        ends with the whole tables); local rank 0 stores them."""
        module, trainer = self.module, self.module.trainer
        layout, group = module.parallelizer.layout, module.parallelizer.data_group()
        cp_group = module.parallelizer.meshes.cp_group()
        rank = module.global_rank
        collator, precision = datamodule.collator(), trainer.precision_plugin
        moved = trainer.ckpt_path is not None or module.global_step > 0
        with module.reference.starting_policy(module.model, moved) as (model, source):
            for name, split in sets.items():
                start = time.perf_counter()
                context = precision.train_step_context() if name == TRAIN_SET else precision.val_step_context()
                with context:  # the autocast of the step that reads the table, as the live reference runs under
                    table = compute_reference_table(
                        split.packs,
                        pair_offsets(split.plan),
                        lambda pack: module.on_before_batch_transfer(collator([pack]), 0)[0],
                        lambda mb, model=model: self.pair_logps(model, mb, cp_group),
                        rank=layout.data_rank(rank),
                        world_size=layout.dp_size,
                        group=group,
                        device=module.device,
                        contributes=layout.context_rank(rank) == 0,
                    )
                self.tables[name] = table
                path = reference_table_path(datamodule.cache_dir, keys[name])
                if trainer.local_rank == 0:
                    info = {"set": self._set_name(name), "pairs": table.num_pairs}
                    try:
                        save_reference_table(path, table, keys[name], info)
                    except OSError as err:  # a read-only cache folder: computed again next time
                        rank_zero_info(f"xtl preference: cannot store the reference table in {path} ({err})")
                rank_zero_info(
                    f"xtl preference: reference log-probabilities of {self._set_name(name)} ({table.num_pairs} pairs, "
                    f"{len(split.plan)} packs on {layout.dp_size} data rank(s), from {source}) computed in "
                    f"{time.perf_counter() - start:.1f} s, stored in {path}"
                )

    def _set_name(self, name: str) -> str:
        if name == TRAIN_SET:
            return name
        datamodule = self.module.trainer.datamodule
        index = int(name.split("/")[1])
        names = datamodule.val_set_names
        return f"val set {names[index] if index < len(names) else index}"


def _describe(transform: Any) -> dict[str, Any]:
    """A model transform's class and plain settings (what may change the reference's numerics), for cache keys."""
    plain = (str, int, float, bool, type(None), list, tuple)
    settings = {k: v for k, v in vars(transform).items() if not k.startswith("_") and isinstance(v, plain)}
    return {"class": f"{type(transform).__module__}.{type(transform).__qualname__}", **settings}
