"""Rollout engines: what samples completions of prompts for RL.

A :class:`RolloutEngine` turns prompt token ids into :class:`Rollout` s under a :class:`SamplingSettings` and
follows the policy: :meth:`RolloutEngine.sync_weights` is called after every optimizer step. The embedded default,
:class:`LocalRolloutEngine`, is xtl's cached sampler (:func:`xtl.train.generation.generate`) on the policy itself
(so it always runs the current weights and needs no sync), batched across prompts. :class:`VLLMRolloutEngine`
(``pip install vllm``, GPU) drives a vLLM engine instead: it pushes the policy's weights after each update and
returns the sampling log-probabilities.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist

from xtl.train.generation import GenerationConfig, generate

FinishReason = Literal["stop", "length", "abort"]


@dataclass
class SamplingSettings:
    """How completions are sampled.

    Args:
        group_size: Completions per prompt (the group advantages are computed over).
        temperature: Sampling temperature (> 0).
        top_p: Nucleus sampling mass (1.0: off).
        top_k: Keep the ``top_k`` most likely tokens (0: off).
        max_new_tokens: Tokens per completion at most (a completion cut there finishes with ``length``).
        stop_token_ids: Extra stop tokens (the tokenizer's and the template's are always added).
        seed: Seed of the sampling generator.

    Raises:
        ValueError: Naming the first setting out of range.
    """

    group_size: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        if self.group_size < 2:
            raise ValueError(
                f"group_size must be >= 2 (advantages compare completions of a prompt), got {self.group_size}"
            )
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 for sampling, got {self.temperature}")
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        self.generation_config()  # the remaining checks

    def generation_config(self, stop_token_ids: Iterable[int] = (), pad_token_id: int = 0) -> GenerationConfig:
        """These settings as :func:`~xtl.train.generation.generate` takes them, with ``stop_token_ids`` added."""
        return GenerationConfig(
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            seed=self.seed,
            stop_token_ids=tuple(sorted({*self.stop_token_ids, *stop_token_ids})),
            pad_token_id=pad_token_id,
        )


torch.serialization.add_safe_globals([SamplingSettings])  # a hyperparameter in checkpoints (weights_only loads)


@dataclass
class Rollout:
    """One sampled completion.

    Attributes:
        prompt_ids: The prompt's token ids.
        response_ids: The completion's token ids (ending with the stop token when one came).
        finish_reason: ``stop`` (a stop token), ``length`` (``max_new_tokens`` reached) or ``abort``.
        logprobs: The engine's log-probability of each response token (``None`` when the engine gives none).
        seconds: Wall time of the generation call that produced it.
    """

    prompt_ids: list[int]
    response_ids: list[int]
    finish_reason: FinishReason
    logprobs: list[float] | None = None
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


class RolloutEngine(ABC):
    """Samples completions with the policy's current weights."""

    @abstractmethod
    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingSettings, stop_token_ids: Sequence[int] = ()
    ) -> list[Rollout]:
        """One completion per prompt, in order (repeat a prompt to get several)."""

    def sync_weights(self, model: torch.nn.Module) -> None:  # noqa: B027 (optional hook: nothing to do by default)
        """Make the engine sample from ``model``'s current weights (after each optimizer step)."""

    def state_dict(self) -> dict[str, Any]:
        """What resumes the engine exactly (its random state)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027 (optional hook: nothing to do by default)
        """Restore :meth:`state_dict`."""


class LocalRolloutEngine(RolloutEngine):
    """xtl's cached sampler on the policy itself, batched across prompts.

    Under sharded parameters every rank must run the same forwards: decoding goes on until every rank's sequences
    have stopped (``group``).

    Args:
        model: The policy (an xtl model; read at each call, so it is always the current weights).
        max_batch: Prompts decoded together at most.
        group: The ranks that decode in lockstep (``None``: this process alone).
    """

    def __init__(self, model: torch.nn.Module, max_batch: int = 256, group: dist.ProcessGroup | None = None) -> None:
        self.model = model
        self.max_batch = max_batch
        self.group = group
        self._generator: torch.Generator | None = None
        self._seed: int | None = None

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingSettings, stop_token_ids: Sequence[int] = ()
    ) -> list[Rollout]:
        """Sample one completion per prompt, ``max_batch`` prompts at a time."""
        config = sampling.generation_config(stop_token_ids)
        generator = self._generator_for(sampling.seed)
        rollouts: list[Rollout] = []
        for start in range(0, len(prompts), self.max_batch):
            chunk = [list(p) for p in prompts[start : start + self.max_batch]]
            began = time.perf_counter()
            out = generate(self.model, chunk, config, generator, group=self.group).sequences
            seconds = time.perf_counter() - began
            for prompt, response in zip(chunk, out, strict=True):
                stopped = bool(response) and response[-1] in config.stop_token_ids
                rollouts.append(Rollout(prompt, response, "stop" if stopped else "length", seconds=seconds))
        return rollouts

    def state_dict(self) -> dict[str, Any]:
        """The sampling generator's state."""
        return {} if self._generator is None else {"seed": self._seed, "rng": self._generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the sampling generator."""
        if state:
            self._generator_for(int(state["seed"])).set_state(state["rng"])

    def _generator_for(self, seed: int) -> torch.Generator:
        if self._generator is None or self._seed != seed:
            device = next(self.model.parameters()).device
            self._generator = torch.Generator(device=device).manual_seed(seed)
            self._seed = seed
        return self._generator
