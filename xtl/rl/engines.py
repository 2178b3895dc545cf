"""Which rollout engine a run samples with: its settings (``model.init_args.engine``) and :func:`start_engine`, which
starts it or refuses what it cannot run.

- ``local``: xtl's cached sampler on the policy itself (:class:`~xtl.rl.LocalRolloutEngine`), in lockstep across
  the ranks when parameters are sharded;
- ``vllm``: a colocated vLLM engine (:class:`~xtl.rl.VLLMRolloutEngine`; a GPU, ``pip install vllm``);
- ``ray``: Ray actors (:class:`~xtl.rl.remote.RayRolloutEngine`, ``pip install ray``), each with a copy of the policy.

The last two start from the policy's HF directory and take whole weights before each rollout batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import torch
import torch.distributed as dist

from xtl.errors import ConfigError
from xtl.rl.rollout import LocalRolloutEngine, RolloutEngine, VLLMRolloutEngine, VLLMSettings
from xtl.rl.vision import PromptImages

KEY = "model.init_args.engine"
EngineName = Literal["local", "vllm", "ray"]
ENGINES: tuple[str, ...] = get_args(EngineName)


@dataclass
class EngineSettings:
    """The rollout engine (``model.init_args.engine``).

    Args:
        name: ``local``, ``vllm`` or ``ray`` (module docstring).
        vllm: The vLLM engine's settings (``name: vllm``).
        ray: The Ray engine's settings (``name: ray``): ``num_actors``, ``actor_options``, ``address``, ``device``;
            each actor samples with xtl's cached sampler on its copy of the policy.
        importance_sampling_cap: With an engine that returns log-probabilities (vLLM), each token's policy term is
            weighted by ``min(exp(old - engine log-prob), cap)`` (truncated importance sampling: the trainer's and
            the engine's numerics differ).

    Raises:
        ConfigError: An unknown engine, settings of another engine, a cap below 1.
    """

    name: EngineName = "local"
    vllm: VLLMSettings = field(default_factory=VLLMSettings)
    ray: dict[str, Any] = field(default_factory=dict)
    importance_sampling_cap: float = 2.0

    def __post_init__(self) -> None:
        if self.name not in ENGINES:
            raise ConfigError(f"{KEY}.name must be one of {', '.join(ENGINES)}, got {self.name!r}")
        if self.ray and self.name != "ray":
            raise ConfigError(f"{KEY}.ray: settings of the ray engine, but name is {self.name}; remove them")
        if isinstance(self.importance_sampling_cap, bool) or self.importance_sampling_cap < 1:
            raise ConfigError(f"{KEY}.importance_sampling_cap must be >= 1, got {self.importance_sampling_cap}")
        self.ray = dict(self.ray)


torch.serialization.add_safe_globals([EngineSettings])  # a hyperparameter in checkpoints (weights_only loads)


def start_engine(
    settings: EngineSettings,
    model: torch.nn.Module,
    hf_dir: str | Path | None,
    device: torch.device,
    seed: int = 0,
    group: dist.ProcessGroup | None = None,
    logprobs: bool = False,
    image_token_id: int | None = None,
    filler: tuple[list[int], PromptImages] | None = None,
) -> RolloutEngine:
    """Start the engine ``settings`` name for the policy ``model``.

    Args:
        settings: The engine's settings.
        model: The policy (an xtl model).
        hf_dir: The policy's HF directory (where ``vllm`` and ``ray`` start from).
        device: The policy's device.
        seed: The vLLM engine's sampling seed (this rank's).
        group: The ranks that decode in lockstep with the local engine (sharded parameters; ``None``: this rank).
        logprobs: The local engine returns each token's log-probability (partial rollouts: a completion continued
            under newer weights keeps those of the weights that sampled its first tokens). The other engines always
            do.
        image_token_id: A vision-language policy's ``<|image_pad|>`` id (the vLLM engine sends each image as one
            placeholder, which vLLM expands itself).
        filler: A sharded vision-language policy's image filler for the local engine
            (:class:`~xtl.rl.LocalRolloutEngine`'s ``filler``).

    Raises:
        ConfigError: ``vllm`` or ``ray`` without an HF directory or when the run trains adapters such as LoRA's
            (they sync whole weights); ``vllm`` without a GPU.
    """
    name = settings.name
    if name == "local":
        return LocalRolloutEngine(model, group=group, logprobs=logprobs, filler=filler)
    if hf_dir is None:
        raise ConfigError(f"{KEY}.name: {name} starts from an HF model directory: set model.init_args.model to one")
    if model.adapter_tensors():
        raise ConfigError(
            f"{KEY}.name: {name} syncs whole weights, not the adapters (LoRA) this run trains: use local"
        )
    if name == "ray":
        from xtl.rl.remote import RayRolloutEngine

        return RayRolloutEngine(str(hf_dir), **settings.ray)
    if torch.device(device).type != "cuda":
        raise ConfigError(f"{KEY}.name: vllm needs a GPU (trainer.accelerator: gpu); use local")
    return VLLMRolloutEngine(str(hf_dir), settings.vllm, seed=seed, image_token_id=image_token_id)
