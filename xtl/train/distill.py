"""On-policy distillation (GKD): :class:`DistillModule` trains a student towards a teacher's token distributions.

Each training step reads an ordinary SFT step batch (packed documents of prompt and completion, labels on the
completion). With probability ``lmbda`` (drawn per step from ``seed`` and the step number, so a run and its resume
agree, and every rank draws the same) the student samples new completions of the batch's prompts through the rollout
engine seam (:func:`xtl.rl.engines.start_engine`; xtl's cached sampler on the student by default) and trains on
those; otherwise on the dataset's completions. A document's prompt is everything before its first supervised token
(in a multi-turn conversation, the rest is replaced by the student's completion).

The loss is the generalized JSD of :mod:`xtl.train.distill_loss` (TRL's ``generalized_jsd_loss``: ``beta`` 0 forward
KL, 1 reverse KL; temperature; optional teacher top-k) over the completion tokens, summed and divided by the step's
completion tokens over every micro-batch and data-parallel rank (TRL's ``batchmean`` for one batch).

The teacher is a frozen separate model (any family with the student's vocabulary: an HF directory, an alias or a
config mapping, optionally larger), built and sharded like the student by the reference-model machinery
(:class:`~xtl.train.reference.ReferencePolicy`, ``mode: model``) and left out of checkpoints.

Memory of the head: on one device (an unsharded head) both heads run chunk by chunk on the final hidden states
(:func:`~xtl.train.distill_loss.chunked_jsd_sum`): about ``15 * chunk_bytes`` of vocabulary-wide buffers whatever the
token count, plus the student's hidden-state gradient (``N x C``) and head gradient (``V x C``). Under FSDP the
student's head runs inside its forward (where FSDP gathers and reduces it), so its ``N x V`` logits (and their
gradient) are held; the teacher's head still runs chunk by chunk on its gathered weight. ``chunked: false`` holds both
models' ``N x V`` logits (the plain path).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.distributed.tensor import DTensor

from xtl.batch import ModelOutput
from xtl.data.collate import MicroBatch, collate_pack
from xtl.data.datamodule import XTLDataModule
from xtl.data.item import IGNORE_INDEX
from xtl.data.packing import Pack
from xtl.errors import ConfigError
from xtl.rl.engines import EngineSettings, start_engine
from xtl.rl.rollout import RolloutEngine, SamplingSettings
from xtl.strategies.capability import Refusal
from xtl.train.base import LanguageModule
from xtl.train.distill_loss import chunked_jsd_sum, token_jsd
from xtl.train.generation import GenerationConfig, stop_token_ids
from xtl.train.model_spec import resolve_model_config
from xtl.train.reference import ReferenceConfig, ReferencePolicy

KEY = "model.init_args"


@dataclass
class OnPolicySampling(SamplingSettings):
    """How the student samples its completions: one per prompt, a
    :class:`~xtl.train.generation.GenerationConfig` (TRL's GKD defaults: temperature 0.9, 128 new tokens).

    Args:
        temperature: Sampling temperature (0: greedy).
        max_new_tokens: Tokens per completion at most.
        **fields: The other :class:`~xtl.train.generation.GenerationConfig` fields.
    """

    temperature: float = 0.9
    max_new_tokens: int = 128
    group_size: int = 1

    def __post_init__(self) -> None:
        if self.group_size != 1:
            raise ConfigError(f"{KEY}.sampling.group_size: distillation samples one completion per prompt; remove it")
        try:
            GenerationConfig.__post_init__(self)
        except ValueError as err:
            raise ConfigError(f"{KEY}.sampling.{err}") from err


torch.serialization.add_safe_globals([OnPolicySampling])  # a hyperparameter in checkpoints (weights_only loads)


class DistillModule(LanguageModule):
    """Trains a student (any text family) towards a frozen teacher's token distributions (module docstring).

    Logged: ``train/loss`` (the generalized JSD per completion token), ``train/on_policy`` (the share of steps so far
    that trained on the student's own completions).

    Args:
        model: The student, as :class:`~xtl.train.LanguageModule`'s ``model``.
        teacher: The teacher: an HF directory, ``env:VAR``, alias or config mapping (a mapping builds a seeded
            from-scratch model); it must have the student's vocabulary and tokenizer.
        teacher_overrides: Config fields of the teacher to replace.
        teacher_adapter: A PEFT LoRA adapter directory merged into the teacher's weights.
        lmbda: Probability that a step trains on completions the student samples (TRL's ``lmbda``; 0: the
            dataset's completions only, supervised KD; 1: on-policy only).
        beta: Generalized JSD interpolation: 0 forward KL(teacher || student), 1 reverse KL(student || teacher).
        temperature: Both models' logits are divided by it in the loss (TRL's loss default 1.0; the sampling
            temperature is ``sampling.temperature``).
        top_k: Restrict the divergence to the teacher's ``top_k`` tokens per position, both distributions
            renormalized there (``None``: the whole vocabulary).
        sampling: How the student samples (:class:`OnPolicySampling`; its ``seed`` is mixed with the step and rank).
        engine: The rollout engine (``local``: the student itself; ``vllm``, ``ray``: as for GRPO).
        chunked: Run both heads chunk by chunk on the hidden states (no ``N x V`` logits of both models at once).
        chunk_bytes: About the size of one chunk's fp32 logits of one model.
        **kwargs: The other arguments of :class:`~xtl.train.LanguageModule`.

    Raises:
        ConfigError: ``lmbda``, ``beta``, ``temperature`` or ``top_k`` out of range; a vision-language student or
            teacher; a sequence-classification teacher; a teacher whose vocabulary size or tokenizer differs from
            the student's; context parallelism.
    """

    objective = "distillation"
    trains_mtp = False  # multi-token prediction belongs to next-token training

    def __init__(
        self,
        model: str | dict[str, Any],
        teacher: str | dict[str, Any],
        teacher_overrides: dict[str, Any] | None = None,
        teacher_adapter: str | None = None,
        lmbda: float = 0.5,
        beta: float = 0.5,
        temperature: float = 1.0,
        top_k: int | None = None,
        sampling: OnPolicySampling | None = None,
        engine: EngineSettings | None = None,
        chunked: bool = True,
        chunk_bytes: int = 64 * 2**20,
        **kwargs: Any,
    ) -> None:
        super().__init__(model, **kwargs)
        _check_range("lmbda", lmbda, 0.0, 1.0)
        _check_range("beta", beta, 0.0, 1.0)
        if temperature <= 0:
            raise ConfigError(f"{KEY}.temperature must be > 0, got {temperature}")
        if top_k is not None and top_k < 1:
            raise ConfigError(f"{KEY}.top_k must be >= 1 (or null: the whole vocabulary), got {top_k}")
        if self.family.vision:
            raise ConfigError(
                f"{KEY}.model: DistillModule trains text models; a vision-language student is not supported yet: "
                "finetune it on the teacher's answers instead (LanguageModule on the teacher's generations)"
            )
        self.teacher_config, self.teacher_dir = resolve_model_config(teacher, teacher_overrides)
        _check_teacher(self.teacher_config, self.model_config)
        self.lmbda, self.beta, self.temperature, self.top_k = float(lmbda), float(beta), float(temperature), top_k
        self.sampling = sampling or OnPolicySampling()
        self.engine_settings = engine or EngineSettings()
        self.chunked = chunked
        self.chunk_bytes = int(chunk_bytes)
        config = ReferenceConfig(
            mode="model", model=teacher, adapter=teacher_adapter, model_overrides=teacher_overrides
        )
        self.reference = ReferencePolicy(config, needs_reference=True, precomputable=False)
        self.engine: RolloutEngine | None = None
        self._engine_state: dict[str, Any] = {}
        self._steps = 0
        self._on_policy_steps = 0
        self._stop: tuple[int, ...] | None = None

    @property
    def teacher(self) -> torch.nn.Module | None:
        """The frozen teacher model (after :meth:`configure_model`)."""
        return self.reference.frozen

    # ---- setup -----------------------------------------------------------------------------------------------

    def context_parallel_refusal(self, stage: str) -> Refusal | None:
        """Refused: the student decodes whole prompts, and the teacher reads whole documents."""
        return Refusal("DistillModule samples whole completions and scores them with the teacher on each process")

    def setup(self, stage: str) -> None:
        """Refuse a teacher whose tokenizer differs from the data's (when its directory has one)."""
        super().setup(stage)
        datamodule = self._trainer.datamodule if self._trainer is not None else None
        if isinstance(datamodule, XTLDataModule) and self.teacher_dir is not None:
            _check_tokenizer(Path(self.teacher_dir), datamodule)

    def on_fit_start(self) -> None:
        """Start the rollout engine on the student and say what trains."""
        if self.lmbda > 0:
            self.engine = self._start_engine()
            if self._engine_state:
                self.engine.load_state_dict(self._engine_state)
        rank_zero_info(
            f"xtl distill: generalized JSD (beta {self.beta}, temperature {self.temperature}, top_k {self.top_k}), "
            f"teacher {self.reference.describe()}; on-policy with probability {self.lmbda}"
        )

    # ---- training --------------------------------------------------------------------------------------------

    def training_step(self, batch: list[MicroBatch], batch_idx: int) -> torch.Tensor:
        """One optimizer step: on the student's completions of the batch's prompts (probability ``lmbda``) or on the
        dataset's, the loss summed over completion tokens and divided by the step's count of them."""
        on_policy = self.draws_on_policy(self.global_step)
        if on_policy:
            batch = self.on_policy_batch(batch)
        result = self.optimizer_step_over(batch, self.distill_forward, lambda mb: mb.num_tokens)
        self._steps += 1
        self._on_policy_steps += int(on_policy)
        fraction = torch.tensor(self._on_policy_steps / self._steps, device=self.device)
        self.log_step_metrics({"train/on_policy": fraction})
        return result.loss_sum / result.global_tokens.clamp(min=1)

    def draws_on_policy(self, step: int) -> bool:
        """Whether step ``step`` trains on the student's own completions: a uniform draw below ``lmbda``, seeded by
        ``seed`` and the step (the same on every rank, and after a resume)."""
        if self.lmbda <= 0.0:
            return False
        return bool(np.random.default_rng([self.hparams.seed, step]).random() < self.lmbda)

    def distill_forward(self, mb: MicroBatch) -> ModelOutput:
        """The summed generalized JSD of a micro-batch's supervised tokens (``loss_sum``; with gradient through the
        student), and the student's family extras."""
        ctx, labels = mb.seq_ctx, mb.labels
        rows = ctx.loss_positions
        rows = torch.arange(labels.shape[1], device=labels.device) if rows is None else rows.to(labels.device)
        keep = labels[0].index_select(0, rows) != IGNORE_INDEX
        student_head = self.model.text_model().lm_head.weight
        sharded = isinstance(student_head, DTensor)
        settings = {"beta": self.beta, "temperature": self.temperature, "top_k": self.top_k}
        with self.reference.computing(self.model) as teacher:
            if self.chunked:
                out = teacher(seq_ctx=ctx, return_logits=False, return_hidden_states=True, logits_to_keep=1)
                teacher_side = out.hidden_states[0].index_select(0, rows)
                teacher_head = teacher.text_model().lm_head.weight
                teacher_head = teacher_head.full_tensor() if isinstance(teacher_head, DTensor) else teacher_head
            else:
                teacher_side = teacher(seq_ctx=ctx, return_logits=True, logits_to_keep=rows).logits[0]
                teacher_head = None
        if not self.chunked:
            student = self.model(seq_ctx=ctx, return_logits=True, logits_to_keep=rows)
            per_token = token_jsd(student.logits[0], teacher_side, **settings)
            return ModelOutput(loss_sum=torch.where(keep, per_token, 0.0).sum(), extras=student.extras)
        if sharded:  # the head runs in the forward, where FSDP gathers its weight and reduces its gradient
            student = self.model(seq_ctx=ctx, return_logits=True, logits_to_keep=rows)
            student_side, student_weight = student.logits[0], None
        else:
            student = self.model(seq_ctx=ctx, return_logits=False, return_hidden_states=True, logits_to_keep=1)
            student_side, student_weight = student.hidden_states[0].index_select(0, rows), student_head
        loss_sum = chunked_jsd_sum(
            student_side,
            teacher_side,
            keep,
            **settings,
            student_weight=student_weight,
            teacher_weight=teacher_head,
            chunk_bytes=self.chunk_bytes,
        )
        return ModelOutput(loss_sum=loss_sum, extras=student.extras)

    def on_policy_batch(self, batch: list[MicroBatch]) -> list[MicroBatch]:
        """The micro-batches with each document's completion replaced by one the student samples for its prompt
        (the document up to its first supervised token; documents without one are dropped), packed as the collate
        step packs them (labels on the sampled tokens, the stop token included), on this device."""
        prompts: list[list[int]] = []
        owners: list[int] = []
        for index, mb in enumerate(batch):
            for prompt in _prompts(mb):
                prompts.append(prompt)
                owners.append(index)
        engine = self.engine if self.engine is not None else self._start_engine()
        self.engine = engine
        engine.sync_weights(self.model)
        sampling = self._step_sampling()
        stop = self._stop_token_ids()
        if prompts:
            rollouts = engine.generate(prompts, sampling, stop)
        else:  # sharded parameters: the other ranks' decoding needs this rank in each forward
            engine.idle_step(sampling, stop)
            rollouts = []
        out = []
        for index, mb in enumerate(batch):
            mine = [r for r, owner in zip(rollouts, owners, strict=True) if owner == index]
            ids = [t for r in mine for t in (*r.prompt_ids, *r.response_ids)]
            labels = [t for r in mine for t in ([IGNORE_INDEX] * len(r.prompt_ids) + list(r.response_ids))]
            lengths = [len(r.prompt_ids) + len(r.response_ids) for r in mine]
            pack = Pack(mb.pack_index, np.asarray(ids, dtype=np.int64), np.asarray(labels, dtype=np.int64), lengths)
            out.append(collate_pack(pack, self.sampling.pad_token_id).to(self.device))
        return out

    # ---- checkpoint ------------------------------------------------------------------------------------------

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Also store the on-policy counters and the engine's state."""
        super().on_save_checkpoint(checkpoint)
        engine = self.engine.state_dict() if self.engine is not None else self._engine_state
        checkpoint["xtl_distill"] = {"steps": self._steps, "on_policy_steps": self._on_policy_steps, "engine": engine}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Restore :meth:`on_save_checkpoint`'s state."""
        super().on_load_checkpoint(checkpoint)
        state = checkpoint.get("xtl_distill", {})
        self._steps = int(state.get("steps", 0))
        self._on_policy_steps = int(state.get("on_policy_steps", 0))
        self._engine_state = state.get("engine", {})
        if self.engine is not None:
            self.engine.load_state_dict(self._engine_state)

    # ---- private ---------------------------------------------------------------------------------------------

    def _start_engine(self) -> RolloutEngine:
        group = self.parallelizer.world_group() if self.parallelizer.shards_parameters else None
        return start_engine(self.engine_settings, self.model, self.hf_dir, self.device, self.sampling.seed, group)

    def _step_sampling(self) -> OnPolicySampling:
        """The sampling settings of this step: the seed mixed with the step and this rank, so that each step's
        samples are fixed by the run's settings (the same after a resume) and the ranks draw differently."""
        values = {f.name: getattr(self.sampling, f.name) for f in fields(OnPolicySampling)}
        values["seed"] = int(
            np.random.default_rng([self.sampling.seed, self.global_step, self.global_rank]).integers(2**31)
        )
        return OnPolicySampling(**values)

    def _stop_token_ids(self) -> tuple[int, ...]:
        """The data's tokenizer's and template's stop tokens (looked up once), else the sampling settings' only."""
        if self._stop is None:
            datamodule = self._trainer.datamodule if self._trainer is not None else None
            found = ()
            if isinstance(datamodule, XTLDataModule):
                found = stop_token_ids(datamodule.load_tokenizer(), datamodule.template)
            self._stop = tuple(sorted({*found, *self.sampling.stop_token_ids}))
        return self._stop


def _prompts(mb: MicroBatch) -> list[list[int]]:
    """Each document's tokens before its first supervised token (documents without one, and padding, left out)."""
    ids = mb.seq_ctx.input_ids[0].tolist()
    labels = mb.labels[0].tolist()
    bounds = mb.seq_ctx.doc_bounds or tuple(mb.seq_ctx.cu_seq_lens.tolist())
    docs = len(bounds) - 1 - (1 if mb.seq_ctx.num_padding else 0)
    prompts = []
    for k in range(docs):
        start, end = bounds[k], bounds[k + 1]
        first = next((j for j in range(start, end) if labels[j] != IGNORE_INDEX), None)
        if first is not None:  # labels are shifted: label j is the target of position j, token j + 1
            prompts.append(ids[start : first + 1])
    return prompts


def _check_range(name: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        raise ConfigError(f"{KEY}.{name} must be in [{low:g}, {high:g}], got {value}")


def _check_teacher(teacher: Any, student: Any) -> None:
    """Refuse a teacher the student's data and head cannot be compared with."""
    if teacher.vision_language:
        raise ConfigError(f"{KEY}.teacher is a vision-language model; DistillModule distills text models")
    if teacher.language_config.num_labels:
        raise ConfigError(
            f"{KEY}.teacher is a sequence-classification model (num_labels {teacher.language_config.num_labels}); "
            "the teacher must be a causal LM"
        )
    if teacher.vocab_size != student.vocab_size:
        raise ConfigError(
            f"{KEY}.teacher has vocab_size {teacher.vocab_size} and the student {student.vocab_size}; distillation "
            "compares their distributions token by token: use a teacher with the student's vocabulary and tokenizer"
        )


def _check_tokenizer(teacher_dir: Path, datamodule: XTLDataModule) -> None:
    """Refuse a teacher directory whose tokenizer maps tokens to other ids than the data's tokenizer."""
    if not (teacher_dir / "tokenizer_config.json").is_file():
        return
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(str(teacher_dir)).get_vocab()
    ours = datamodule.load_tokenizer().get_vocab()
    if theirs != ours:
        differ = sorted(set(theirs.items()) ^ set(ours.items()))[:1]
        raise ConfigError(
            f"{KEY}.teacher: its tokenizer ({teacher_dir}) differs from data.tokenizer (e.g. {differ[0]}); the "
            "teacher must share the student's tokenizer"
        )
