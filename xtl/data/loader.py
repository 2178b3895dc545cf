"""A ``DataLoader`` that carries its own resume state (Lightning saves it in the checkpoint)."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader

from xtl.data.collate import MicroBatch, StepCollator
from xtl.data.sampler import StepSampler


class ResumableDataLoader(DataLoader):
    """Yields this rank's step batches (``list[MicroBatch]``) and counts what the consumer has taken.

    ``consumed_samples`` advances when a batch is handed out, not when workers prefetch it, so ``state_dict()``
    taken after step N resumes at step N+1, with or without (persistent) workers: the sampler is iterated in the
    main process and re-read from ``consumed_samples`` whenever an iteration starts, and an abandoned iteration's
    prefetched batches are discarded. Lightning sees ``state_dict``/``load_state_dict`` and stores the state in its
    checkpoint (``loops.fit_loop.state_dict.combined_loader``).

    Args:
        dataset (Any): Map-style dataset of packs.
        sampler (StepSampler): Step sampler of this rank.
        collate_fn (StepCollator): Packs to micro-batches.
        num_workers (int): Loader worker processes (0: read and collate in the main process).
        persistent_workers (bool): Keep the workers between iterations (ignored without workers).
        prefetch_factor (int | None): Step batches each worker prepares ahead (ignored without workers).
        pin_memory (bool): Collate into page-locked memory for asynchronous host-to-device copies.
        **kwargs: Other ``DataLoader`` arguments (``multiprocessing_context``, ``timeout``, ...).
    """

    def __init__(
        self,
        dataset: Any,
        sampler: StepSampler,
        collate_fn: StepCollator,
        num_workers: int = 0,
        persistent_workers: bool = False,
        prefetch_factor: int | None = None,
        pin_memory: bool = False,
        **kwargs: Any,
    ) -> None:
        if num_workers > 0:
            kwargs["persistent_workers"] = persistent_workers
            if prefetch_factor is not None:
                kwargs["prefetch_factor"] = prefetch_factor
        super().__init__(
            dataset,
            batch_size=sampler.micro_batches,
            sampler=sampler,
            drop_last=True,
            collate_fn=collate_fn,
            num_workers=num_workers,
            pin_memory=pin_memory,
            **kwargs,
        )
        self.step_sampler = sampler

    @property
    def consumed_samples(self) -> int:
        """Packs consumed by all ranks so far."""
        return self.step_sampler.consumed_samples

    def __iter__(self) -> Iterator[list[MicroBatch]]:
        for batch in super().__iter__():
            self.step_sampler.consumed_samples += self.step_sampler.global_batch
            yield batch

    def state_dict(self) -> dict[str, int]:
        """Resume state: ``consumed_samples`` (plus the pack count and seed it refers to).

        Returns:
            dict: The state.
        """
        return self.step_sampler.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a saved state; warns if it was saved for another pack plan or seed.

        Args:
            state (dict): From ``state_dict()``.
        """
        sampler = self.step_sampler
        if (
            state.get("num_packs", sampler.num_packs) != sampler.num_packs
            or state.get("seed", sampler.seed) != sampler.seed
        ):
            warnings.warn(
                f"data state was saved for {state.get('num_packs')} packs / seed {state.get('seed')}, this run has "
                f"{sampler.num_packs} packs / seed {sampler.seed}: the data or packing changed, so the resumed order "
                "differs from the original run",
                stacklevel=2,
            )
        sampler.consumed_samples = int(state["consumed_samples"])
