"""Rollout engines: what samples completions of prompts for RL.

A :class:`RolloutEngine` turns prompt token ids into :class:`Rollout` s under a :class:`SamplingSettings` and
follows the policy: :meth:`RolloutEngine.sync_weights` is called after every optimizer step. The embedded default,
:class:`LocalRolloutEngine`, is xtl's cached sampler (:func:`xtl.train.generation.generate`) on the policy itself
(so it always runs the current weights and needs no sync), batched across prompts. :class:`VLLMRolloutEngine`
(``pip install vllm``, GPU) drives a vLLM engine instead: it pushes the policy's weights after each update and
returns the sampling log-probabilities.

A vision-language policy's prompts come with their images (:class:`~xtl.rl.vision.PromptImages`, one entry per prompt):
the local engine runs them through the vision tower in the prefill and decodes at the M-RoPE positions after them;
the vLLM engine passes them as ``multi_modal_data``.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal

import torch
import torch.distributed as dist

from xtl.errors import ConfigError
from xtl.rl.vision import PromptImages, collapse_placeholders
from xtl.train.generation import GenerationConfig, generate

KEY = "model.init_args.sampling"

FinishReason = Literal["stop", "length", "abort"]


@dataclass
class SamplingSettings(GenerationConfig):
    """How completions are sampled: a :class:`~xtl.train.generation.GenerationConfig` (its fields, its checks) with
    RL's group size, sampling at temperature 1 with 64 new tokens by default.

    Args:
        group_size: Completions per prompt (the group advantages are computed over).
        temperature: Sampling temperature (> 0: RL samples).
        max_new_tokens: Tokens per completion at most (a completion cut there finishes with ``length``).
        **fields: The other :class:`~xtl.train.generation.GenerationConfig` fields: ``top_p``, ``top_k``, ``seed``,
            ``stop_token_ids`` (extra stop tokens: the tokenizer's and the template's are always added), ...

    Raises:
        ConfigError: Naming the first setting out of range (``model.init_args.sampling.<field>``).
    """

    temperature: float = 1.0
    max_new_tokens: int = 64
    group_size: int = 8

    def __post_init__(self) -> None:
        if self.group_size < 2:
            raise ConfigError(
                f"{KEY}.group_size must be >= 2 (advantages compare completions of a prompt), got {self.group_size}"
            )
        if self.temperature <= 0:
            raise ConfigError(f"{KEY}.temperature must be > 0 for sampling, got {self.temperature}")
        try:
            super().__post_init__()
        except ValueError as err:  # GenerationConfig's messages start with the field's name
            raise ConfigError(f"{KEY}.{err}") from err

    def generation_config(self, stop_token_ids: Iterable[int] = ()) -> GenerationConfig:
        """The plain :class:`~xtl.train.generation.GenerationConfig` of these settings (what
        :func:`~xtl.train.generation.generate` takes), with ``stop_token_ids`` added."""
        decoding = {f.name: getattr(self, f.name) for f in fields(GenerationConfig)}
        stop = tuple(sorted({*self.stop_token_ids, *stop_token_ids}))
        return GenerationConfig(**{**decoding, "stop_token_ids": stop})


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
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingSettings,
        stop_token_ids: Sequence[int] = (),
        images: Sequence[PromptImages | None] | None = None,
    ) -> list[Rollout]:
        """One completion per prompt, in order (repeat a prompt to get several); ``images``: each prompt's images
        (a vision-language policy; passed only when some prompt has images)."""

    def sync_weights(self, model: torch.nn.Module) -> None:  # noqa: B027 (optional hook: nothing to do by default)
        """Make the engine sample from ``model``'s current weights (after each optimizer step)."""

    def idle_step(  # noqa: B027 (optional hook: only engines whose ranks decode in lockstep act)
        self, sampling: SamplingSettings, stop_token_ids: Sequence[int] = ()
    ) -> None:
        """Take part in one generation call of the other ranks without prompts of its own (a multi-turn loop whose
        trajectories on this rank have all finished: sharded parameters need every rank in each forward)."""

    def state_dict(self) -> dict[str, Any]:
        """What resumes the engine exactly (its random state)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027 (optional hook: nothing to do by default)
        """Restore :meth:`state_dict`."""


class DetachedEngine(RolloutEngine):
    """An engine that samples in other processes with its own copy of the weights (Ray actors): it can sample while
    the trainer updates (asynchronous rollouts), with weights handed over as snapshots. :meth:`snapshot` runs on the
    trainer's thread (it reads the policy), :meth:`adopt` on the producer's."""

    @abstractmethod
    def snapshot(self, model: torch.nn.Module) -> Any:
        """A copy of ``model``'s current weights the engine can adopt later (the policy may change meanwhile)."""

    @abstractmethod
    def adopt(self, snapshot: Any) -> None:
        """Sample with the weights of ``snapshot`` from now on."""

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Sample with ``model``'s current weights: adopt a snapshot of them."""
        self.adopt(self.snapshot(model))


