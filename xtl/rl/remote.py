"""Rollout and judging as Ray actors, for runs that spread them over machines (``pip install ray``).

The in-process engine and judgers are the default; these wrap them behind the same interfaces:

- :class:`RayJudger` is a judger whose states are judged by ``num_actors`` Ray actors, each holding its own copy
  of the wrapped judger (its time-outs apply inside the actor; an actor that dies fails its states, not the run).
- :class:`RayRolloutEngine` samples with ``num_actors`` actors, each running xtl's cached sampler on its own copy
  of the policy (built from the policy's HF directory). :meth:`RayRolloutEngine.sync_weights` puts the policy's
  weights in Ray's object store once and has every actor load them; each actor's random state is part of the
  engine's state, so a resumed run samples what the uninterrupted one would.

``address`` connects to a running cluster (``ray start --head`` on one machine, ``ray start --address ...`` on the
others); without it a local Ray instance is started in this process.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import torch

from xtl.rl.judger import BaseJudger, RolloutState
from xtl.rl.rollout import DetachedEngine, LocalRolloutEngine, Rollout, SamplingSettings, hf_named_tensors
from xtl.rl.vision import PromptImages


class RayJudger(BaseJudger):
    """Judge on Ray actors.

    Args:
        judger: The judger each actor runs (any :class:`~xtl.rl.BaseJudger`; pickled to the actors).
        num_actors: Actors the states are spread over (round robin).
        actor_options: Ray actor options (``num_cpus``, ``resources``, ...).
        address: The Ray cluster to join (``None``: the running one, or a local one).
    """

    def __init__(
        self,
        judger: BaseJudger,
        num_actors: int = 2,
        actor_options: dict[str, Any] | None = None,
        address: str | None = None,
    ) -> None:
        if num_actors < 1:
            raise ValueError(f"num_actors must be >= 1, got {num_actors}")
        self.judger = judger
        self.num_actors = num_actors
        self.actor_options = dict(actor_options or {"num_cpus": 0})
        self.address = address
        self._actors: list[Any] = []

    async def batch_judge(self, states: Sequence[RolloutState]) -> list[RolloutState]:
        """Judge ``states`` on the actors; write each result back into its state."""
        actors = self._start()
        shares = [list(range(i, len(states), len(actors))) for i in range(len(actors))]
        calls = [actor.judge.remote([states[i] for i in share]) for actor, share in zip(actors, shares) if share]
        results = await asyncio.gather(*calls, return_exceptions=True)
        for share, result in zip([s for s in shares if s], results, strict=True):
            for i, judged in zip(share, result if isinstance(result, list) else [result] * len(share), strict=True):
                state = states[i]
                if isinstance(judged, BaseException):
                    state.status, state.reward, state.error = "failed", None, f"judger actor: {judged}"
                else:
                    state.reward, state.status, state.error = judged.reward, judged.status, judged.error
        return list(states)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped judger's state (the actors hold copies of it)."""
        return self.judger.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the wrapped judger's state (the actors are started from it)."""
        self.judger.load_state_dict(state)

    def _start(self) -> list[Any]:
        if not self._actors:
            ray = _ray(self.address)
            actor = ray.remote(_JudgerActor).options(**self.actor_options)
            self._actors = [actor.remote(self.judger) for _ in range(self.num_actors)]
        return self._actors


