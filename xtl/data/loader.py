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
    taken after step N resumes at step N+1. Lightning sees ``state_dict``/``load_state_dict`` and stores the state
    in its checkpoint (``loops.fit_loop.state_dict.combined_loader``).

    Args:
        dataset (Any): Map-style dataset of packs.
        sampler (StepSampler): Step sampler of this rank.
        collate_fn (StepCollator): Packs to micro-batches.
        num_workers (int): Loader worker processes.
        **kwargs: Other ``DataLoader`` arguments (``pin_memory``, ``prefetch_factor``, ...).
    """

    def __init__(
        self,
        dataset: Any,
        sampler: StepSampler,
        collate_fn: StepCollator,
        num_workers: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            dataset,
            batch_size=sampler.micro_batches,
            sampler=sampler,
            drop_last=True,
            collate_fn=collate_fn,
            num_workers=num_workers,
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
