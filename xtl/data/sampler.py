"""Samplers over packs: which packs each data-parallel rank trains on at each optimizer step.

One optimizer step consumes a *global batch* of ``world_size * micro_batches_per_step`` packs. An epoch order is a
permutation of pack indices cut to a multiple of the global batch; at step ``s`` rank ``r`` takes the contiguous
slice ``order[s*G + r*m : s*G + (r+1)*m]``. The only state is ``consumed_samples`` (packs consumed by all ranks
together), so resuming needs no more than that number; epoch and position follow from it.

Orders: ``random`` (seeded per epoch), ``length_grouped`` (packs of similar token count share a step and are
spread over ranks to balance token load), ``preset`` (a user ``.npy`` of pack indices).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import numpy as np
from torch.utils.data import DistributedSampler

from xtl.data.item import DataError, DataFileNotFoundError

SamplerOrder = Literal["random", "length_grouped", "preset"]


class StepSampler(DistributedSampler):
    """This rank's pack indices, step after step, from ``consumed_samples`` to the end of the current epoch.

    It subclasses ``DistributedSampler`` only so Lightning does not replace it; the rank slicing is its own.
    A ``DataLoader`` with ``batch_size=micro_batches_per_step`` turns the stream into this rank's step batches.

    Args:
        num_packs (int): Packs in the dataset.
        micro_batches_per_step (int): Packs per rank per optimizer step.
        rank (int): Data-parallel rank.
        world_size (int): Data-parallel world size.
        seed (int): Seed of the epoch orders.
        order (str): ``"random"``, ``"length_grouped"`` or ``"preset"``.
        pack_tokens (np.ndarray | None): Real tokens per pack (``length_grouped``).
        preset (str | None): ``.npy`` of pack indices (``preset``).
        consumed_samples (int): Packs already consumed by all ranks.
        group_steps (int): ``length_grouped``: steps sorted together in one mega-batch.
    """

    def __init__(
        self,
        num_packs: int,
        micro_batches_per_step: int = 1,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        order: SamplerOrder = "random",
        pack_tokens: np.ndarray | None = None,
        preset: str | None = None,
        consumed_samples: int = 0,
        group_steps: int = 16,
    ) -> None:
        super().__init__(
            range(num_packs), num_replicas=world_size, rank=rank, shuffle=False, seed=seed, drop_last=True
        )
        if micro_batches_per_step < 1:
            raise DataError(f"micro_batches_per_step must be >= 1, got {micro_batches_per_step}")
        self.num_packs = num_packs
        self.micro_batches = micro_batches_per_step
        self.world_size = world_size
        self.global_batch = world_size * micro_batches_per_step
        self.order = order
        self.group_steps = group_steps
        self.consumed_samples = int(consumed_samples)
        self._preset: np.ndarray | None = None
        if order == "length_grouped":
            if pack_tokens is None or len(pack_tokens) != num_packs:
                raise DataError("the length_grouped sampler needs the token count of every pack")
            self.pack_tokens = np.asarray(pack_tokens, dtype=np.int64)
        elif order == "preset":
            if preset is None:
                raise DataError("sampler 'preset' needs `sampler_preset`: a .npy file of pack indices")
            self._preset = load_preset_order(preset, num_packs, self.global_batch)
        elif order != "random":
            raise DataError(f"unknown sampler {order!r}; use random, length_grouped or preset")
        if self.samples_per_epoch == 0:
            raise DataError(
                f"only {num_packs} packs, but one optimizer step needs {self.global_batch} (world_size {world_size} x "
                f"micro_batches_per_step {micro_batches_per_step}); add data or lower pack_max_length / "
                "micro_batches_per_step"
            )

    @property
    def samples_per_epoch(self) -> int:
        """Packs consumed per epoch by all ranks (a multiple of the global batch)."""
        if self._preset is not None:
            return len(self._preset)
        return self.num_packs // self.global_batch * self.global_batch

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps per epoch."""
        return self.samples_per_epoch // self.global_batch

    def __iter__(self) -> Iterator[int]:
        epoch, position = divmod(self.consumed_samples, self.samples_per_epoch)
        order = self.epoch_order(epoch)
        lo, hi = self.rank * self.micro_batches, (self.rank + 1) * self.micro_batches
        for step_start in range(position, self.samples_per_epoch - self.global_batch + 1, self.global_batch):
            yield from order[step_start + lo : step_start + hi].tolist()

    def __len__(self) -> int:
        return self.steps_per_epoch * self.micro_batches

    def set_epoch(self, epoch: int) -> None:
        """Ignored: the epoch follows from ``consumed_samples`` (Lightning calls this every epoch)."""
        self.epoch = epoch

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Global pack order of an epoch (all ranks), length ``samples_per_epoch``.

        Args:
            epoch (int): Epoch index.

        Returns:
            np.ndarray: Pack indices.
        """
        if self._preset is not None:
            return self._preset
        rng = np.random.default_rng([self.seed, epoch])
        perm = rng.permutation(self.num_packs)[: self.samples_per_epoch]
        if self.order == "random":
            return perm
        return self._length_grouped(perm, rng)

    def state_dict(self) -> dict[str, int]:
        """Resume state.

        Returns:
            dict: ``consumed_samples`` plus the sizes it refers to.
        """
        return {"consumed_samples": self.consumed_samples, "num_packs": self.num_packs, "seed": self.seed}

    def _length_grouped(self, perm: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        g, m = self.global_batch, self.micro_batches
        steps = []
        mega = g * self.group_steps
        for a in range(0, len(perm), mega):
            chunk = perm[a : a + mega]
            chunk = chunk[np.argsort(-self.pack_tokens[chunk], kind="stable")]
            for b in range(0, len(chunk), g):
                steps.append(_balance(chunk[b : b + g], self.pack_tokens, m, self.world_size))
        return np.concatenate([steps[i] for i in rng.permutation(len(steps))])


class EvalStepSampler(DistributedSampler):
    """Step indices ``0..num_steps-1`` in order, identical on every rank (for ``RankSteps`` eval datasets).

    Args:
        num_steps (int): Evaluation steps.
    """

    def __init__(self, num_steps: int) -> None:
        super().__init__(range(max(num_steps, 1)), num_replicas=1, rank=0, shuffle=False)
        self.num_steps = num_steps

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.num_steps))

    def __len__(self) -> int:
        return self.num_steps


class RankSteps:
    """Evaluation steps of one rank: step ``s`` holds packs ``s*G + r*m ... s*G + (r+1)*m`` that exist.

    Every pack is evaluated exactly once over all ranks; at the tail a rank can get fewer packs (or none), so ranks
    still run the same number of steps.

    Args:
        dataset (object): Map-style dataset of packs.
        micro_batches (int): Packs per rank per step.
        rank (int): Data-parallel rank.
        world_size (int): Data-parallel world size.
    """

    def __init__(self, dataset: object, micro_batches: int, rank: int, world_size: int) -> None:
        self.dataset = dataset
        self.micro_batches = micro_batches
        self.rank = rank
        self.world_size = world_size
        global_batch = micro_batches * world_size
        self.num_steps = -(-len(dataset) // global_batch)  # type: ignore[arg-type]

    def __len__(self) -> int:
        return self.num_steps

    def __getitem__(self, step: int) -> list:
        global_batch = self.micro_batches * self.world_size
        lo = step * global_batch + self.rank * self.micro_batches
        hi = min(lo + self.micro_batches, len(self.dataset))  # type: ignore[arg-type]
        return [self.dataset[i] for i in range(lo, hi)]  # type: ignore[index]


def load_preset_order(path: str | Path, num_packs: int, global_batch: int) -> np.ndarray:
    """Load a user pack order: a 1-D integer ``.npy`` of pack indices, cut to a multiple of the global batch.

    Args:
        path (str | Path): The ``.npy`` file.
        num_packs (int): Packs in the dataset.
        global_batch (int): Packs per optimizer step over all ranks.

    Returns:
        np.ndarray: The truncated order (memory-mapped).
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise DataFileNotFoundError(f"sampler preset {path} does not exist; fix `sampler_preset`")
    order = np.load(path, mmap_mode="r", allow_pickle=False)
    where = f"sampler preset {path}"
    if order.ndim != 1:
        raise DataError(f"{where} has shape {order.shape}; expected a 1-D array of pack indices")
    if not np.issubdtype(order.dtype, np.integer):
        raise DataError(f"{where} has dtype {order.dtype}; expected an integer dtype (e.g. int64)")
    bad = np.flatnonzero((order < 0) | (order >= num_packs))
    if len(bad):
        raise DataError(
            f"{where}: entry {int(bad[0])} is {int(order[bad[0]])}, outside [0, {num_packs}) packs; "
            f"{len(bad)} entries are out of range (was it made for another pack plan?)"
        )
    usable = len(order) // global_batch * global_batch
    if usable == 0:
        raise DataError(f"{where} has {len(order)} entries, fewer than one global batch ({global_batch})")
    return order[:usable]


def _balance(items: np.ndarray, tokens: np.ndarray, micro_batches: int, world_size: int) -> np.ndarray:
    # Longest-processing-time: each pack (longest first) goes to the least-loaded rank with a free slot.
    loads = np.zeros(world_size, dtype=np.int64)
    slots: list[list[int]] = [[] for _ in range(world_size)]
    for item in items.tolist():
        open_ranks = [r for r in range(world_size) if len(slots[r]) < micro_batches]
        r = min(open_ranks, key=lambda k: (loads[k], k))
        slots[r].append(item)
        loads[r] += tokens[item]
    return np.asarray([i for s in slots for i in s], dtype=np.int64)
