"""Which decoder layers a memory or speed callback acts on (shared by the model-transform callbacks)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's decoder layers (``model.layers``, the modules FSDP shards one by one).

    Raises:
        TypeError: When the model has no ``layers`` module list.
    """
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(model).__name__} has no decoder layers (an nn.ModuleList named 'layers')")
    return layers


def check_every_n_layers(every_n_layers: int) -> int:
    """Return ``every_n_layers`` after checking it is a whole number >= 1.

    Raises:
        ValueError: Naming the ``every_n_layers`` key.
    """
    if isinstance(every_n_layers, bool) or not isinstance(every_n_layers, int) or every_n_layers < 1:
        raise ValueError(f"every_n_layers must be a whole number >= 1; got {every_n_layers!r}")
    return every_n_layers


def check_layer_options(every_n_layers: int, layers: Sequence[int] | None) -> None:
    """Check the layer-choice options: ``every_n_layers`` >= 1, and not together with explicit ``layers``.

    Raises:
        ValueError: Naming the key.
    """
    check_every_n_layers(every_n_layers)
    if layers is not None and every_n_layers != 1:
        raise ValueError("give either layers or every_n_layers, not both")


def select_layers(num_layers: int, every_n_layers: int = 1, layers: Sequence[int] | None = None) -> list[int]:
    """Indices of the chosen layers: ``layers`` when given, else every ``every_n_layers``-th from layer 0.

    Args:
        num_layers: How many decoder layers the model has.
        every_n_layers: Choose layers ``i`` with ``i % every_n_layers == 0``.
        layers: Explicit layer indices (negative ones count from the end).

    Raises:
        ValueError: For an index out of range or bad options, naming the key.
    """
    check_layer_options(every_n_layers, layers)
    if layers is None:
        return list(range(0, num_layers, every_n_layers))
    chosen = set()
    for index in layers:
        if not -num_layers <= index < num_layers:
            raise ValueError(f"layers: index {index} is out of range for a model with {num_layers} decoder layers")
        chosen.add(index % num_layers)
    return sorted(chosen)