class LocalRolloutEngine(RolloutEngine):
    """xtl's cached sampler on the policy itself, batched across prompts.

    Under sharded parameters every rank must run the same forwards: decoding goes on until every rank's sequences
    have stopped (``group``).

    Args:
        model: The policy (an xtl model; read at each call, so it is always the current weights).
        max_batch: Prompts decoded together at most.
        group: The ranks that decode in lockstep (``None``: this process alone).
        logprobs: Return each token's log-probability at the sampling temperature (an engine whose weights may lag
            the policy's, e.g. a Ray actor's copy: the trainer weighs each token by the ratio of its own to these).
        filler: A sharded vision-language policy's image filler (:meth:`~xtl.rl.vision.PromptVision.filler`): a
            call whose prompts have no image decodes it beside them, and the idle step decodes it alone, so that every
            rank's prefill runs the vision tower.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        max_batch: int = 256,
        group: dist.ProcessGroup | None = None,
        logprobs: bool = False,
        filler: tuple[list[int], PromptImages] | None = None,
    ) -> None:
        self.model = model
        self.max_batch = max_batch
        self.group = group
        self.logprobs = logprobs
        self.filler = filler
        self._generator: torch.Generator | None = None
        self._seed: int | None = None

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingSettings,
        stop_token_ids: Sequence[int] = (),
        images: Sequence[PromptImages | None] | None = None,
    ) -> list[Rollout]:
        """Sample one completion per prompt, ``max_batch`` prompts at a time (with their images)."""
        config = sampling.generation_config(stop_token_ids)
        generator = self._generator_for(sampling.seed)
        rollouts: list[Rollout] = []
        for start in range(0, len(prompts), self.max_batch):
            chunk = [list(p) for p in prompts[start : start + self.max_batch]]
            decoded, pixels = self._with_filler(chunk, _model_images(images, start, len(chunk)))
            began = time.perf_counter()
            out = generate(
                self.model, decoded, config, generator, group=self.group, output_logprobs=self.logprobs, images=pixels
            )
            seconds = time.perf_counter() - began
            logprobs = out.logprobs[: len(chunk)] or [None] * len(chunk)  # the filler's row (last) dropped
            for prompt, response, scored in zip(chunk, out.sequences[: len(chunk)], logprobs, strict=True):
                stopped = bool(response) and response[-1] in config.stop_token_ids
                rollouts.append(Rollout(prompt, response, "stop" if stopped else "length", scored, seconds))
        return rollouts

    def idle_step(self, sampling: SamplingSettings, stop_token_ids: Sequence[int] = ()) -> None:
        """Decode a filler that ends at once, in lockstep with the group's ranks until they finish."""
        if self.group is None:
            return
        config = sampling.generation_config(stop_token_ids)
        filler, pixels = self._with_filler([], None)
        if not filler:
            filler = [[config.stop_token_ids[0] if config.stop_token_ids else 0]]
        generate(self.model, filler, config, self._generator_for(sampling.seed), group=self.group,
                 stop_when=lambda rows: [True] * len(rows), images=pixels)  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """The sampling generator's state."""
        return {} if self._generator is None else {"seed": self._seed, "rng": self._generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the sampling generator."""
        if state:
            self._generator_for(int(state["seed"])).set_state(state["rng"])

    def _with_filler(
        self, prompts: list[list[int]], pixels: list[dict[str, torch.Tensor] | None] | None
    ) -> tuple[list[list[int]], list[dict[str, torch.Tensor] | None] | None]:
        """``prompts`` and their images, with the image filler appended when none has an image (its output is
        dropped: :func:`~xtl.train.generation.generate` returns one row per prompt, the filler's last)."""
        if self.filler is None or (pixels is not None and any(entry is not None for entry in pixels)):
            return prompts, pixels
        ids, images = self.filler
        return [*prompts, list(ids)], [*(pixels or [None] * len(prompts)), images.inputs]

    def _generator_for(self, seed: int) -> torch.Generator:
        if self._generator is None or self._seed != seed:
            device = next(self.model.parameters()).device
            self._generator = torch.Generator(device=device).manual_seed(seed)
            self._seed = seed
        return self._generator


class GreedyEngine(LocalRolloutEngine):
    """xtl's cached sampler decoding greedily (the held-out evaluation of an agent loop): the sampling settings' budget
    and stop tokens, not their temperature."""

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingSettings,
        stop_token_ids: Sequence[int] = (),
        images: Sequence[PromptImages | None] | None = None,
    ) -> list[Rollout]:
        """The greedy completion of each prompt."""
        greedy = GenerationConfig(
            max_new_tokens=sampling.max_new_tokens,
            stop_token_ids=tuple(sorted({*sampling.stop_token_ids, *stop_token_ids})),
        )
        out = []
        if prompts:
            decoded, pixels = self._with_filler([list(p) for p in prompts], _model_images(images, 0, len(prompts)))
            out = generate(self.model, decoded, greedy, group=self.group, images=pixels).sequences[: len(prompts)]
        stop = set(greedy.stop_token_ids)
        return [
            Rollout(list(p), r, "stop" if r and r[-1] in stop else "length") for p, r in zip(prompts, out, strict=True)
        ]


@dataclass
class VLLMSettings:
    """The vLLM engine of :class:`VLLMRolloutEngine` (``pip install vllm``; a GPU).

    Args:
        gpu_memory_utilization: Share of the GPU's memory vLLM takes (weights, KV cache), beside training.
        tensor_parallel_size: GPUs one engine spans.
        max_model_len: Longest prompt + completion (``None``: the model's).
        enable_sleep_mode: Free vLLM's memory between rollouts (woken before each generation).
        dtype: The engine's weight dtype.
    """

    gpu_memory_utilization: float = 0.3
    tensor_parallel_size: int = 1
    max_model_len: int | None = None
    enable_sleep_mode: bool = False
    dtype: str = "bfloat16"


torch.serialization.add_safe_globals([VLLMSettings])  # a hyperparameter in checkpoints (weights_only loads)


class VLLMRolloutEngine(RolloutEngine):
    """A vLLM engine in this process (colocated with training) that samples with the policy's weights.

    :meth:`sync_weights` streams the policy's parameters, under their Hugging Face names (gathered whole from their
    shards), into the engine after every optimizer step and resets its prefix cache. Each rollout carries vLLM's
    log-probability of its tokens, after temperature and top-k/top-p (``logprobs_mode="processed_logprobs"``), so the
    trainer can correct for the numeric gap between engine and trainer (truncated importance sampling).

    A prompt with images is sent as vLLM expects a multimodal token prompt (as TRL's GRPO does): one
    ``<|image_pad|>`` per image (each run of placeholders cut to one: vLLM expands them itself) and the decoded
    images as ``multi_modal_data``; the rollout keeps xtl's expanded ids. When vLLM reports its expanded prompt, it
    must equal xtl's (the same image settings), else the rollout would train on other positions than it sampled at.

    Args:
        model_path: The policy's HF directory (the engine starts from it).
        settings: Engine settings.
        seed: Sampling seed.
        llm: An engine to use instead of starting one (any object with vLLM's ``LLM.generate`` and the weight
            loader: tests pass a stand-in).
        params_class: What builds the sampling parameters (default ``vllm.SamplingParams``).
        image_token_id: The ``<|image_pad|>`` id of a vision-language policy (``None``: prompts have no images).
    """

    def __init__(
        self,
        model_path: str,
        settings: VLLMSettings | None = None,
        seed: int = 0,
        llm: Any = None,
        params_class: Any = None,
        image_token_id: int | None = None,
    ) -> None:
        self.settings = settings or VLLMSettings()
        self.seed = seed
        self.image_token_id = image_token_id
        self._calls = 0
        self.llm = llm if llm is not None else self._start(model_path)
        self._params_class = params_class

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingSettings,
        stop_token_ids: Sequence[int] = (),
        images: Sequence[PromptImages | None] | None = None,
    ) -> list[Rollout]:
        """Sample one completion per prompt with vLLM (seeded per call, so a resumed run samples the same).

        Raises:
            ConfigError: Images without the policy's image token id.
            RuntimeError: vLLM expanded a prompt's images to other placeholders than xtl did.
        """
        if self.settings.enable_sleep_mode:
            self.llm.wake_up()
        params = self._sampling_params(sampling, stop_token_ids)
        entries = list(images) if images is not None else [None] * len(prompts)
        requests = [self.request(p, entry) for p, entry in zip(prompts, entries, strict=True)]
        began = time.perf_counter()
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        seconds = time.perf_counter() - began
        self._calls += 1
        rollouts = []
        for prompt, entry, output in zip(prompts, entries, outputs, strict=True):
            expanded = output.prompt_token_ids  # what vLLM ran: with images, its own expansion of the placeholders
            if entry is not None and expanded is not None and list(expanded) != list(prompt):
                raise RuntimeError(
                    f"vLLM expanded the images of a prompt to {len(expanded)} tokens, xtl to {len(prompt)}: give vLLM "
                    "the image settings of data.image_processor (the policy directory's preprocessor_config.json)"
                )
            completion = output.outputs[0]
            ids = list(completion.token_ids)
            logprobs = [float(step[token].logprob) for step, token in zip(completion.logprobs or [], ids, strict=True)]
            reason = {"stop": "stop", "length": "length"}.get(str(completion.finish_reason), "abort")
            rollouts.append(Rollout(list(prompt), ids, reason, logprobs if completion.logprobs else None, seconds))
        if self.settings.enable_sleep_mode:
            self.llm.sleep(level=1)
        return rollouts

    def request(self, prompt: Sequence[int], images: PromptImages | None = None) -> dict[str, Any]:
        """The vLLM prompt of ``prompt``: its token ids, or with images one placeholder per image and the decoded
        images as ``multi_modal_data`` (the class docstring).

        Raises:
            ConfigError: Images without the policy's image token id.
        """
        if images is None:
            return {"prompt_token_ids": list(prompt)}
        if self.image_token_id is None:
            raise ConfigError(
                "model.init_args.engine: prompts with images need the vLLM engine of a vision-language policy"
            )
        from xtl.data.multimodal import load_image

        return {
            "prompt_token_ids": collapse_placeholders(prompt, self.image_token_id),
            "multi_modal_data": {"image": [load_image(path, "<prompt>") for path in images.paths]},
        }

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Stream ``model``'s weights (HF names, whole tensors) into the engine, then reset its prefix cache."""
        loader = self.llm.llm_engine.model_executor.driver_worker.model_runner.model
        for name, tensor in hf_named_tensors(model):
            loader.load_weights([(name, tensor)])
        self.llm.reset_prefix_cache()

    def state_dict(self) -> dict[str, Any]:
        """The generation calls made (each call's seed derives from it)."""
        return {"calls": self._calls}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self._calls = int(state.get("calls", 0))

    def _sampling_params(self, sampling: SamplingSettings, stop_token_ids: Sequence[int]) -> Any:
        if self._params_class is None:
            from vllm import SamplingParams

            self._params_class = SamplingParams
        return self._params_class(
            n=1,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else -1,
            max_tokens=sampling.max_new_tokens,
            stop_token_ids=sorted({*sampling.stop_token_ids, *stop_token_ids}),
            logprobs=0,
            seed=sampling.seed * 1_000_003 + self._calls,
        )

    def _start(self, model_path: str) -> Any:
        try:
            from vllm import LLM
        except ImportError as err:
            raise ImportError("the vllm rollout engine needs vLLM on a GPU machine: pip install vllm") from err
        settings = self.settings
        return LLM(
            model=model_path,
            tensor_parallel_size=settings.tensor_parallel_size,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            max_model_len=settings.max_model_len,
            enable_sleep_mode=settings.enable_sleep_mode,
            dtype=settings.dtype,
            seed=self.seed,
            distributed_executor_backend="external_launcher",
            logprobs_mode="processed_logprobs",
        )


def hf_named_tensors(model: torch.nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    """``(HF name, whole tensor)`` of every weight of an xtl model, tied weights once (sharded ones gathered)."""
    from torch.distributed.tensor import DTensor

    for key, tensor in model.checkpoint_tensors().items():
        whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        yield from zip(model.hf_keys(key), model.param_to_hf(key, whole.detach()), strict=True)


def _model_images(
    images: Sequence[PromptImages | None] | None, start: int, count: int
) -> list[dict[str, torch.Tensor] | None] | None:
    """What :func:`~xtl.train.generation.generate` reads of the images of prompts ``start .. start + count``."""
    if images is None:
        return None
    return [None if entry is None else entry.inputs for entry in images[start : start + count]]
