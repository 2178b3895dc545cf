"""Precomputed reference log-probabilities (``reference: precomputed``): one pass before training, kept in the data
cache.

A :class:`ReferenceTable` holds the reference's summed log-probability of the chosen and of the rejected response of
every pair of every pack of one packed set (the training set or a validation set), in pack order: the pairs of pack
``p`` are rows ``pair_offsets[p]:pair_offsets[p + 1]`` (:func:`pair_offsets`, from the pack plan).

:func:`compute_reference_table` fills a table in one pass without gradient, sharded like the data: data-parallel rank
``r`` of ``R`` computes packs ``r, r + R, r + 2R, ...``; every rank runs the same number of forwards (a rank out of
packs repeats one and drops its result, so the collectives of a sharded model stay matched), and a sum over the data
group (each row is computed by exactly one rank, the others add zeros) leaves the whole table on every rank.

:func:`save_reference_table` writes a table as one ``.npz`` under ``<cache_dir>/reference/`` (a temporary name, then
a rename), keyed by :func:`reference_key`: the reference weights (:func:`weights_fingerprint`: the content hashes of
an HF directory's safetensors files, or the initialization seed of a from-scratch model), the model config, the
numerics (precision, parameter dtype, device type, model transforms), the data (the pack plan's fingerprint,
:attr:`xtl.data.datamodule.PackedSplit.key`) and the code of the computation. :func:`load_reference_table` reads it
back only when the key and the pack layout match.
"""

from __future__ import annotations

import inspect
import io
import json
import sys
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import xxhash

from xtl.data.collate import MicroBatch
from xtl.data.packing import Pack, PackPlan
from xtl.data.sources import FileHashMemo
from xtl.utils import atomic_write_bytes

REFERENCE_VERSION = 1
REFERENCE_DIR = "reference"

