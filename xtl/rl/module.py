"""RL with rollouts and judgers: :class:`GRPOModule` trains any family (text or vision-language) with GRPO,
Dr.GRPO, DAPO or GSPO.

One ``training_step`` is one optimizer step. When no update is pending, the module produces a rollout batch
(:func:`xtl.rl.buffer.produce_batch`): ``rollout.prompts_per_step`` prompts per rank from the prompt data,
``sampling.group_size`` completions each from the rollout engine (:mod:`xtl.rl.engines`; xtl's cached sampler on the
policy by default) through the agent loop (:mod:`xtl.rl.agent`: one completion per prompt by default; multi-turn tool
use, environments or black-box agents with ``agent``), judged, shaped (DAPO's overlong penalty), filtered (dynamic
sampling), and turned into group-relative advantages (a sample whose judging failed gets none: the failures are said on
the console, and a batch whose judging all failed for one reason stops the run, :mod:`xtl.rl.failures`). Tokens an
agent loop appended (tool results, observations) are context, masked from the loss. The batch is packed
(:mod:`xtl.rl.packing`) and cut into ``updates.mini_batches`` updates, run ``updates.epochs`` times: that many
optimizer steps per rollout batch, each a ``training_step``. The policy's log-probabilities of the batch (the *old*
log-probabilities of the importance ratio) are computed once: for the first update by its own forward, detached (it
runs before any optimizer step, on the policy that sampled the batch; TRL does the same when its generation and
optimizer steps align), for the others when the batch is produced (with the reference's when ``objective.beta > 0``,
for every update). Pending updates and leftover groups are part of the checkpoint, with the sampler's random state and
the prompt order, so a resumed run takes exactly the steps the uninterrupted one would.

A policy *version* is the weights after a number of rollout batches' updates; a group records the version that
sampled it, and one more than ``rollout.max_staleness`` versions older than the batch it would train in expires.
With ``rollout.asynchronous``, rollout batches are produced on a thread (:mod:`xtl.rl.producer`) by an engine that
samples in other processes, while the trainer updates: batch ``n`` is sampled with version ``n - max_staleness``,
and each token's policy term is weighted by the truncated ratio of the trainer's log-probability to the engine's
(the behavior policy's).

A vision-language policy (Qwen3-VL, Qwen3-VL-MoE) trains on prompt rows with images (:mod:`xtl.rl.vision`): the
prompt is rendered with the images' placeholder tokens, the rollout's prefill runs the images through the vision
tower, and each update's pack carries the images of its sequences, so the old, reference and policy log-probabilities
see the vision tokens exactly as the rollout did (under routing replay, the recorded routes cover every token of the
pack, vision tokens included).
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_info

from xtl.data import XTLDataModule
from xtl.data.multimodal import ImageProcessorConfig
from xtl.errors import ConfigError
from xtl.model import ModelOutput
from xtl.rl.agent.chat import ChatFormat
from xtl.rl.agent.loop import AgentContext, AgentLoop, SingleTurnLoop
from xtl.rl.buffer import (
    Group,
    ProduceStats,
    ReplayBuffer,
    Sample,
    SampleState,
    group_dict,
    group_from,
    produce_batch,
)
from xtl.rl.engines import EngineSettings, start_engine
from xtl.rl.failures import JudgingFailures
from xtl.rl.judger import FAILED, BaseJudger, MathJudger, RolloutState
from xtl.rl.loss import POLICY_STATS, PolicyLossConfig, group_advantages, overlong_penalty, policy_loss, policy_metrics
from xtl.rl.packing import RLMicroBatch, cut_micro_batches, split_round_robin
from xtl.rl.producer import AsyncProducer, Produced
from xtl.rl.rollout import DetachedEngine, GreedyEngine, RolloutEngine, SamplingSettings
from xtl.rl.settings import RolloutSettings, UpdateSettings, moved_key
from xtl.rl.tasks import TaskMix
from xtl.rl.vision import PromptImages, PromptVision
from xtl.train.base import LanguageModule
from xtl.train.generation import GenerationConfig, chat_prompt_ids, generate, split_thinking, stop_token_ids
from xtl.train.reference import ReferenceConfig, ReferenceMode, ReferencePolicy, reference_config
from xtl.train.scorer import pack_values, score_tokens


class GRPOModule(LanguageModule):
    """Group-relative policy optimization of any family with rollouts and judgers (prompts with images for a
    vision-language policy).

    Args:
        model: The policy: HF directory, alias or config mapping (as :class:`~xtl.train.LanguageModule`).
        judger: Scores completions (default: :class:`~xtl.rl.MathJudger`); a ``class_path`` in YAML.
        sampling: Group size and how completions are sampled (a :class:`~xtl.train.generation.GenerationConfig`:
            temperature, top-p/top-k, max new tokens, stop tokens, seed).
        objective: The loss type, importance sampling level, clipping, KL weight and reward scaling.
        rollout: How each rollout batch is produced: prompts per rank, dynamic sampling (rounds, oversampling),
            the replay buffer's staleness, DAPO's overlong penalty.
        updates: How each rollout batch is cut into optimizer steps: mini-batches, epochs, micro-batches.
        engine: The rollout engine (``local``, ``vllm``, ``ray``), its settings and the truncated importance-sampling
            cap.
        reference: Where the KL term's reference comes from (``objective.beta > 0``;
            :class:`~xtl.train.reference.ReferenceConfig` or a mode name): ``auto`` (``none`` without a KL term,
            ``adapters_off`` under fresh LoRA adapters, else ``live``), ``live`` (the starting policy, frozen: a copy,
            or under LoRA the policy with its starting adapters), ``adapters_off``, ``model`` (a separate model) or
            ``none``; with ``sync_every``, TRL's ``sync_ref_model``. Not ``precomputed``: completions are sampled
            while training.
        eval_max_new_tokens: Greedy decoding budget of the held-out evaluation (default ``sampling.max_new_tokens``).
        agent: How each prompt becomes a trajectory (a ``class_path`` in YAML): ``None`` is one completion per
            prompt (:class:`~xtl.rl.agent.SingleTurnLoop`); :class:`~xtl.rl.agent.ToolLoop` (tools),
            :class:`~xtl.rl.agent.EnvironmentLoop` (environments), :class:`~xtl.rl.agent.BlackBoxAgentLoop` (external
            agents through an OpenAI-compatible endpoint). The held-out evaluation runs the same loop, greedily.
        routing_replay: MoE policies: record the experts every token goes to in the forward that gives the old
            log-probabilities (at rollout time) and route the updates' forwards the same way, so the importance ratio
            compares the same experts (the first update's ratio is exactly 1 whatever the kernels) and routing
            changes do not count as policy changes. Refused for models without routed experts.
        **kwargs: :class:`~xtl.train.LanguageModule`'s settings (optimizer, schedule, clipping, routing, ...).

    Raises:
        ConfigError: Settings out of range, a reference the objective cannot use, a flat key of an earlier release
            (naming where it went).
    """

    objective = "GRPO"
    trains_mtp = False  # multi-token prediction belongs to next-token training

    def __init__(
        self,
        model: str | dict[str, Any],
        judger: BaseJudger | None = None,
        sampling: SamplingSettings = SamplingSettings(),
        objective: PolicyLossConfig = PolicyLossConfig(),
        rollout: RolloutSettings = RolloutSettings(),
        updates: UpdateSettings = UpdateSettings(),
        engine: EngineSettings = EngineSettings(),
        reference: ReferenceMode | ReferenceConfig = "auto",
        eval_max_new_tokens: int | None = None,
        agent: AgentLoop | None = None,
        routing_replay: bool = False,
        **kwargs: Any,
    ) -> None:
        moved = next((m for key in kwargs if (m := moved_key(key))), None) or moved_key("engine", engine)
        if moved:
            raise ConfigError(moved)
        super().__init__(model, **kwargs)
        self.save_hyperparameters(ignore=["judger", "agent"])  # objects (holding code): set by the config
        samples = rollout.prompts_per_step * sampling.group_size
        if updates.mini_batches > samples:
            raise ConfigError(
                f"model.init_args.updates.mini_batches ({updates.mini_batches}) exceeds the samples of a rollout "
                f"batch (rollout.prompts_per_step x sampling.group_size = {samples})"
            )
        if rollout.asynchronous and engine.name != "ray":
            raise ConfigError(
                "model.init_args.rollout.asynchronous produces rollouts while the trainer updates: it needs an engine "
                f"that samples in other processes (engine.name: ray), not {engine.name}"
            )
        if rollout.partial_tokens is not None and agent is not None and not isinstance(agent, SingleTurnLoop):
            raise ConfigError(
                "model.init_args.rollout.partial_tokens pauses and continues single-turn completions; an agent loop's "
                "trajectories are sampled whole: remove one of them"
            )
        if rollout.overlong_buffer is not None and rollout.overlong_buffer > sampling.max_new_tokens:
            raise ConfigError(
                f"model.init_args.rollout.overlong_buffer must be in (0, sampling.max_new_tokens="
                f"{sampling.max_new_tokens}], got {rollout.overlong_buffer}"
            )
        self.judger = judger if judger is not None else MathJudger()
        self.agent = agent if agent is not None else SingleTurnLoop()
        self.sampling = sampling
        self.objective = objective
        self.rollout = rollout
        self.updates = updates
        self.engine_settings = engine
        self.reference = ReferencePolicy(reference_config(reference), objective.beta > 0, precomputable=False)
        self.eval_max_new_tokens = eval_max_new_tokens or sampling.max_new_tokens
        self.routing_replay = routing_replay
        self.buffer = ReplayBuffer(rollout.max_staleness)
        self.engine: RolloutEngine | None = None
        self._synced_step = -1
        self._pending: list[list[RLMicroBatch]] = []
        self._rollout_metrics: dict[str, float] = {}
        self._engine_state: dict[str, Any] = {}
        self._eval: dict[int, list[float]] = {}  # per held-out set: reward sum, exact matches, samples, failed
        self._eval_errors: dict[str, int] = {}  # why held-out samples failed judging -> how many
        self._failures = JudgingFailures(self.judger, self._say)
        self._stop: tuple[Any, tuple[int, ...]] | None = None  # (tokenizer, template) -> its stop tokens
        self._chat: tuple[Any, ChatFormat] | None = None  # (tokenizer, template) -> the agent loop's chat format
        self._agent_state: dict[str, Any] = {}
        self._producer: AsyncProducer | None = None
        self._batches = 0  # rollout batches taken for training
        self._produced: list[Produced] = []  # produced before a checkpoint, not trained yet (asynchronous)
        self._producer_next: int | None = None
        self._agent_lock = threading.Lock()  # the producer's thread and validation share the agent loop
        self._tasks = TaskMix(rollout.tasks) if rollout.tasks else None
        self._vision: PromptVision | None = None  # a vision-language policy's prompt images (built in setup)

    # ---- model -----------------------------------------------------------------------------------------------

    def configure_model(self) -> None:
        """Build the policy and its reference (:meth:`LanguageModule.configure_model`); refuse routing replay for a
        model without routed experts."""
        if self.model is not None:
            return
        super().configure_model()
        if self.routing_replay and not self.model.moe_blocks():
            raise ConfigError("model.init_args.routing_replay: the model has no routed experts to replay; remove it")

    def setup(self, stage: str) -> None:
        """Refuse what RL cannot run: data that is not prompts, prompts with images for a text policy or an agent
        loop that cannot pass them; prepare a vision-language policy's prompt images."""
        super().setup(stage)
        datamodule = self._trainer.datamodule if self._trainer is not None else None
        if not isinstance(datamodule, XTLDataModule) or datamodule.prompts is None:
            raise ConfigError(
                "GRPOModule draws prompts from kind: prompt sources (rows with a prompt and an answer): set "
                "data.sources[*].kind: prompt"
            )
        if self.family.vision:
            settings = ImageProcessorConfig.from_any(datamodule.image_processor) or ImageProcessorConfig()
            self._vision = PromptVision(datamodule.load_tokenizer(), settings, datamodule.template)
        with_images = next((row for row in datamodule.prompts.rows if row.get("images")), None)
        if with_images is not None and not self.family.vision:
            raise ConfigError(
                f"data.sources: prompt rows have images ({with_images['images'][0]}) but the policy is a text model: "
                "use a vision-language model (qwen3_vl, qwen3_vl_moe) or prompts without image parts"
            )
        if with_images is not None and self.agent.image_refusal is not None:
            raise ConfigError(
                f"model.init_args.agent: {type(self.agent).__name__} cannot run prompts with images: "
                f"{self.agent.image_refusal}; use prompts without image parts or another agent loop"
            )
        if self._tasks is not None:
            missing = [task for task in self._tasks.shares if task not in datamodule.prompts.tasks]
            if missing:
                raise ConfigError(
                    f"model.init_args.rollout.tasks: no prompt row has data_source {missing[0]!r} (the prompt rows "
                    f"have: {', '.join(datamodule.prompts.tasks)}); set data.sources[*].data_source"
                )

    def on_fit_start(self) -> None:
        """Start the rollout engine on the policy and say what trains."""
        self.engine = self._start_engine()
        self._synced_step = -1
        if self._engine_state:
            self.engine.load_state_dict(self._engine_state)
        if self._agent_state:
            self.agent.load_state_dict(self._agent_state)
        if self.rollout.asynchronous and not isinstance(self.engine, DetachedEngine):
            raise ConfigError(
                "model.init_args.rollout.asynchronous needs an engine that samples in other processes "
                f"(engine.name: ray); {type(self.engine).__name__} samples with the policy itself"
            )
        rank_zero_info(
            f"xtl rl: {self.describe_objective()}; {self.rollout.prompts_per_step} prompts x "
            f"{self.sampling.group_size} completions per rank and rollout batch ({self.agent.describe()}), "
            f"{self.updates.steps_per_batch} optimizer step(s) each"
            + (f"; produced asynchronously, at most {self.rollout.max_staleness} step(s) stale"
               if self.rollout.asynchronous else "")
        )  # fmt: skip

    def on_fit_end(self) -> None:
        """Stop the rollout producer; release what the agent loop holds (an endpoint, agent processes)."""
        self._stop_producer()
        self.agent.close()

    # ---- training --------------------------------------------------------------------------------------------

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """One optimizer step on the next pending update (producing a rollout batch first when none is left)."""
        if not self._pending:
            self._produce()
        pending = self._pending.pop(0)
        update = [self._on_device(mb) for mb in pending]
        forward, sums = self.step_objective()
        try:
            result = self.optimizer_step_over(update, forward, lambda mb: mb.num_items)
        finally:
            self._replay(None)
        for kept, used in zip(pending, update, strict=True):  # the first update's own: for later epochs, checkpoints
            if kept.old_logps is None:
                kept.old_logps = used.old_logps.cpu()
        zero = torch.zeros((), device=self.device)
        totals = self._sum_over_data_ranks(
            torch.stack([sum((s[k].float() for s in sums), zero) for k in POLICY_STATS])
        )
        metrics = policy_metrics(dict(zip(POLICY_STATS, totals)), self.objective)
        values = {f"train/{name}": value for name, value in metrics.items()}
        values.update({k: torch.tensor(v) for k, v in self._rollout_metrics.items()})
        self.log_step_metrics(values)
        return result.loss_sum / result.global_tokens.clamp(min=1)

    def step_objective(self) -> tuple[Callable[[RLMicroBatch], ModelOutput], list[dict[str, torch.Tensor]]]:
        """The policy loss of one update: a micro-batch's forward, whose ``loss_sum`` the step divides by the
        update's normalizer (``num_items``, over micro-batches and data-parallel ranks), and the list its statistic
        sums are appended to. Under context parallelism every rank of a group computes the whole micro-batch's loss
        (its completion tokens made whole over the group) and counts its whole normalizer."""
        sums: list[dict[str, torch.Tensor]] = []

        def forward(mb: RLMicroBatch) -> ModelOutput:
            self._replay(mb.routed_experts)  # kept through the backward (a recomputing block routes the same)
            logps, entropy = self._token_logps(self.model, mb, with_entropy=True)
            if mb.old_logps is None:  # the first update of a rollout batch: the policy has not moved since sampling
                mb.old_logps = logps.detach()
            weights = None
            if mb.sampling_logps is not None:  # truncated importance sampling: the engine's numerics are not ours
                cap = self.engine_settings.importance_sampling_cap
                weights = torch.exp(mb.old_logps - mb.sampling_logps).clamp(max=cap)
            out = policy_loss(
                logps, mb.old_logps, mb.advantages, mb.mask, self.objective, mb.ref_logps,
                self.sampling.max_new_tokens, weights, entropy,
            )  # fmt: skip
            sums.append(out.stats)
            return ModelOutput(loss_sum=out.loss_sum, num_tokens=None)

        return forward, sums

    def build_updates(self, groups: list[Group], stats: ProduceStats) -> list[list[RLMicroBatch]]:
        """The pending updates of a rollout batch (each the micro-batches of one optimizer step, ``updates.epochs``
        passes of ``updates.mini_batches``) with their log-probabilities, and the batch's metrics. An objective on
        the same rollouts (:class:`~xtl.rl.OnlineDPOModule`) overrides it."""
        samples, advantages = self._advantages(groups)
        self._rollout_metrics = self._metrics(stats, groups, samples)
        settings = (self.updates.micro_batches, self.objective.loss_type, self.sampling.max_new_tokens)
        updates = [
            cut_micro_batches(chunk, *settings, self._vision, self._image_filler())
            for chunk in split_round_robin(list(zip(samples, advantages)), self.updates.mini_batches)
        ]
        with torch.no_grad():
            for k, update in enumerate(updates):
                for mb in update:
                    # the first update's old log-probabilities come from its own forward (module docstring), unless
                    # that forward must replay the routing this one records
                    self._fill_logps(mb, policy=k > 0 or self.routing_replay)
        return [list(update) for _ in range(self.updates.epochs) for update in updates]

    def describe_objective(self) -> str:
        """The objective and its reference, for the log line of the fit's start."""
        objective = self.objective
        return (
            f"{objective.loss_type} ({objective.importance_sampling}-level ratio, clip "
            f"[{1 - objective.epsilon_low:g}, {1 + objective.epsilon_high:g}], beta {objective.beta}, reference "
            f"{self.reference.mode}: {self.reference.describe()})"
        )

    @property
    def scoring_temperature(self) -> float:
        """The temperature the policy's and the reference's log-probabilities are scored at: the sampling's (TRL's
        ``GRPOTrainer`` scores at it too)."""
        return self.sampling.temperature

    # ---- evaluation ------------------------------------------------------------------------------------------

    def validation_step(self, batch: list[dict[str, Any]], batch_idx: int, dataloader_idx: int = 0) -> None:
        """Greedy answers to held-out prompts, judged: ``val/reward`` (over the samples judged; a sample whose
        judging failed is counted in ``val/failed``, not as a reward of 0) and ``val/exact_match``."""
        datamodule = self.trainer.datamodule
        tokenizer = datamodule.load_tokenizer()
        stop = self._stop_token_ids()
        stop_ids = tuple(sorted({*self.sampling.stop_token_ids, *stop}))
        config = GenerationConfig(max_new_tokens=self.eval_max_new_tokens, stop_token_ids=stop_ids)  # greedy
        group = self.parallelizer.world_group() if self.parallelizer.shards_parameters else None
        images = self._row_images(batch)
        if isinstance(self.agent, SingleTurnLoop):
            prompts = [self._render(row) for row in batch]
            pixels = None if images is None else [None if entry is None else entry.inputs for entry in images]
            with self.parallelizer.whole_sequences(self.model):
                outputs = generate(self.model, prompts, config, group=group, images=pixels).sequences
            answers = [split_thinking(tokenizer.decode([t for t in out if t not in stop]))[1] for out in outputs]
            env_rewards: list[float | None] = [None] * len(batch)
        else:  # the agent loop, greedily: held-out accuracy with the tools or environment the policy trains with
            sampling = replace(self.sampling, max_new_tokens=self.eval_max_new_tokens)
            context = replace(self._context(), images=images)
            engine = GreedyEngine(self.model, group=group, filler=self._image_filler())
            with self._agent_lock, self.parallelizer.whole_sequences(self.model):  # not while the producer uses it
                trajectories = self.agent.rollout(batch, engine, sampling, context)
            answers = [t.response for t in trajectories]
            env_rewards = [t.reward for t in trajectories]
        states, exact = [], []
        for row, answer in zip(batch, answers, strict=True):
            states.append(RolloutState(answer, row.get("answer"), row.get("data_source", "default"), row["prompt"]))
            exact.append(float(answer.strip() == str(row.get("answer", "")).strip()))
        rewards, failed = [], 0
        for state, env_reward in zip(self.judger.judge_sync(states), env_rewards, strict=True):
            if env_reward is not None:  # an environment's return stands in for the judger's
                rewards.append(env_reward)
            elif state.status == FAILED or state.reward is None:
                failed += 1
                reason = state.error or "the judger gave no reward"
                self._eval_errors[reason] = self._eval_errors.get(reason, 0) + 1
            else:
                rewards.append(float(state.reward["score"]))
        totals = self._eval.setdefault(dataloader_idx, [0.0, 0.0, 0.0, 0.0])
        totals[0] += sum(rewards)
        totals[1] += sum(exact)
        totals[2] += len(batch)
        totals[3] += failed

    def on_validation_epoch_end(self) -> None:
        """Log ``val/reward`` (the mean over the samples judged; ``NaN`` when every judging failed: not a score of 0,
        and checkpoint monitoring ranks it worst), ``val/failed`` (samples whose judging failed) and
        ``val/exact_match`` (``val/<set>/...`` with several sets); say the failures (:mod:`xtl.rl.failures`)."""
        datamodule = self.trainer.datamodule
        names = datamodule.val_set_names if isinstance(datamodule, XTLDataModule) else []
        for idx, (reward, exact, count, failed) in sorted(self._eval.items()):
            prefix = "val" if len(self._eval) == 1 else f"val/{names[idx] if idx < len(names) else idx}"
            scored = count - failed
            self.log(f"{prefix}/reward", reward / scored if scored else math.nan, prog_bar=True)
            self.log(f"{prefix}/exact_match", exact / max(count, 1), prog_bar=True)
            self.log(f"{prefix}/failed", failed)
        failed, count = (sum(totals[k] for totals in self._eval.values()) for k in (3, 2))
        self._failures.validation(int(failed), int(count), self._eval_errors)
        self._eval, self._eval_errors = {}, {}

    # ---- checkpoint ------------------------------------------------------------------------------------------

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Add the RL state of every rank (each has its own): pending updates, leftover groups, the sampler's random
        state, the judger's state. The ranks' states are gathered, since a sharded checkpoint keeps rank 0's
        non-tensor state only."""
        super().on_save_checkpoint(checkpoint)
        produced = self._produced
        if self._producer is not None:  # a quiet producer: every batch whose weights it has is produced
            produced = self._producer.drain()
            self._patch_consumed_prompts(checkpoint)
        engine = self.engine.state_dict() if self.engine is not None else self._engine_state
        state = {
            "batches": self._batches,
            "produced": [_produced_dict(p) for p in produced],
            "producer_next": self._producer.next_index if self._producer is not None else self._producer_next,
            "pending": [[mb.state() for mb in update] for update in self._pending],
            "buffer": self.buffer.state_dict(),
            "engine": engine,
            "judger": self.judger.state_dict(),
            "agent": self.agent.state_dict(),
            "rollout_metrics": dict(self._rollout_metrics),
            "data": self._data_state(),  # a producer's ranks draw prompts apart: each its own count
        }
        group = self.parallelizer.data_group()  # every rank (context-parallel ones each hold their own state)
        ranks = [state]
        if group is not None:
            ranks = [None] * self.parallelizer.layout.world_size
            dist.all_gather_object(ranks, state, group=group)
        checkpoint["xtl_rl"] = {"ranks": ranks}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Restore this rank's part of :meth:`on_save_checkpoint`'s RL state.

        Raises:
            ConfigError: The checkpoint was written by another number of processes.
        """
        super().on_load_checkpoint(checkpoint)
        ranks = checkpoint.get("xtl_rl", {}).get("ranks", [{}])
        world = self.parallelizer.layout.world_size
        if len(ranks) != world:
            raise ConfigError(
                f"the RL checkpoint holds the rollout state of {len(ranks)} process(es), this run has {world}: "
                "resume with the same trainer.devices and trainer.num_nodes"
            )
        data = self.parallelizer.meshes.data  # the group on_save_checkpoint gathered over
        state = ranks[0 if data is None else data.get_local_rank()]
        self._pending = [
            [RLMicroBatch.from_state(mb, self._vision) for mb in update] for update in state.get("pending", [])
        ]
        self.buffer.load_state_dict(state.get("buffer", {}))
        self._engine_state = state.get("engine", {})
        if self.engine is not None:
            self.engine.load_state_dict(self._engine_state)
        self.judger.load_state_dict(state.get("judger", {}))
        self._agent_state = state.get("agent", {})
        self.agent.load_state_dict(self._agent_state)
        self._rollout_metrics = dict(state.get("rollout_metrics", {}))
        self._batches = int(state.get("batches", checkpoint.get("global_step", 0) // self.updates.steps_per_batch))
        self._produced = [_produced_from(p) for p in state.get("produced", [])]
        self._producer_next = state.get("producer_next")
        data = checkpoint.get(type(self.trainer.datamodule).__qualname__) if self._trainer is not None else None
        if isinstance(data, dict) and state.get("data"):  # Lightning restores the data module after this hook
            data.update(state["data"])

    # ---- private ---------------------------------------------------------------------------------------------

    def _start_engine(self) -> RolloutEngine:
        rank = self.trainer.datamodule.data_parallel_rank()[0]
        group = self.parallelizer.world_group() if self.parallelizer.shards_parameters else None
        return start_engine(
            self.engine_settings,
            self.model,
            self.hf_dir,
            self.device,
            seed=self.sampling.seed + rank,
            group=group,
            logprobs=self.rollout.partial_tokens is not None,
            image_token_id=None if self._vision is None else self._vision.image_token_id,
            filler=self._image_filler(),
        )

    def _stop_token_ids(self) -> tuple[int, ...]:
        """The tokenizer's and the template's stop tokens, looked up once (the lookup reads the whole vocabulary)."""
        datamodule = self.trainer.datamodule
        key = (datamodule.load_tokenizer(), datamodule.template)
        if self._stop is None or self._stop[0] != key:
            self._stop = (key, stop_token_ids(*key))
        return self._stop[1]

    def _context(self) -> AgentContext:
        """The agent loop's chat format (built once per tokenizer and template) and, when the ranks decode in
        lockstep (sharded parameters), their agreement on the turns left."""
        datamodule = self.trainer.datamodule
        key = (datamodule.load_tokenizer(), datamodule.template)
        if self._chat is None or self._chat[0] != key:
            stop = tuple(sorted({*self._stop_token_ids(), *self.sampling.stop_token_ids}))
            self._chat = (key, ChatFormat(key[0], key[1], datamodule.template_kwargs, stop, self._vision))
        agree = self._most_over_data_ranks if self.parallelizer.shards_parameters else None
        return AgentContext(self._chat[1], agree)

    def _render(self, row: dict[str, Any]) -> list[int]:
        """The prompt ids of ``row`` (its images as their placeholders)."""
        datamodule = self.trainer.datamodule
        messages = row["prompt"] if self._vision is None else self._vision.text_messages(row["prompt"])
        return chat_prompt_ids(datamodule.load_tokenizer(), messages, datamodule.template, datamodule.template_kwargs)

    def _image_filler(self) -> tuple[list[int], PromptImages] | None:
        """The image filler of a sharded vision-language policy's forwards without images (every rank runs the
        vision tower in every forward: :mod:`xtl.rl.vision`); ``None`` otherwise."""
        if self._vision is None or not self.parallelizer.shards_parameters:
            return None
        return self._vision.filler()

    def _row_images(self, rows: list[dict[str, Any]]) -> list[PromptImages | None] | None:
        """The processed images of each row (``None`` when no row has images)."""
        if self._vision is None or not any(row.get("images") for row in rows):
            return None
        return [self._vision.images(row.get("images")) for row in rows]

    def _produce(self) -> None:
        """Produce a rollout batch and cut it into the pending updates."""
        datamodule = self.trainer.datamodule
        rank = datamodule.data_parallel_rank()[0]
        sampling = replace(self.sampling, seed=self.sampling.seed + 1_000_003 * rank)
        if self.rollout.asynchronous:  # produced on the producer's thread, with the weights the schedule says
            if self._producer is None:  # started here: a sharded run restores its checkpoint after on_fit_start
                self._start_producer()
            if self._producer.needs(self._batches):  # a version boundary: these weights sample a later batch
                self._producer.publish(self._batches, self.engine.snapshot(self.model))
            produced = self._producer.take(self._batches)
            groups, stats = produced.groups, produced.stats
        else:
            if self._synced_step != self.global_step:  # the engine samples with the weights of this step
                self.engine.sync_weights(self.model)
                self._synced_step = self.global_step
            with self.parallelizer.whole_sequences(self.model):  # a context-parallel group decodes whole sequences
                groups, stats = self._produce_groups(datamodule, sampling, self._batches)
        self._check_judging(stats)
        self._batches += 1
        self._pending = self.build_updates(groups, stats)

    def _produce_groups(
        self, datamodule: Any, sampling: SamplingSettings, version: int, train_step: int | None = None
    ) -> tuple[list[Group], ProduceStats]:
        """Draw prompts, sample their groups through the agent loop (with the policy of version ``version``: the
        weights after that many rollout batches), judge and shape them (the groups of rollout batch ``train_step``)."""
        rollout = self.rollout
        asynchronous = self.rollout.asynchronous  # on the producer's thread: no collective with the other ranks
        take = datamodule.take
        if self._tasks is not None:
            mix = self._tasks

            def take(count: int) -> list[dict[str, Any]]:
                return mix.take(datamodule.take_task, count)

        return produce_batch(
            rollout.prompts_per_step,
            take,
            self.agent,
            self._context(),
            self.engine,
            self.judger,
            sampling,
            self.buffer,
            version,
            rollout.dynamic_sampling,
            rollout.max_rounds,
            self._shape_rewards if rollout.overlong_buffer else None,
            rollout.oversample,
            None if asynchronous else self._most_over_data_ranks,
            train_step,
            rollout.partial_tokens,
            rollout.max_resumes,
        )

    def _check_judging(self, stats: ProduceStats) -> None:
        """Say the rollout batch's failed judging and stop the run when all of it failed for one reason
        (:mod:`xtl.rl.failures`), on counts summed over the data-parallel ranks: every rank decides alike."""
        errors = stats.judge_errors
        local = [sum(errors.values()), stats.judge_sent, int(len(errors) > 1)]
        failed, judged, several = self._sum_over_data_ranks(torch.tensor(local, device=self.device)).tolist()
        self._failures.step(self.global_step, failed, judged, errors, one_reason=several == 0)

    def _say(self, line: str) -> None:
        """Print ``line`` on standard error, on rank 0 only."""
        if self.global_rank == 0:
            print(line, file=sys.stderr, flush=True)

    def _start_producer(self) -> None:
        """Start the thread that produces rollout batches (``rollout.asynchronous``), with the batches a checkpoint
        kept."""
        datamodule = self.trainer.datamodule
        rank = datamodule.data_parallel_rank()[0]
        sampling = replace(self.sampling, seed=self.sampling.seed + 1_000_003 * rank)

        def produce(index: int, version: int) -> tuple[list[Group], ProduceStats]:
            with self._agent_lock:  # the agent loop (an endpoint, environments) serves one caller at a time
                return self._produce_groups(datamodule, sampling, version, index)

        start = self._producer_next if self._producer_next is not None else self._batches
        self._producer = AsyncProducer(produce, self.engine.adopt, self.rollout.max_staleness, start)
        self._producer.restore(self._produced)
        self._produced = []

    def _stop_producer(self) -> None:
        if self._producer is not None:
            self._producer.stop()
            self._producer = None

    def _patch_consumed_prompts(self, checkpoint: dict[str, Any]) -> None:
        """The prompts drawn, as of the drained producer: Lightning saved the data module's state before this hook,
        while the producer may still have been drawing."""
        datamodule = self.trainer.datamodule
        state = checkpoint.get(type(datamodule).__qualname__)
        if isinstance(state, dict):
            state.update(datamodule.state_dict())

    def _data_state(self) -> dict[str, Any]:
        """This rank's prompt draws (the checkpoint's data module state is rank 0's, and the ranks of an
        asynchronous run draw different numbers of prompts: they do not agree on dynamic sampling's rounds)."""
        datamodule = self.trainer.datamodule if self._trainer is not None else None
        if datamodule is None:
            return {}
        keys = ("consumed_prompts", "task_consumed_prompts")
        return {k: v for k, v in datamodule.state_dict().items() if k in keys}

    def _most_over_data_ranks(self, count: int) -> int:
        """The largest ``count`` over the data-parallel ranks (``count`` itself on one rank)."""
        group = self.parallelizer.data_group()
        if group is None:
            return count
        most = torch.tensor(count, device=self.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=group)
        return int(most.item())

    def _advantages(self, groups: list[Group]) -> tuple[list[Sample], list[float]]:
        """The samples that train and their advantages: completed samples with a finite advantage (a failed sample
        has none; neither has a completed one whose group holds no other judged reward)."""
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
            lengths, self.sampling.max_new_tokens, self.rollout.overlong_buffer, self.rollout.overlong_penalty
        )
        for sample, penalty in zip((s for g in groups for s in g.samples), penalties.tolist(), strict=True):
            if sample.reward is not None:
                sample.reward += penalty

    def _metrics(self, stats: ProduceStats, groups: list[Group], samples: list[Sample]) -> dict[str, float]:
        """The rollout batch's metrics: the production's accounting (``rollout/...``) and, under TRL's names, the
        rewards of its groups and the lengths of the completions it trains on."""
        rewards = [r for g in groups for r in g.rewards]
        lengths = [len(s.response_ids) for s in samples] or [0]
        out = stats.metrics()
        out["train/reward"] = float(np.mean(rewards)) if rewards else 0.0
        out["train/reward_std"] = float(np.std(rewards, ddof=1)) if len(rewards) > 1 else 0.0
        out["train/frac_reward_zero_std"] = sum(not g.has_signal for g in groups) / max(len(groups), 1)
        out["train/completions/mean_length"] = float(np.mean(lengths))
        out["train/completions/min_length"] = float(min(lengths))
        out["train/completions/max_length"] = float(max(lengths))
        if self._tasks is not None:
            out.update(self._tasks.metrics(groups))
        out["train/completions/clipped_ratio"] = sum(s.finish_reason == "length" for s in samples) / max(
            len(samples), 1
        )
        return out

    def _fill_logps(self, mb: RLMicroBatch, policy: bool = True) -> None:
        """The old log-probabilities of a produced micro-batch (``policy``; recording the routing under routing
        replay) and, with a KL term, the reference's."""
        device_mb = self._on_device(mb)
        if policy:
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
        if self.reference.computes_live:
            with self.reference.computing(self.model) as reference:
                mb.ref_logps = self._token_logps(reference, device_mb)[0].cpu()

    def _replay(self, routed: list[torch.Tensor] | None) -> None:
        """Route the policy's next forwards to ``routed`` (per MoE layer; ``None``: the routers choose)."""
        if not self.routing_replay:
            return
        for i, block in enumerate(self.model.moe_blocks()):
            block.replay_routing(None if routed is None else routed[i])

    def _on_device(self, mb: RLMicroBatch) -> RLMicroBatch:
        """``mb`` on this device, forwarding this rank's context-parallel share of it (cut on the host) under
        context parallelism."""
        share = self.on_before_batch_transfer([mb.batch], 0)[0]
        return mb.to(self.device, share=None if share is mb.batch else share)

    def _token_logps(
        self, model: torch.nn.Module, mb: RLMicroBatch, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(B, T)`` log-probabilities (at :attr:`scoring_temperature`) of the completion tokens, and their entropy:
        this rank scores what it forwards (:func:`~xtl.train.scorer.score_tokens`) and the completion tokens of the
        whole pack are gathered over the context-parallel group (:func:`~xtl.train.scorer.pack_values`), so every
        rank of the group holds the whole rollout's values."""
        forwarded, temperature = mb.forwarded, self.scoring_temperature
        scores = score_tokens(
            model, forwarded.seq_ctx, forwarded.labels, temperature=temperature, entropy=with_entropy
        )
        group = self.parallelizer.meshes.cp_group()
        logps = pack_values(scores, mb.positions, group=group)[mb.rows] * mb.mask
        entropy = None
        if with_entropy:
            entropy = pack_values(scores, mb.positions, scores.entropy, group)[mb.rows] * mb.mask
        return logps, entropy


def _produced_dict(produced: Produced) -> dict[str, Any]:
    from dataclasses import asdict

    stats = asdict(produced.stats)
    stats.pop("expired_groups")  # traced already
    stats["states"] = {state.value: count for state, count in produced.stats.states.items()}  # plain data
    stats["agent"] = dict(produced.stats.agent)
    return {"index": produced.index, "version": produced.version, "groups": [group_dict(g) for g in produced.groups],
            "stats": stats}  # fmt: skip


def _produced_from(state: dict[str, Any]) -> Produced:
    from collections import Counter

    stats = dict(state["stats"])
    stats["states"] = Counter({SampleState(k): v for k, v in stats["states"].items()})
    stats["agent"] = Counter(stats["agent"])
    groups = [group_from(g) for g in state["groups"]]
    return Produced(state["index"], state["version"], groups, ProduceStats(**stats))
