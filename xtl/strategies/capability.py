"""What a feature declares it can run on, checked once at startup against the parallel layout.

Context parallelism (``cp > 1``) splits every packed sequence over ``cp`` ranks. A feature that needs whole
sequences on each rank (decoding, evaluation harnesses, per-document comparisons, tokens shifted across the split)
cannot follow. Each such feature *declares* it by subclassing :class:`ContextParallelFeature` and returning a
:class:`Refusal` from :meth:`~ContextParallelFeature.context_parallel_refusal` -- callbacks, the training
objective (``LanguageModule`` and its subclasses; a mode-dependent refusal is a method of the instance), the
family's training behaviours, the module's decoding stage. Nothing is discovered by attribute name.

The strategy that lays the ranks out asks every feature of the run once, right after the layout is known and before
any data is prepared (:func:`check_context_parallel`), and raises one ``ConfigError`` naming every refusal.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from xtl.errors import ConfigError
from xtl.strategies.layout import KEY, ParallelLayout


@dataclass(frozen=True)
class Refusal:
    """Why a feature does not run under context parallelism, and how to leave it out.

    Attributes:
        what: The feature as the config names it, and why (``"LMEval runs whole requests on each process"``).
        remedy: How to leave it out, naming the YAML key or fragment (``None``: setting the size to 1 is all).
    """

    what: str
    remedy: str | None = None

    def text(self) -> str:
        """``what (remedy)``."""
        return self.what if self.remedy is None else f"{self.what} ({self.remedy})"


class ContextParallelFeature:
    """A part of a run that declares whether it runs under context parallelism; by default it does.

    Subclass it and override :meth:`context_parallel_refusal` to refuse (a callback, an objective, a training
    behaviour); override :meth:`context_parallel_parts` to have the features a part brings with it asked too.
    """

    def context_parallel_refusal(self, stage: str) -> Refusal | None:
        """Why this feature cannot run when each sequence is split over ranks; ``None``: it can (the default).

        Args:
            stage: The trainer's entry point: ``fit``, ``validate``, ``test`` or ``predict``.
        """
        return None

    def context_parallel_parts(self) -> Sequence[ContextParallelFeature]:
        """The features this one brings with it, asked with it (default: none)."""
        return ()


def context_parallel_refusals(features: Iterable[object], stage: str) -> list[Refusal]:
    """The refusals of ``features`` (those that subclass :class:`ContextParallelFeature`, and their parts), each
    feature asked once, in order."""
    refusals: list[Refusal] = []
    pending = [f for f in features if isinstance(f, ContextParallelFeature)]
    while pending:
        feature = pending.pop(0)
        refusal = feature.context_parallel_refusal(stage)
        if refusal is not None:
            refusals.append(refusal)
        pending[:0] = feature.context_parallel_parts()
    return refusals


def check_context_parallel(layout: ParallelLayout, features: Iterable[object], stage: str) -> None:
    """Refuse, in one error, every feature of the run that does not run under the layout's context parallelism.

    Nothing is asked when ``layout.cp`` is 1.

    Args:
        layout: The run's layout.
        features: The run's parts (the LightningModule, the callbacks); those that are not a
            :class:`ContextParallelFeature` run under context parallelism.
        stage: The trainer's entry point (``fit``, ``validate``, ``test``, ``predict``).

    Raises:
        ConfigError: One line naming ``context_parallel_size``, each refused feature and how to leave it out.
    """
    if layout.cp == 1:
        return
    refusals = context_parallel_refusals(features, stage)
    if not refusals:
        return
    raise ConfigError(
        f"{KEY}.context_parallel_size: {layout.cp} splits each sequence over {layout.cp} processes, but "
        f"{'; '.join(r.text() for r in refusals)}; leave {'it' if len(refusals) == 1 else 'them'} out, or set "
        "context_parallel_size: 1"
    )