ReferenceForward = Callable[[MicroBatch], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class ReferenceTable:
    """The reference log-probabilities of every pair of one packed set.

    Attributes:
        pair_offsets: int64 ``(num_packs + 1,)``: the pairs of pack ``p`` are rows ``pair_offsets[p]`` to
            ``pair_offsets[p + 1]``.
        logps: float32 ``(2, num_pairs)``: summed log-probabilities of the chosen (row 0) and rejected (row 1)
            responses.
    """

    pair_offsets: np.ndarray
    logps: torch.Tensor

    @property
    def num_pairs(self) -> int:
        """Pairs in the table."""
        return int(self.logps.shape[1])

    def to(self, device: torch.device | str) -> ReferenceTable:
        """The table with its values on ``device``."""
        return ReferenceTable(self.pair_offsets, self.logps.to(device))

    def lookup(self, pack_index: int, pairs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The chosen and rejected log-probabilities of the pairs of pack ``pack_index`` (no device sync).

        Args:
            pack_index: The pack's index in its set's plan (``MicroBatch.pack_index``).
            pairs: Pairs of the micro-batch (checked against the table).

        Raises:
            ValueError: The pack is outside the table or holds another number of pairs (a table of other data).
        """
        if not 0 <= pack_index < len(self.pair_offsets) - 1:
            raise ValueError(f"pack {pack_index} is outside the reference table ({len(self.pair_offsets) - 1} packs)")
        start, end = int(self.pair_offsets[pack_index]), int(self.pair_offsets[pack_index + 1])
        if end - start != pairs:
            raise ValueError(f"pack {pack_index} holds {pairs} pairs but the reference table has {end - start} for it")
        return self.logps[0, start:end], self.logps[1, start:end]


def pair_offsets(plan: PackPlan) -> np.ndarray:
    """Row offsets of each pack's pairs in a table of a preference plan (two documents per pair).

    Returns:
        np.ndarray: int64 ``(len(plan) + 1,)``, starting at 0.
    """
    per_pack = np.diff(np.asarray(plan.pack_offsets, dtype=np.int64)) // 2
    return np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(per_pack, dtype=np.int64)])


def weights_fingerprint(hf_dir: Path | None, seed: int, memo: FileHashMemo) -> dict[str, Any]:
    """What identifies the reference weights: the content hash of each safetensors file of an HF directory, or the
    seed of a from-scratch initialization.

    Args:
        hf_dir: The directory the weights load from (``None``: initialized from ``seed``).
        seed: Seed of ``init_weights``.
        memo: Remembers file hashes across runs (a warm start does not read the weights again).

    Returns:
        dict: JSON-serializable.
    """
    if hf_dir is None:
        return {"init_seed": int(seed)}
    files = sorted(Path(hf_dir).glob("*.safetensors"))
    return {"safetensors": {f.name: memo.hash(f) for f in files}}


def reference_key(parts: dict[str, Any], code: Sequence[Callable[..., Any]] = ()) -> str:
    """Hash of everything a table depends on: ``parts``, this module's code and that of ``code``.

    Args:
        parts: JSON-serializable inputs (weights, model config, numerics, data fingerprint).
        code: Functions the log-probabilities come from (their source is hashed).

    Returns:
        str: Hex digest (xxh3-128).
    """
    h = xxhash.xxh3_128()
    h.update(str(REFERENCE_VERSION).encode())
    for obj in (sys.modules[__name__], *code):
        try:
            h.update(inspect.getsource(obj).encode())
        except (OSError, TypeError):
            h.update(getattr(obj, "__qualname__", repr(obj)).encode())
    h.update(json.dumps(parts, sort_keys=True, default=str).encode())
    return h.hexdigest()


def reference_table_path(cache_dir: Path, key: str) -> Path:
    """Where the table of ``key`` lives: ``<cache_dir>/reference/<key[:32]>.npz``."""
    return Path(cache_dir) / REFERENCE_DIR / f"{key[:32]}.npz"


def compute_reference_table(
    packs: Sequence[Pack],
    offsets: np.ndarray,
    collate: Callable[[Pack], MicroBatch],
    forward: ReferenceForward,
    rank: int = 0,
    world_size: int = 1,
    group: Any = None,
    device: torch.device | str = "cpu",
    contributes: bool = True,
) -> ReferenceTable:
    """Compute the table of one set in one pass, this rank's share of the packs, then sum over the data group.

    Every rank runs ``ceil(num_packs / world_size)`` forwards (a sharded model's forward is a collective); pack
    ``p`` is computed by rank ``p % world_size``, and a rank past the last pack repeats one and drops the result.
    Call it under ``torch.no_grad()``.

    Args:
        packs: The set's packs (``PackedDataset``), indexed like its plan.
        offsets: :func:`pair_offsets` of the plan.
        collate: Pack -> micro-batch (on the host; moved to ``device`` here).
        forward: Micro-batch -> the reference's chosen and rejected log-probabilities ``(P,)`` each.
        rank: This rank's data-parallel rank.
        world_size: Data-parallel ranks.
        group: The process group the shares are summed over (every rank of the data-parallel ranks' context-parallel
            groups; ``None``: no sum, this rank's share only).
        device: Where the table is computed.
        contributes: Whether this rank's results enter the sum (one rank of each context-parallel group: every rank
            of a group computes the same whole pairs).

    Returns:
        ReferenceTable: The whole table on every rank (with ``group``).

    Raises:
        ValueError: A pack's micro-batch holds another number of pairs than the plan says.
    """
    num_packs = len(offsets) - 1
    logps = torch.zeros(2, int(offsets[-1]), dtype=torch.float32, device=device)
    for step in range(-(-num_packs // world_size)):
        index = rank + step * world_size
        chosen, rejected = forward(collate(packs[index % num_packs]).to(device))
        if index >= num_packs or not contributes:  # a repeat (equal forwards on every rank), or a second share
            continue
        start, end = int(offsets[index]), int(offsets[index + 1])
        if chosen.numel() != end - start or rejected.numel() != end - start:
            raise ValueError(f"pack {index}: the reference gave {chosen.numel()} pairs, the plan has {end - start}")
        logps[0, start:end] = chosen.float()
        logps[1, start:end] = rejected.float()
    if group is not None:
        dist.all_reduce(logps, group=group)
    return ReferenceTable(offsets, logps)


def save_reference_table(path: Path, table: ReferenceTable, key: str, info: dict[str, Any] | None = None) -> None:
    """Write a table as one ``.npz`` (a temporary name in the same folder, then a rename).

    Args:
        path: Target file (:func:`reference_table_path`).
        table: The table.
        key: :func:`reference_key` of its inputs, checked again by :func:`load_reference_table`.
        info: Extra JSON-serializable notes stored with it (e.g. the set's name).
    """
    meta = {"version": REFERENCE_VERSION, "key": key, **(info or {})}
    buffer = io.BytesIO()
    np.savez(
        buffer,
        meta=np.array(json.dumps(meta, default=str)),
        pair_offsets=np.asarray(table.pair_offsets, dtype=np.int64),
        logps=table.logps.detach().to("cpu", torch.float32).numpy(),
    )
    atomic_write_bytes(path, buffer.getvalue())


def load_reference_table(path: Path, key: str, offsets: np.ndarray) -> ReferenceTable | None:
    """Read a table written by :func:`save_reference_table` when it exists, is complete, was made from the same
    inputs and has the pack layout ``offsets``.

    Returns:
        ReferenceTable | None: The table (on the host), or ``None``.
    """
    try:
        with np.load(Path(path), allow_pickle=False) as f:
            meta = json.loads(str(f["meta"]))
            if meta.get("version") != REFERENCE_VERSION or meta.get("key") != key:
                return None
            stored_offsets = np.asarray(f["pair_offsets"], dtype=np.int64)
            logps = np.asarray(f["logps"])
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, json.JSONDecodeError):
        return None
    offsets = np.asarray(offsets, dtype=np.int64)
    if not np.array_equal(stored_offsets, offsets) or logps.dtype != np.float32 or logps.shape != (2, offsets[-1]):
        return None
    return ReferenceTable(offsets, torch.from_numpy(logps.copy()))
