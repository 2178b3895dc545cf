"""Which blocks a memory or speed callback acts on (shared by the model-transform callbacks).

A model names its stacks of repeated blocks by part (:meth:`xtl.model.BaseModel.layer_stacks`): ``language``
(the decoder layers) and, for vision-language models, ``vision`` (the vision blocks). Layer choices
(``every_n_layers``, ``layers``) count within each stack.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from xtl.errors import ConfigError
from xtl.model import BaseModel


def chosen_stacks(model: BaseModel, parts: Sequence[str] | None, key: str) -> dict[str, nn.ModuleList]:
    """The model's block stacks restricted to ``parts`` (``None``: every stack the model has).

    Args:
        model: The model (on meta or materialized).
        parts: Part names (``language``, ``vision``), or ``None``.
        key: The option's YAML key, for the error message.

    Raises:
        ConfigError: A part the model does not have.
    """
    stacks = model.layer_stacks()
    if parts is None:
        return stacks
    unknown = [part for part in parts if part not in stacks]
    if unknown:
        raise ConfigError(
            f"{key}: {type(model).__name__} has no part {unknown[0]!r}; its parts are {sorted(stacks)} (or null: all)"
        )
    return {part: stack for part, stack in stacks.items() if part in parts}


def module_names(model: nn.Module) -> dict[int, str]:
    """``id(module) -> full name`` of every module of ``model``."""
    return {id(module): name for name, module in model.named_modules()}


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


def select_layers(
    num_layers: int, every_n_layers: int = 1, layers: Sequence[int] | None = None, part: str = "language"
) -> list[int]:
    """Indices of the chosen layers: ``layers`` when given, else every ``every_n_layers``-th from layer 0.

    Args:
        num_layers: How many blocks the stack has.
        every_n_layers: Choose layers ``i`` with ``i % every_n_layers == 0``.
        layers: Explicit layer indices (negative ones count from the end).
        part: The stack's part name, for the error message.

    Raises:
        ValueError: For an index out of range or bad options, naming the key.
    """
    check_layer_options(every_n_layers, layers)
    if layers is None:
        return list(range(0, num_layers, every_n_layers))
    chosen = set()
    for index in layers:
        if not -num_layers <= index < num_layers:
            raise ValueError(
                f"layers: index {index} is out of range for the {num_layers} {part} layers (choose the part with "
                "parts: [...])"
            )
        chosen.add(index % num_layers)
    return sorted(chosen)