class RayRolloutEngine(DetachedEngine):
    """Sample on Ray actors, each running xtl's cached sampler on a copy of the policy.

    Args:
        model_path: The policy's HF directory (each actor builds its copy from it).
        num_actors: Actors the prompts are spread over (contiguous shares, in order).
        actor_options: Ray actor options (``num_cpus``, ``num_gpus``, ``resources``, ...).
        address: The Ray cluster to join (``None``: the running one, or a local one).
        device: Where each actor runs its copy (``cpu``, ``cuda``).
        num_threads: Torch threads of each actor (intra-op parallelism of its sampler on the CPU).
    """

    def __init__(
        self,
        model_path: str,
        num_actors: int = 1,
        actor_options: dict[str, Any] | None = None,
        address: str | None = None,
        device: str = "cpu",
        num_threads: int = 1,
    ) -> None:
        if num_actors < 1:
            raise ValueError(f"num_actors must be >= 1, got {num_actors}")
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        ray = _ray(address)
        actor = ray.remote(_SamplerActor).options(**dict(actor_options or {"num_cpus": 1}))
        self._ray = ray
        self.actors = [actor.remote(str(model_path), device, num_threads) for _ in range(num_actors)]

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingSettings,
        stop_token_ids: Sequence[int] = (),
        images: Sequence[PromptImages | None] | None = None,
    ) -> list[Rollout]:
        """Split ``prompts`` (and their images) over the actors (actor ``i`` samples with seed
        ``sampling.seed + i``), in order."""
        size = -(-len(prompts) // len(self.actors))
        shares = [list(prompts[i * size : (i + 1) * size]) for i in range(len(self.actors))]
        pictures = [None if images is None else list(images[i * size : (i + 1) * size]) for i in range(len(shares))]
        refs = [
            actor.generate.remote(share, _with_seed(sampling, sampling.seed + i), list(stop_token_ids), pictures[i])
            for i, (actor, share) in enumerate(zip(self.actors, shares, strict=True))
            if share
        ]
        return [r for part in self._ray.get(refs) for r in part]

    def snapshot(self, model: torch.nn.Module) -> Any:
        """Put the policy's weights (HF names, whole tensors, copied to the CPU) in the object store once."""
        return self._ray.put({name: t.detach().cpu() for name, t in hf_named_tensors(model)})  # copied by put

    def adopt(self, snapshot: Any) -> None:
        """Every actor loads the weights of ``snapshot``."""
        self._ray.get([actor.load.remote(snapshot) for actor in self.actors])

    def state_dict(self) -> dict[str, Any]:
        """Each actor's sampler state."""
        return {"actors": self._ray.get([actor.state_dict.remote() for actor in self.actors])}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore each actor's sampler state."""
        for actor, actor_state in zip(self.actors, state.get("actors", []), strict=False):
            self._ray.get(actor.load_state_dict.remote(actor_state))


def load_hf_named_tensors(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy HF-named whole tensors (:func:`~xtl.rl.rollout.hf_named_tensors`) into an unsharded xtl model."""
    owned = model.checkpoint_tensors()
    with torch.no_grad():
        for key, param in owned.items():
            value = model.hf_to_param(key, [tensors[name] for name in model.hf_keys(key)])
            param.copy_(value.to(param.dtype))


# ---- private ---------------------------------------------------------------------------------------------------


class _JudgerActor:
    def __init__(self, judger: BaseJudger) -> None:
        self.judger = judger

    def judge(self, states: list[RolloutState]) -> list[RolloutState]:
        return self.judger.judge_sync(states)


class _SamplerActor:
    def __init__(self, model_path: str, device: str, num_threads: int) -> None:
        from xtl.train.model_spec import resolve_model_config

        torch.set_num_threads(num_threads)
        config, hf_dir = resolve_model_config(model_path, None)
        with torch.device("meta"):
            model = config.build()
        model.from_hf(hf_dir, device=device)
        # behavior log-probabilities: the actor's copy lags the policy by up to max_staleness versions
        self.engine = LocalRolloutEngine(model.float() if device == "cpu" else model, logprobs=True)

    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingSettings,
        stop: list[int],
        images: list[PromptImages | None] | None = None,
    ) -> list[Rollout]:
        return self.engine.generate(prompts, sampling, stop, images)

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        load_hf_named_tensors(self.engine.model, tensors)

    def state_dict(self) -> dict[str, Any]:
        return self.engine.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.engine.load_state_dict(state)


def _with_seed(sampling: SamplingSettings, seed: int) -> SamplingSettings:
    from dataclasses import replace

    return replace(sampling, seed=seed)


def _ray(address: str | None) -> Any:
    try:
        import ray
    except ImportError as err:
        raise ImportError("Ray rollout and judging need Ray: pip install 'xtl[ray]' (or pip install ray)") from err
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    return ray
