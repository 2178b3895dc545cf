"""A judger that scores with a reward model: any Hugging Face ``*ForSequenceClassification`` checkpoint with one
label (xtl's :class:`~xtl.train.RewardModule` export, or one trained elsewhere).

A state's conversation (its prompt and response; a multi-turn rollout's whole ``messages``) is rendered and tokenized
by the code that rendered the reward model's training pairs (:class:`~xtl.data.preference.PreferenceTokenizeFn`'s
chat encoder, with the same template), so the model scores what it was trained on. A batch is right-padded and run
through transformers' ``AutoModelForSequenceClassification``, which reads each sequence's reward at its last non-pad
token, where xtl's ``RewardModule`` reads it in training.

The model is loaded on first use, in the process that judges: the judger pickles without it, so it runs colocated
(in the trainer's process), on a Ray actor (:class:`~xtl.rl.remote.RayJudger`) or as a branch of a
:class:`~xtl.rl.ComposedJudger` beside rule judgers. Its forwards run on a daemon thread: a hung one fails its batch
after ``timeout_s`` and never keeps the process from exiting.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import torch

from xtl.data.item import DataError
from xtl.data.preference import PreferenceTokenizeFn, unsupervised_prompt
from xtl.errors import ConfigError
from xtl.rl.daemon_pool import DaemonThreadPool
from xtl.rl.judger import Judger, JudgerOutput, JudgerPayload, RolloutState
from xtl.utils import resolve_pretrained

KEY = "judger.init_args"
SEQUENCE_CLASSIFICATION_SUFFIX = "ForSequenceClassification"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class RewardModelJudger(Judger):
    """Scores each response with a reward model: ``{"score": scale * r + offset, "raw_score": r}``, ``r`` the
    model's scalar output for the rendered conversation.

    Everything that can be checked without the weights is checked when the judger is built (the checkpoint's
    config, the tokenizer, the template); the weights load on the first judging call, outside any batch's
    ``timeout_s`` (a load that fails fails the states of that call, with the error). Forwards run one at a time on a
    thread of the judger's own (not the event loop), under ``torch.no_grad()``; the judger leaves torch's threads as
    the process has them (colocated: the trainer's).

    Args:
        model: The reward model's HF directory (config, weights; ``env:VAR`` and hub ids resolve as for
            ``model.init_args.model``): a ``*ForSequenceClassification`` checkpoint with ``num_labels: 1`` and a
            ``pad_token_id``, e.g. the ``HFExport`` of a ``RewardModule`` run (``<root>/hf/final``).
        template: The chat template the reward model was trained with (its run's ``data.template``).
        tokenizer: The tokenizer directory (default: ``model``, where ``HFExport`` copies it).
        template_kwargs: Template overrides (its run's ``data.template_kwargs``).
        batch_size: Sequences per forward. Larger batches use the model better (fewer, fuller forwards) but pad
            more, hold more activations, and a batch fails as a whole: a time-out or an error costs all its samples.
        timeout_s: Seconds a batch may take before its states fail. Forwards run one at a time and every batch of a
            judging call starts its clock when the call starts, so allow for the batches queued before it:
            ``ceil(samples / batch_size)`` forwards.
        max_length: Longest sequence scored; a longer one keeps its last ``max_length`` tokens (the reward is read at
            the last token, so its end is what must stay). ``None`` (default): no cut, as in training, where a pair
            longer than a pack is dropped, never cut.
        device: Where the model runs (``cpu``, ``cuda``, ``cuda:1``).
        dtype: ``float32`` (default), ``bfloat16`` or ``float16``.
        scale: Multiplies the raw score (group-relative advantages do not change with it unless
            ``objective.scale_rewards: none``; it weighs the reward model against the other branches of a
            :class:`~xtl.rl.ComposedJudger`, which sums their scores).
        offset: Added to the scaled score.
        model_kwargs: Extra keyword arguments of ``from_pretrained`` (``attn_implementation``, ...).

    Raises:
        ConfigError: No model directory, a checkpoint that is not a sequence-classification model with one label or
            has no ``pad_token_id``, a tokenizer that does not load or does not fit the template or the model, a
            template whose rendering ends with the pad token, settings out of range.
    """

    def __init__(
        self,
        model: str,
        template: str = "qwen3",
        tokenizer: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
        batch_size: int = 16,
        timeout_s: float = 300.0,
        max_length: int | None = None,
        device: str = "cpu",
        dtype: str = "float32",
        scale: float = 1.0,
        offset: float = 0.0,
        model_kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(timeout_s=timeout_s, batch_size=batch_size)
        if max_length is not None and max_length < 1:
            raise ConfigError(f"{KEY}.max_length must be >= 1 (or null: no cut), got {max_length}")
        if dtype not in DTYPES:
            raise ConfigError(f"{KEY}.dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
        self.model = _model_dir(model)
        self.tokenizer = _tokenizer_dir(tokenizer) if tokenizer is not None else self.model
        self.template = template
        self.template_kwargs = dict(template_kwargs or {})
        self.max_length = max_length
        self.device = device
        self.dtype = dtype
        self.scale = float(scale)
        self.offset = float(offset)
        self.model_kwargs = dict(model_kwargs or {})
        config = _reward_config(self.model)
        self.pad_token_id = int(config.get_text_config().pad_token_id)
        self._encoder: PreferenceTokenizeFn | None = self._build_encoder()
        self._check_tokenizer(config.get_text_config().vocab_size)
        self._reset()

    def preprocess(self, state: RolloutState) -> JudgerPayload:
        """The conversation to score: a multi-turn rollout's ``messages``, else the prompt (text: one user message;
        or its messages) followed by the response as one assistant message."""
        if state.messages:
            return {"messages": list(state.messages)}
        prompt = state.prompt
        if prompt is None:
            prompt = []
        elif isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        return {"messages": unsupervised_prompt(list(prompt)) + [{"role": "assistant", "content": state.response}]}

    async def judge_payload(self, payloads: list[JudgerPayload]) -> list[JudgerOutput]:
        """Render, tokenize and score one batch on the judger's forward thread."""
        loop = asyncio.get_running_loop()
        raw = await loop.run_in_executor(self._pool(), self._score_batch, payloads)
        return [{"score": self.scale * r + self.offset, "raw_score": r} for r in raw]

    async def outputs(self, payloads: list[JudgerPayload]) -> list[JudgerOutput | BaseException]:
        """Load the model first (once, outside the batches' time-outs), then score the batches; a load that fails
        fails every payload of this call with its error."""
        if payloads and self._model is None:
            loop = asyncio.get_running_loop()
            try:
                await loop.run_in_executor(self._pool(), self.load)
            except Exception as err:  # the contract: a failure costs samples, not the run
                return [err] * len(payloads)
        return await super().outputs(payloads)

    def load(self) -> torch.nn.Module:
        """The reward model, loaded on first call (in eval mode, on ``device``, in ``dtype``)."""
        with self._load_lock:
            if self._model is None:
                from transformers import AutoModelForSequenceClassification

                model = AutoModelForSequenceClassification.from_pretrained(
                    self.model, dtype=DTYPES[self.dtype], **self.model_kwargs
                )
                self._model = model.to(self.device).eval()
            return self._model

    def input_ids(self, payloads: list[JudgerPayload]) -> list[list[int]]:
        """The token ids the model scores for each payload: its conversation rendered by the training pairs' chat
        encoder, cut to its last ``max_length`` tokens.

        Raises:
            DataError: A conversation the template cannot render.
        """
        rows = [{"messages": p["messages"]} for p in payloads]
        encoded = self._chat().chat.batch_arrays(rows, lambda i: f"judged sample {i}")
        ids = [samples[0][0].tolist() for samples in encoded]
        if self.max_length is not None:
            ids = [seq[-self.max_length :] for seq in ids]
        return ids

    def raw_scores(self, sequences: list[list[int]]) -> list[float]:
        """The model's scalar output for each token sequence, in one right-padded forward."""
        model = self.load()
        longest = max(len(seq) for seq in sequences)
        ids = torch.full((len(sequences), longest), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(sequences), longest), dtype=torch.long)
        for row, seq in enumerate(sequences):
            ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
            mask[row, : len(seq)] = 1
        with torch.no_grad():
            logits = model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits
        return logits[:, 0].float().cpu().tolist()

    def __getstate__(self) -> dict[str, Any]:
        """Pickle the settings only: the model, its thread and the tokenizer are rebuilt where the judger runs."""
        state = dict(self.__dict__)
        for name in ("_model", "_load_lock", "_pool_lock", "_executor", "_encoder"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore the settings; the model loads on first use."""
        self.__dict__.update(state)
        self._encoder = None
        self._reset()

    # ---- private ---------------------------------------------------------------------------------------------

    def _reset(self) -> None:
        self._model: torch.nn.Module | None = None
        self._load_lock = threading.Lock()
        self._pool_lock = threading.Lock()
        self._executor: DaemonThreadPool | None = None

    def _pool(self) -> DaemonThreadPool:
        """One daemon thread: forwards of the one model run one at a time, and a hung one never holds the exit."""
        with self._pool_lock:
            if self._executor is None:
                self._executor = DaemonThreadPool(1, "xtl-reward-model")
            return self._executor

    def _score_batch(self, payloads: list[JudgerPayload]) -> list[float]:
        return self.raw_scores(self.input_ids(payloads))

    def _chat(self) -> PreferenceTokenizeFn:
        if self._encoder is None:
            self._encoder = self._build_encoder()
        return self._encoder

    def _build_encoder(self) -> PreferenceTokenizeFn:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(self.tokenizer)
        except (OSError, ValueError) as err:
            raise ConfigError(
                f"{KEY}.tokenizer: no tokenizer loads from {self.tokenizer} ({err}); give the reward model's "
                "tokenizer directory (its run's data.tokenizer)"
            ) from None
        try:
            return PreferenceTokenizeFn(tokenizer, self.template, self.template_kwargs)
        except DataError as err:
            raise ConfigError(f"{KEY}.template: {err}") from None

    def _check_tokenizer(self, vocab: int | None) -> None:
        """Refuse a tokenizer larger than the model's vocabulary, or a pad token that ends a rendered conversation
        (transformers would read the reward one token early)."""
        tokenizer = self._chat().tokenizer
        if vocab is not None and len(tokenizer) > vocab:
            raise ConfigError(
                f"{KEY}.tokenizer: {len(tokenizer)} tokens, more than the model's vocabulary ({vocab}); give the "
                "tokenizer the reward model was trained with"
            )
        probe = {"messages": [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"}]}
        last = self.input_ids([probe])[0][-1]
        if last == self.pad_token_id:
            raise ConfigError(
                f"{KEY}.model: template {self.template!r} ends a conversation with the pad token ({last}), so "
                "transformers would read the reward one token early; set pad_token_id in the model's config.json to "
                "a token the template does not end with"
            )


def _model_dir(model: str) -> str:
    path = Path(resolve_pretrained(str(model), f"{KEY}.model"))
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"{KEY}.model: {path} is not a model directory (no config.json); give the reward model's HF directory, "
            "e.g. the HFExport of a RewardModule run (<root>/hf/final)"
        )
    return str(path)


def _tokenizer_dir(tokenizer: str) -> str:
    path = Path(resolve_pretrained(str(tokenizer), f"{KEY}.tokenizer"))
    if not path.is_dir():
        raise ConfigError(f"{KEY}.tokenizer: {path} is not a directory; give the reward model's tokenizer directory")
    return str(path)


def _reward_config(model: str) -> Any:
    """The checkpoint's transformers config, checked to be a one-label sequence-classification model with a pad
    token."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model)
    except (OSError, ValueError, KeyError) as err:
        raise ConfigError(f"{KEY}.model: transformers cannot read {model}/config.json ({err})") from None
    architectures = list(config.architectures or [])
    if not any(name.endswith(SEQUENCE_CLASSIFICATION_SUFFIX) for name in architectures):
        raise ConfigError(
            f"{KEY}.model: {model} is a {', '.join(architectures) or 'model without architectures'} checkpoint, "
            "not a sequence-classification model; give a reward model (a RewardModule export, or any "
            "*ForSequenceClassification checkpoint with num_labels 1)"
        )
    if config.num_labels != 1:
        raise ConfigError(
            f"{KEY}.model: {model} is a classifier with num_labels {config.num_labels}; a reward model has one "
            "output (num_labels 1)"
        )
    pad = config.get_text_config().pad_token_id
    if pad is None:
        raise ConfigError(
            f"{KEY}.model: {model}/config.json has no pad_token_id, which transformers needs to find each padded "
            "sequence's last token; set it to the tokenizer's pad token id"
        )
    return config
