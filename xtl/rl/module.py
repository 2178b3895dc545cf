"""RL with rollouts and judgers: :class:`GRPOModule` trains any text family with GRPO, Dr.GRPO, DAPO or GSPO.

One ``training_step`` is one optimizer step. When no update is pending, the module produces a rollout batch
(:func:`xtl.rl.buffer.produce_batch`): ``prompts_per_step`` prompts per rank from the :class:`PromptDataModule`,
``sampling.group_size`` completions each from the rollout engine (xtl's cached sampler on the policy), judged,
shaped (DAPO's overlong penalty), filtered (dynamic sampling), and turned into group-relative advantages. The
policy's log-probabilities of the batch are computed then, once (the *old* log-probabilities of the importance
ratio; with the reference's when ``objective.beta > 0``), and the batch is cut into ``mini_batches`` updates, run
``epochs`` times: that many optimizer steps per rollout batch, each a ``training_step``. Pending updates and
leftover groups are part of the checkpoint, with the sampler's random state and the prompt order, so a resumed
run takes exactly the steps the uninterrupted one would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_info

from xtl.batch import SequenceContext
from xtl.data.collate import MicroBatch, collate_pack
from xtl.data.item import IGNORE_INDEX
from xtl.data.packing import Pack
from xtl.errors import ConfigError
from xtl.model import BaseModel, ModelOutput
from xtl.module.lora import adapters_disabled, lora_layers
from xtl.rl.buffer import Group, ProduceStats, ReplayBuffer, SampleState, produce_batch
from xtl.rl.judger import BaseJudger, MathJudger, RolloutState
from xtl.rl.loss import PolicyLossConfig, group_advantages, overlong_penalty, policy_loss
from xtl.rl.rollout import LocalRolloutEngine, RolloutEngine, SamplingSettings, VLLMRolloutEngine, VLLMSettings
from xtl.train.base import LanguageModule
from xtl.train.generation import GenerationConfig, chat_prompt_ids, generate, split_thinking, stop_token_ids

ReferenceMode = Literal["auto", "live", "adapters_off", "none"]
POLICY_METRICS = ("clip_low", "clip_high", "clip_region", "ratio", "kl", "entropy")


@dataclass
class RLMicroBatch:
    """A packed micro-batch of prompt + completion sequences and what the policy loss needs of it.

    Attributes:
        batch: The packed sequences (labels on completion tokens only).
        positions: ``(N,)`` packed positions whose next token is a completion token.
        rows: ``(B, T)`` index into ``positions`` of each sequence's completion tokens (0 where ``mask`` is 0).
        mask: ``(B, T)`` 1 on completion tokens.
        advantages: ``(B,)`` per sequence.
        old_logps: ``(B, T)`` the sampling policy's log-probabilities (set once the batch is produced).
        ref_logps: ``(B, T)`` the reference's (with a KL term).
        num_items: This micro-batch's share of the loss normalizer.
        sampling_logps: ``(B, T)`` the rollout engine's log-probabilities (engines that return them, e.g. vLLM).
        routed_experts: Per MoE layer, the ``(N, k)`` experts its tokens went to when the old log-probabilities were
            computed (routing replay).
        sequences: ``(prompt ids, completion ids)`` of each sequence (what a checkpoint keeps).
    """

    batch: MicroBatch
    positions: torch.Tensor
    rows: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor
    old_logps: torch.Tensor | None = None
    ref_logps: torch.Tensor | None = None
    num_items: float = 0.0
    sampling_logps: torch.Tensor | None = None
    routed_experts: list[torch.Tensor] | None = None
    sequences: list[tuple[list[int], list[int]]] | None = None

    @property
    def seq_ctx(self) -> SequenceContext:
        """The packed batch's sequence context."""
        return self.batch.seq_ctx

    @property
    def num_real_tokens(self) -> int:
        """Tokens of the packed sequences."""
        return self.batch.num_real_tokens

    def to(self, device: torch.device | str) -> RLMicroBatch:
        """This micro-batch on ``device``."""
        move = {k: None if v is None else v.to(device) for k, v in self._tensors().items()}
        routed = None if self.routed_experts is None else [ids.to(device) for ids in self.routed_experts]
        return replace(self, batch=self.batch.to(device), routed_experts=routed, **move)

    def state(self) -> dict[str, Any]:
        """Plain data for a checkpoint: the sequences, advantages, log-probabilities and normalizer share."""
        return {
            "sequences": self.sequences or [],
            "advantages": self.advantages.cpu(),
            "old_logps": None if self.old_logps is None else self.old_logps.cpu(),
            "ref_logps": None if self.ref_logps is None else self.ref_logps.cpu(),
            "sampling_logps": None if self.sampling_logps is None else self.sampling_logps.cpu(),
            "routed_experts": None if self.routed_experts is None else [ids.cpu() for ids in self.routed_experts],
            "num_items": self.num_items,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> RLMicroBatch:
        """Rebuild a micro-batch from :meth:`state`."""
        mb = pack_sequences(state["sequences"], state["advantages"].tolist())
        mb.old_logps, mb.ref_logps, mb.num_items = state["old_logps"], state["ref_logps"], float(state["num_items"])
        mb.sampling_logps, mb.routed_experts = state.get("sampling_logps"), state.get("routed_experts")
        return mb

    def _tensors(self) -> dict[str, torch.Tensor | None]:
        names = ("positions", "rows", "mask", "advantages", "old_logps", "ref_logps", "sampling_logps")
        return {k: getattr(self, k) for k in names}


class GRPOModule(LanguageModule):
    """Group-relative policy optimization of any text family with rollouts and judgers.

    Args:
        model: The policy: HF directory, alias or config mapping (as :class:`~xtl.train.LanguageModule`).
        judger: Scores completions (default: :class:`~xtl.rl.MathJudger`); a ``class_path`` in YAML.
        sampling: Group size, temperature, top-p/top-k, max new tokens, stop tokens, seed.
        objective: The loss type, importance sampling level, clipping, KL weight and reward scaling.
        prompts_per_step: Prompts (groups) per rank in each rollout batch.
        mini_batches: Optimizer steps each rollout batch is cut into.
        epochs: Passes over each rollout batch (``epochs * mini_batches`` steps per batch).
        micro_batches: Packed micro-batches per rank in each optimizer step (the same on every rank).
        dynamic_sampling: DAPO: drop groups whose rewards are all equal and draw more prompts (``max_rounds``).
        max_rounds: Generation rounds per rollout batch at most.
        oversample: Each round draws this many times the missing prompts (above 1 with dynamic sampling, so one round
            usually brings enough groups; the surplus waits in the replay buffer for the next batch).
        max_staleness: Leftover groups train while at most this many steps older than the policy.
        overlong_buffer: DAPO's soft overlong punishment: the last ``overlong_buffer`` tokens before
            ``max_new_tokens`` lower the reward linearly to ``-overlong_penalty`` (``None``: off).
        overlong_penalty: See ``overlong_buffer``.
        reference: Where the KL term's reference comes from (``objective.beta > 0``): ``live`` (a frozen copy of the
            starting weights), ``adapters_off`` (the policy with its LoRA adapters off), ``auto`` (``none`` without a
            KL term, ``adapters_off`` under LoRA, else ``live``) or ``none``.
        eval_max_new_tokens: Greedy decoding budget of the held-out evaluation (default ``sampling.max_new_tokens``).
        engine: ``local`` (xtl's cached sampler on the policy) or ``vllm`` (:class:`~xtl.rl.VLLMRolloutEngine`:
            colocated vLLM, weights synced before each rollout batch; a GPU, ``pip install vllm``).
        vllm: The vLLM engine's settings.
        ray: ``engine: ray`` (:class:`~xtl.rl.remote.RayRolloutEngine`, ``pip install ray``): its settings
            (``num_actors``, ``actor_options``, ``address``, ``device``); each actor samples with xtl's cached sampler
            on its copy of the policy, weights synced before each rollout batch.
        importance_sampling_cap: With an engine that returns log-probabilities (vLLM), each token's policy term is
            weighted by ``min(exp(old - engine log-prob), cap)`` (truncated importance sampling: the trainer's and
            the engine's numerics differ).
        routing_replay: MoE policies: record the experts every token goes to in the forward that gives the old
            log-probabilities (at rollout time) and route the updates' forwards the same way, so the importance ratio
            compares the same experts (the first update's ratio is exactly 1 whatever the kernels) and routing
            changes do not count as policy changes. Refused for models without routed experts.
        **kwargs: :class:`~xtl.train.LanguageModule`'s settings (optimizer, schedule, clipping, routing, ...).

    Raises:
        ConfigError: Settings out of range, a reference the objective cannot use.
    """

    trains_mtp = False  # multi-token prediction belongs to next-token training

    def __init__(
        self,
        model: str | dict[str, Any],
        judger: BaseJudger | None = None,
        sampling: SamplingSettings = SamplingSettings(),
        objective: PolicyLossConfig = PolicyLossConfig(),
        prompts_per_step: int = 16,
        mini_batches: int = 1,
        epochs: int = 1,
        micro_batches: int = 1,
        dynamic_sampling: bool = False,
        max_rounds: int = 1,
        oversample: float = 1.0,
        max_staleness: int = 1,
        overlong_buffer: int | None = None,
        overlong_penalty: float = 1.0,
        reference: ReferenceMode = "auto",
        eval_max_new_tokens: int | None = None,
        engine: Literal["local", "vllm", "ray"] = "local",
        vllm: VLLMSettings | None = None,
        ray: dict[str, Any] | None = None,
        importance_sampling_cap: float = 2.0,
        routing_replay: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(model, **kwargs)
        self.save_hyperparameters(ignore=["judger"])  # an object (a function judger holds code): set by the config
        counts = {"prompts_per_step": prompts_per_step, "mini_batches": mini_batches, "epochs": epochs,
                  "micro_batches": micro_batches, "max_rounds": max_rounds}  # fmt: skip
        for name, value in counts.items():
            if value < 1:
                raise ConfigError(f"model.init_args.{name} must be >= 1, got {value}")
        if oversample < 1:
            raise ConfigError(f"model.init_args.oversample must be >= 1, got {oversample}")
        if mini_batches > prompts_per_step * sampling.group_size:
            raise ConfigError(
                f"model.init_args.mini_batches ({mini_batches}) exceeds the samples of a rollout batch "
                f"(prompts_per_step x group_size = {prompts_per_step * sampling.group_size})"
            )
        if reference == "none" and objective.beta > 0:
            raise ConfigError("model.init_args.reference: none, but objective.beta > 0 needs a reference; use auto")
        if overlong_buffer is not None and not 0 < overlong_buffer <= sampling.max_new_tokens:
            raise ConfigError(
                f"model.init_args.overlong_buffer must be in (0, sampling.max_new_tokens={sampling.max_new_tokens}], "
                f"got {overlong_buffer}"
            )
        if engine not in ("local", "vllm", "ray"):
            raise ConfigError(f"model.init_args.engine must be local, vllm or ray, got {engine!r}")
        if importance_sampling_cap < 1:
            raise ConfigError(f"model.init_args.importance_sampling_cap must be >= 1, got {importance_sampling_cap}")
        self.engine_name, self.vllm_settings, self.ray_settings = engine, vllm or VLLMSettings(), dict(ray or {})
        self.importance_sampling_cap = importance_sampling_cap
        self.routing_replay = routing_replay
        self._synced_step = -1
        self.judger = judger if judger is not None else MathJudger()
        self.sampling = sampling
        self.objective = objective
        self.prompts_per_step = prompts_per_step
        self.mini_batches, self.epochs, self.micro_batches = mini_batches, epochs, micro_batches
        self.dynamic_sampling, self.max_rounds, self.oversample = dynamic_sampling, max_rounds, oversample
        self.overlong_buffer, self.overlong_penalty = overlong_buffer, overlong_penalty
        self.reference_mode = reference
        self.eval_max_new_tokens = eval_max_new_tokens or sampling.max_new_tokens
        self.buffer = ReplayBuffer(max_staleness)
        self.engine: RolloutEngine | None = None
        self._reference: list[BaseModel] = []  # a list: not a submodule
        self._pending: list[list[RLMicroBatch]] = []
        self._rollout_metrics: dict[str, float] = {}
        self._engine_state: dict[str, Any] = {}
        self._eval: dict[int, list[float]] = {}

    # ---- model -----------------------------------------------------------------------------------------------

    @property
    def resolved_reference(self) -> str:
        """The reference mode in effect (``auto`` resolved once the model is built)."""
        if self.reference_mode != "auto":
            return self.reference_mode
        if self.objective.beta == 0:
            return "none"
        lora = self.model is not None and any(True for _ in lora_layers(self.model))
        return "adapters_off" if lora else "live"

    def configure_model(self) -> None:
        """Build the policy, then the reference the KL term needs."""
        if self.model is not None:
            return
        super().configure_model()
        self._reference = self.build_reference(self.resolved_reference)
        if self.routing_replay and not self.model.moe_blocks():
            raise ConfigError("model.init_args.routing_replay: the model has no routed experts to replay; remove it")

    def setup(self, stage: str) -> None:
        """Refuse what RL cannot run: context parallelism, data that is not prompts, models with images."""
        super().setup(stage)
        if self.parallelizer.layout.cp > 1:
            raise ConfigError(
                "GRPOModule generates whole sequences on each rank: set trainer.strategy.init_args."
                "context_parallel_size to 1"
            )
        if self.family.vision:
            raise ConfigError("GRPOModule trains text models; a vision-language policy is not supported yet")
        datamodule = getattr(self._trainer, "datamodule", None)
        if datamodule is not None and getattr(datamodule, "prompts", None) is None:
            raise ConfigError(
                "GRPOModule draws prompts from kind: prompt sources (rows with a prompt and an answer): set "
                "data.sources[*].kind: prompt"
            )

    def on_fit_start(self) -> None:
        """Start the rollout engine on the policy and say what trains."""
        self.engine = self._start_engine()
        self._synced_step = -1
        if self._engine_state:
            self.engine.load_state_dict(self._engine_state)
        objective = self.objective
        rank_zero_info(
            f"xtl rl: {objective.loss_type} ({objective.importance_sampling}-level ratio, clip "
            f"[{1 - objective.epsilon_low:g}, {1 + objective.epsilon_high:g}], beta {objective.beta}, reference "
            f"{self.resolved_reference}); {self.prompts_per_step} prompts x {self.sampling.group_size} completions "
            f"per rank and rollout batch, {self.epochs * self.mini_batches} optimizer step(s) each"
        )

    # ---- training --------------------------------------------------------------------------------------------

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """One optimizer step on the next pending update (producing a rollout batch first when none is left)."""
        if not self._pending:
            self._produce()
        update = [mb.to(self.device) for mb in self._pending.pop(0)]
        sums: list[dict[str, torch.Tensor]] = []

        def forward(mb: RLMicroBatch) -> ModelOutput:
            self._replay(mb.routed_experts)  # kept through the backward (a recomputing block routes the same)
            logps, entropy = self._token_logps(self.model, mb, with_entropy=True)
            weights = None
            if mb.sampling_logps is not None:  # truncated importance sampling: the engine's numerics are not ours
                weights = torch.exp(mb.old_logps - mb.sampling_logps).clamp(max=self.importance_sampling_cap)
            out = policy_loss(
                logps, mb.old_logps, mb.advantages, mb.mask, self.objective, mb.ref_logps,
                self.sampling.max_new_tokens, weights,
            )  # fmt: skip
            out.stats["entropy"] = (entropy * mb.mask).sum()
            sums.append(out.stats)
            return ModelOutput(loss_sum=out.loss_sum, num_tokens=None)

        try:
            result = self.optimizer_step_over(update, forward, lambda mb: mb.num_items)
        finally:
            self._replay(None)
        totals = self._sum_over_data_ranks(
            torch.stack(
                [sum(s.get(k, torch.zeros((), device=self.device)) for s in sums) for k in (*POLICY_METRICS, "tokens")]
            )
        )
        tokens = totals[-1].clamp(min=1)
        values = {f"train/{k}": totals[i] / tokens for i, k in enumerate(POLICY_METRICS)}
        values.update({k: torch.tensor(v) for k, v in self._rollout_metrics.items()})
        self.log_step_metrics(values)
        return result.loss_sum / result.global_tokens.clamp(min=1)

    # ---- evaluation ------------------------------------------------------------------------------------------

    def validation_step(self, batch: list[dict[str, Any]], batch_idx: int, dataloader_idx: int = 0) -> None:
        """Greedy answers to held-out prompts, judged: ``val/reward`` and ``val/exact_match``."""
        datamodule = self.trainer.datamodule
        tokenizer = datamodule.load_tokenizer()
        stop = stop_token_ids(tokenizer, datamodule.template)
        stop_ids = tuple(sorted({*self.sampling.stop_token_ids, *stop}))
        config = GenerationConfig(max_new_tokens=self.eval_max_new_tokens, stop_token_ids=stop_ids)  # greedy
        prompts = [self._render(row) for row in batch]
        group = self.parallelizer.data_group() if self.parallelizer.shards_parameters else None
        outputs = generate(self.model, prompts, config, group=group).sequences
        states, exact = [], []
        for row, out in zip(batch, outputs, strict=True):
            answer = split_thinking(tokenizer.decode([t for t in out if t not in stop]))[1]
            states.append(RolloutState(answer, row.get("answer"), row.get("data_source", "default"), row["prompt"]))
            exact.append(float(answer.strip() == str(row.get("answer", "")).strip()))
        rewards = [s.reward["score"] if s.reward else 0.0 for s in self.judger.judge_sync(states)]
        totals = self._eval.setdefault(dataloader_idx, [0.0, 0.0, 0.0])
        totals[0] += sum(rewards)
        totals[1] += sum(exact)
        totals[2] += len(batch)

    def on_validation_epoch_end(self) -> None:
        """Log ``val/reward`` and ``val/exact_match`` (``val/<set>/...`` with several sets)."""
        names = getattr(self.trainer.datamodule, "val_set_names", [])
        for idx, (reward, exact, count) in sorted(self._eval.items()):
            prefix = "val" if len(self._eval) == 1 else f"val/{names[idx] if idx < len(names) else idx}"
            self.log(f"{prefix}/reward", reward / max(count, 1), prog_bar=True)
            self.log(f"{prefix}/exact_match", exact / max(count, 1), prog_bar=True)
        self._eval = {}

    # ---- checkpoint ------------------------------------------------------------------------------------------

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Add the RL state of every rank (each has its own): pending updates, leftover groups, the sampler's random
        state, the judger's state. The ranks' states are gathered, since a sharded checkpoint keeps rank 0's
        non-tensor state only."""
        super().on_save_checkpoint(checkpoint)
        engine = self.engine.state_dict() if self.engine is not None else self._engine_state
        state = {
            "pending": [[mb.state() for mb in update] for update in self._pending],
            "buffer": self.buffer.state_dict(),
            "engine": engine,
            "judger": self.judger.state_dict(),
            "rollout_metrics": dict(self._rollout_metrics),
        }
        ranks = [state]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, state)
        checkpoint["xtl_rl"] = {"ranks": ranks}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Restore this rank's part of :meth:`on_save_checkpoint`'s RL state.

        Raises:
            ConfigError: The checkpoint was written by another number of processes.
        """
        super().on_load_checkpoint(checkpoint)
        ranks = checkpoint.get("xtl_rl", {}).get("ranks", [{}])
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if len(ranks) != world:
            raise ConfigError(
                f"the RL checkpoint holds the rollout state of {len(ranks)} process(es), this run has {world}: "
                "resume with the same trainer.devices and trainer.num_nodes"
            )
        state = ranks[dist.get_rank() if world > 1 else 0]
        self._pending = [[RLMicroBatch.from_state(mb) for mb in update] for update in state.get("pending", [])]
        self.buffer.load_state_dict(state.get("buffer", {}))
        self._engine_state = state.get("engine", {})
        if self.engine is not None:
            self.engine.load_state_dict(self._engine_state)
        self.judger.load_state_dict(state.get("judger", {}))
        self._rollout_metrics = dict(state.get("rollout_metrics", {}))

    # ---- private ---------------------------------------------------------------------------------------------

    def _start_engine(self) -> RolloutEngine:
        if self.engine_name == "local":
            group = self.parallelizer.data_group() if self.parallelizer.shards_parameters else None
            return LocalRolloutEngine(self.model, group=group)
        name = self.engine_name
        if self.hf_dir is None:
            raise ConfigError(f"model.init_args.engine: {name} starts from an HF model directory: set model to one")
        if any(True for _ in lora_layers(self.model)):
            raise ConfigError(f"model.init_args.engine: {name} syncs whole weights, not LoRA adapters: use local")
        if name == "ray":
            from xtl.rl.remote import RayRolloutEngine

            return RayRolloutEngine(str(self.hf_dir), **self.ray_settings)
        if self.device.type != "cuda":
            raise ConfigError("model.init_args.engine: vllm needs a GPU (trainer.accelerator: gpu); use engine: local")
        rank = self.trainer.datamodule.data_parallel_rank()[0]
        return VLLMRolloutEngine(str(self.hf_dir), self.vllm_settings, seed=self.sampling.seed + rank)

    def _render(self, row: dict[str, Any]) -> list[int]:
        datamodule = self.trainer.datamodule
        return chat_prompt_ids(
            datamodule.load_tokenizer(), row["prompt"], datamodule.template, datamodule.template_kwargs
        )

    def _produce(self) -> None:
        """Produce a rollout batch and cut it into the pending updates."""
        datamodule = self.trainer.datamodule
        tokenizer = datamodule.load_tokenizer()
        stop = stop_token_ids(tokenizer, datamodule.template)
        rank = datamodule.data_parallel_rank()[0]
        sampling = replace(self.sampling, seed=self.sampling.seed + 1_000_003 * rank)
        if self._synced_step != self.global_step:  # the engine samples with the weights of this step
            self.engine.sync_weights(self.model)
            self._synced_step = self.global_step
        groups, stats = produce_batch(
            self.prompts_per_step,
            datamodule.take,
            self._render,
            lambda ids: split_thinking(tokenizer.decode(ids))[1],
            self.engine,
            self.judger,
            sampling,
            self.buffer,
            self.global_step,
            stop,
            self.dynamic_sampling,
            self.max_rounds,
            self._shape_rewards if self.overlong_buffer else None,
            self.oversample,
            self._most_over_data_ranks,
        )
        samples, advantages = self._advantages(groups)
        self._rollout_metrics = self._metrics(stats, groups, samples)
        per_update = _split(list(zip(samples, advantages)), self.mini_batches)
        updates = [self._micro_batches(chunk) for chunk in per_update]
        with torch.no_grad():
            for update in updates:
                for mb in update:
                    self._fill_logps(mb)
        self._pending = [[mb for mb in update] for _ in range(self.epochs) for update in updates]

    def _most_over_data_ranks(self, count: int) -> int:
        """The largest ``count`` over the data-parallel ranks (``count`` itself on one rank)."""
        group = self.parallelizer.data_group()
        if group is None:
            return count
        most = torch.tensor(count, device=self.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=group)
        return int(most.item())

    def _advantages(self, groups: list[Group]) -> tuple[list[Any], list[float]]:
        size = self.sampling.group_size
        rewards = torch.tensor(
            [math.nan if s.reward is None else s.reward for g in groups for s in g.samples], dtype=torch.float64
        )
        if not groups:
            return [], []
        advantages = group_advantages(rewards, size, self.objective.scale_rewards).tolist()
        kept = []
        for i, group in enumerate(groups):
            for j, sample in enumerate(group.samples):
                advantage = advantages[i * size + j]
                if sample.state == SampleState.COMPLETED and not math.isnan(advantage):
                    kept.append((sample, advantage))
        return [s for s, _ in kept], [a for _, a in kept]

    def _shape_rewards(self, groups: list[Group]) -> None:
        lengths = torch.tensor([len(s.response_ids) for g in groups for s in g.samples])
        penalties = overlong_penalty(
            lengths, self.sampling.max_new_tokens, self.overlong_buffer, self.overlong_penalty
        )
        for sample, penalty in zip((s for g in groups for s in g.samples), penalties.tolist(), strict=True):
            if sample.reward is not None:
                sample.reward += penalty

    def _metrics(self, stats: ProduceStats, groups: list[Group], samples: list[Any]) -> dict[str, float]:
        rewards = [r for g in groups for r in g.rewards]
        lengths = [len(s.response_ids) for s in samples] or [0]
        out = stats.metrics()
        out["train/reward"] = float(np.mean(rewards)) if rewards else 0.0
        out["train/reward_std"] = float(np.std(rewards, ddof=1)) if len(rewards) > 1 else 0.0
        out["train/response_length"] = float(np.mean(lengths))
        out["train/groups_with_signal"] = float(sum(g.has_signal for g in groups))
        return out

    def _micro_batches(self, chunk: list[tuple[Any, float]]) -> list[RLMicroBatch]:
        """``micro_batches`` packs of the chunk's sequences (round-robin; an empty one holds a 2-token filler)."""
        normalizer = {"grpo": lambda n, t: n, "dr_grpo": lambda n, t: n * self.sampling.max_new_tokens}
        count = normalizer.get(self.objective.loss_type, lambda n, t: t)
        out = []
        for part in _split(chunk, self.micro_batches):
            mb = pack_sequences([(s.prompt_ids, s.response_ids) for s, _ in part], [a for _, a in part])
            if part and all(s.logprobs is not None for s, _ in part):
                mb.sampling_logps = torch.zeros_like(mb.mask)
                for i, (sample, _) in enumerate(part):
                    mb.sampling_logps[i, : len(sample.logprobs)] = torch.tensor(sample.logprobs)
            mb.num_items = float(count(len(part), int(mb.mask.sum())))
            out.append(mb)
        return out

    def _fill_logps(self, mb: RLMicroBatch) -> None:
        device_mb = mb.to(self.device)
        blocks = self.model.moe_blocks() if self.routing_replay else []
        for block in blocks:
            block.record_routing(True)
        try:
            mb.old_logps = self._token_logps(self.model, device_mb)[0].cpu()
        finally:
            for block in blocks:
                block.record_routing(False)
        if blocks:
            mb.routed_experts = [block.recorded.cpu() for block in blocks]
        mode = self.resolved_reference
        if mode == "live":
            mb.ref_logps = self._token_logps(self._reference[0], device_mb)[0].cpu()
        elif mode == "adapters_off":
            with adapters_disabled(self.model):
                mb.ref_logps = self._token_logps(self.model, device_mb)[0].cpu()

    def _replay(self, routed: list[torch.Tensor] | None) -> None:
        """Route the policy's next forwards to ``routed`` (per MoE layer; ``None``: the routers choose)."""
        if not self.routing_replay:
            return
        for i, block in enumerate(self.model.moe_blocks()):
            block.replay_routing(None if routed is None else routed[i])

    def _token_logps(
        self, model: torch.nn.Module, mb: RLMicroBatch, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(B, T)`` log-probabilities (at the sampling temperature) of the completion tokens, and their entropy."""
        out = model(seq_ctx=mb.seq_ctx, return_logits=True, logits_to_keep=mb.positions)
        logits = out.logits[0].float() / self.sampling.temperature
        logprobs = torch.log_softmax(logits, dim=-1)
        targets = mb.batch.labels[0].index_select(0, mb.positions)
        flat = logprobs.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        logps = flat[mb.rows] * mb.mask
        entropy = None
        if with_entropy:
            flat_entropy = -(logprobs.exp() * logprobs).sum(-1).detach()
            entropy = flat_entropy[mb.rows] * mb.mask
        return logps, entropy


def _split(items: list[Any], parts: int) -> list[list[Any]]:
    """``items`` dealt round-robin into ``parts`` lists (some may be empty)."""
    return [items[i::parts] for i in range(parts)]


def pack_sequences(sequences: list[tuple[list[int], list[int]]], advantages: list[float]) -> RLMicroBatch:
    """One packed micro-batch of ``(prompt ids, completion ids)`` sequences, labelled on the completions (no
    sequences: a 2-token filler without labels, which every rank can forward when parameters are sharded)."""
    if not sequences:
        mb = collate_pack(Pack(-1, np.zeros(2, dtype=np.int64), np.full(2, IGNORE_INDEX, dtype=np.int64), [2]))
        empty = torch.zeros(0, 1, dtype=torch.long)
        return RLMicroBatch(mb, torch.zeros(0, dtype=torch.long), empty, empty.float(), torch.zeros(0), sequences=[])
    ids: list[int] = []
    labels: list[int] = []
    for prompt, response in sequences:
        ids += [*prompt, *response]
        labels += [IGNORE_INDEX] * len(prompt) + list(response)
    lengths = [len(p) + len(r) for p, r in sequences]
    mb = collate_pack(Pack(-1, np.asarray(ids, dtype=np.int64), np.asarray(labels, dtype=np.int64), lengths))
    positions = torch.nonzero(mb.labels[0] != IGNORE_INDEX).squeeze(-1)
    width = max(len(r) for _, r in sequences)
    rows = torch.zeros(len(sequences), width, dtype=torch.long)
    mask = torch.zeros(len(sequences), width)
    offset = 0
    for i, (_, response) in enumerate(sequences):
        rows[i, : len(response)] = torch.arange(offset, offset + len(response))
        mask[i, : len(response)] = 1.0
        offset += len(response)
    advantages_t = torch.tensor(advantages, dtype=torch.float32)
    return RLMicroBatch(mb, positions, rows, mask, advantages_t, sequences=[(list(p), list(r)) for p, r in sequences])
