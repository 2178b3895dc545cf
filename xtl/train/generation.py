"""Cached decoding with an xtl model: greedy or sampled (temperature, top-k, top-p), stop tokens, a token budget.

:func:`generate` prefills a batch of prompts into a :class:`~xtl.module.kv_cache.KVCache` (packed: the prompts
laid end to end, no padding; or padded: left-padded like transformers), then decodes one token per sequence and
step, attending over the cache. It works for every model family (dense, MoE, multi-head latent attention, sink
attention, vision-language: a prompt's images go through the vision tower in the prefill, and decoding continues at
the M-RoPE position after them). With the HF-parity selectors (``xtl.ops.hf_impl``) and the padded prefill, greedy
decoding is bitwise equal to transformers' ``generate(do_sample=False)`` (logits included). The prompt helpers
render chat prompts and find stop tokens.

Example::

    config = GenerationConfig(max_new_tokens=32, stop_token_ids=(eos,))
    new_ids = generate(model, [prompt_ids_a, prompt_ids_b], config).sequences
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, get_args

import torch
from torch.distributed.tensor import DTensor

from xtl.batch import SequenceContext
from xtl.data.templates import HF_TEMPLATE, TEMPLATES, get_template
from xtl.model import BaseModel
from xtl.module.kv_cache import KVCache

Prefill = Literal["packed", "padded"]
PREFILLS: tuple[str, ...] = get_args(Prefill)
THINK_END = "</think>"


@dataclass
class GenerationConfig:
    """How to decode.

    Args:
        max_new_tokens: Tokens to generate per prompt at most.
        temperature: 0 decodes greedily (argmax); above 0 samples from ``softmax(logits / temperature)``.
        top_k: When sampling, keep the ``top_k`` most likely tokens (0: all).
        top_p: When sampling, keep the smallest set of most likely tokens whose probability reaches ``top_p``
            (nucleus sampling; 1.0: all).
        seed: Seed of the sampling generator when :func:`generate` is given none.
        stop_token_ids: A sequence ends after emitting one of these (the stop token is part of its output).
        pad_token_id: Fed to sequences that have stopped while others go on (as transformers does).
        prefill: ``packed`` (prompts end to end, no padding) or ``padded`` (left padding, as transformers).

    Raises:
        ValueError: Naming the first setting out of range.
    """

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0
    prefill: Prefill = "packed"

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0: greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1: off), got {self.top_p}")
        if self.prefill not in PREFILLS:
            raise ValueError(f"prefill must be one of {PREFILLS}, got {self.prefill!r}")
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)

    @property
    def do_sample(self) -> bool:
        """Whether tokens are sampled (``temperature > 0``) rather than chosen greedily."""
        return self.temperature > 0

    def with_tokenizer(self, tokenizer: Any, template: str | None = None) -> GenerationConfig:
        """This config plus the stop tokens of ``tokenizer`` and ``template`` (:func:`stop_token_ids`), feeding
        the tokenizer's pad token (if it has one) to finished sequences."""
        stop = tuple(sorted({*self.stop_token_ids, *stop_token_ids(tokenizer, template)}))
        pad = self.pad_token_id if tokenizer.pad_token_id is None else int(tokenizer.pad_token_id)
        return replace(self, stop_token_ids=stop, pad_token_id=pad)


torch.serialization.add_safe_globals([GenerationConfig])  # a hyperparameter in checkpoints (weights_only loads)


@dataclass
class GenerationOutput:
    """What :func:`generate` returns.

    Attributes:
        sequences: The new tokens of each prompt (without the prompt; ending with the stop token if one came).
        logits: Per step, the ``(B, V)`` float32 next-token logits of every sequence (with ``output_logits``).
        logprobs: Per sequence, the log-probability of each new token under the sampling temperature,
            ``log_softmax(logits / temperature)[token]`` (with ``output_logprobs``; what the trainer's scorer computes
            for the same tokens, so the two compare in an importance ratio).
    """

    sequences: list[list[int]]
    logits: list[torch.Tensor] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)


def generate(
    model: BaseModel,
    prompts: Sequence[Sequence[int]],
    config: GenerationConfig | None = None,
    generator: torch.Generator | None = None,
    output_logits: bool = False,
    group: Any = None,
    stop_when: Callable[[list[list[int]]], Sequence[bool]] | None = None,
    output_logprobs: bool = False,
    images: Sequence[dict[str, torch.Tensor] | None] | None = None,
) -> GenerationOutput:
    """Decode continuations of ``prompts`` with a KV cache (the model runs in eval mode meanwhile).

    Decoding runs under ``torch.inference_mode`` (less work per op than ``torch.no_grad``, which counts when each
    op is small), or under ``torch.no_grad`` when the parameters are sharded (DTensors): FSDP2 allocates its
    gathered parameters on first use, and they must not be inference tensors when training uses them.

    Args:
        model: An xtl model (dense or MoE family).
        prompts: Token ids of each prompt (non-empty).
        config: Decoding settings (default: greedy, 32 new tokens, no stop token).
        generator: Random generator for sampling (default: one seeded with ``config.seed`` on the model's device).
        output_logits: Keep each step's next-token logits in the output.
        group: A process group whose ranks decode different prompts in lockstep (sharded parameters: every forward
            needs every rank): decoding stops when every rank's sequences have stopped (``None``: this process).
        stop_when: Called on the host after each step with every sequence's new tokens so far; a sequence it marks
            ``True`` ends there (stop strings; its output is cut after the current token).
        output_logprobs: Return each new token's log-probability at the sampling temperature.
        images: A vision-language model's images, per prompt (``None``: a prompt without images): the
            ``pixel_values`` and ``image_grid_thw`` of the images whose placeholders the prompt holds, in order. They
            go through the vision tower in the prefill, and decoding continues at each prompt's M-RoPE position
            (:meth:`~xtl.model.BaseModel.next_positions`).

    Returns:
        GenerationOutput: The new tokens of each prompt (and the logits when asked).

    Raises:
        ValueError: For an empty prompt.
    """
    config = config or GenerationConfig()
    if not prompts:
        return GenerationOutput([])
    if any(len(p) == 0 for p in prompts):
        raise ValueError("generate: every prompt needs at least one token")
    device = next(model.parameters()).device
    if generator is None and config.do_sample:
        generator = torch.Generator(device=device).manual_seed(config.seed)
    was_training = model.training
    model.eval()
    sharded = any(isinstance(p, DTensor) for p in model.parameters())
    try:
        with torch.no_grad() if sharded else torch.inference_mode():
            prompts = [list(p) for p in prompts]
            extras = _packed_images(images, len(prompts), device)
            return _decode(
                model, prompts, config, generator, output_logits, device, group, stop_when, output_logprobs, extras
            )
    finally:
        model.train(was_training)


def sample_next(logits: torch.Tensor, config: GenerationConfig, generator: torch.Generator | None) -> torch.Tensor:
    """Choose the next token of each row of ``logits`` ``(B, V)``: argmax, or a sample after temperature, top-k and
    top-p (in transformers' order)."""
    if not config.do_sample:
        return logits.argmax(dim=-1)
    scores = logits / config.temperature
    if config.top_k:
        kth = torch.topk(scores, min(config.top_k, scores.shape[-1]), dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if config.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False, dim=-1)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - config.top_p
        drop[..., -1:] = False  # the most likely token always stays
        scores = scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


def chat_prompt_ids(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    template: str | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Token ids of ``messages`` rendered with a generation prompt.

    Args:
        tokenizer: A transformers tokenizer.
        messages: OpenAI-style messages (a trailing assistant turn is part of the prompt: drop it before).
        template: A built-in xtl template (``qwen3``, ``chatml``, ``qwen2.5``, ``llama3``), or ``None`` / ``hf``
            for the tokenizer's own chat template.
        template_kwargs: Built-in template overrides (e.g. ``date_string`` for llama3).
    """
    if template in (None, HF_TEMPLATE):
        ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
        return list(ids)
    text = get_template(template, **(template_kwargs or {})).render(messages, add_generation_prompt=True).text
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def stop_token_ids(tokenizer: Any, template: str | None = None) -> tuple[int, ...]:
    """The tokenizer's EOS, the end-of-turn tokens it knows (``<|im_end|>``, ``<|eot_id|>``) and the stop token of
    the built-in ``template``, sorted."""
    names = {"<|im_end|>", "<|eot_id|>"}
    if template in TEMPLATES:
        names.add(TEMPLATES[template].stop_token)
    vocab = tokenizer.get_vocab()
    stop = {vocab[name] for name in names if name in vocab}
    if tokenizer.eos_token_id is not None:
        stop.add(int(tokenizer.eos_token_id))
    return tuple(sorted(stop))


def special_token_ids(tokenizer: Any, template: str | None = None) -> dict[str, int | list[int] | None]:
    """The special-token ids an HF export carries so that transformers' ``generate`` stops where xtl stops.

    ``eos_token_id`` lists the end-of-turn token of ``template`` first (the one a chat model ends its answer with),
    then the other :func:`stop_token_ids`; ``pad_token_id`` is the tokenizer's, else that end-of-turn token;
    ``bos_token_id`` the tokenizer's (``None`` when it has none).
    """
    stops = list(stop_token_ids(tokenizer, template))
    turn_end = TEMPLATES[template].stop_token if template in TEMPLATES else None
    first = tokenizer.get_vocab().get(turn_end) if turn_end else None
    if first is not None and first in stops:
        stops = [first, *(t for t in stops if t != first)]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (stops[0] if stops else None)
    bos = tokenizer.bos_token_id
    return {
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": stops if len(stops) != 1 else stops[0],
        "pad_token_id": None if pad is None else int(pad),
    }


def split_thinking(text: str) -> tuple[str, str]:
    """``(reasoning, answer)`` of a decoded reply: the text before and after a leading ``... </think>``."""
    if THINK_END not in text:
        return "", text.strip()
    reasoning, answer = text.split(THINK_END, 1)
    return reasoning.replace("<think>", "", 1).strip(), answer.strip()


# ---- private ---------------------------------------------------------------------------------------------------


def _decode(
    model: BaseModel,
    prompts: list[list[int]],
    config: GenerationConfig,
    generator: torch.Generator | None,
    output_logits: bool,
    device: torch.device,
    group: Any = None,
    stop_when: Callable[[list[list[int]]], Sequence[bool]] | None = None,
    output_logprobs: bool = False,
    images: dict[str, torch.Tensor] | None = None,
) -> GenerationOutput:
    batch = len(prompts)
    lengths = [len(p) for p in prompts]
    cache = KVCache(batch, max(lengths) + config.max_new_tokens)
    packed = SequenceContext.from_lengths(torch.tensor([[t for p in prompts for t in p]], device=device), lengths)
    packed.extras = dict(images or {})
    logits = _prefill(model, prompts, config, cache, device, packed)
    positions = model.next_positions(packed)[:, None]
    stop = torch.tensor(config.stop_token_ids, dtype=torch.long, device=device)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    steps: list[torch.Tensor] = []
    kept: list[torch.Tensor] = []
    scored: list[torch.Tensor] = []  # each step's log-probability of its token (output_logprobs)
    ends = [config.max_new_tokens] * batch  # where stop_when ended each sequence
    # without stop tokens, stop_when or a group to keep in step with, every sequence runs the whole budget: no
    # per-step stop bookkeeping, and no device-to-host sync
    may_stop = bool(config.stop_token_ids) or stop_when is not None or group is not None
    for step in range(config.max_new_tokens):
        if output_logits:
            kept.append(logits)
        token = sample_next(logits, config, generator)
        if output_logprobs:
            temperature = config.temperature if config.do_sample else 1.0
            scored.append(torch.log_softmax(logits / temperature, dim=-1).gather(-1, token[:, None])[:, 0])
        if may_stop:
            token = token.masked_fill(finished, config.pad_token_id)
            finished = finished | torch.isin(token, stop)
        steps.append(token)
        if stop_when is not None:
            finished = _apply_stop_when(stop_when, steps, finished, ends, step)
        if step + 1 == config.max_new_tokens or (may_stop and _all_finished(finished, group)):
            break
        out = model(input_ids=token[:, None], position_ids=positions, kv_cache=cache, logits_to_keep=1)
        positions = positions + 1
        logits = _last_logits(out.logits)
    rows = _cut_at_stop([row[:end] for row, end in zip(torch.stack(steps, dim=1).tolist(), ends)],
                        set(config.stop_token_ids))  # fmt: skip
    logprobs = []
    if output_logprobs:
        logprobs = [values[: len(row)] for row, values in zip(rows, torch.stack(scored, dim=1).tolist(), strict=True)]
    return GenerationOutput(rows, kept, logprobs)


def _prefill(
    model: BaseModel,
    prompts: list[list[int]],
    config: GenerationConfig,
    cache: KVCache,
    device: torch.device,
    packed: SequenceContext,
) -> torch.Tensor:
    """Run the prompts (``packed``: laid end to end, with their images) into ``cache``; returns the ``(B, V)``
    float32 logits of each prompt's last token."""
    if config.prefill == "packed":
        out = model(seq_ctx=packed, kv_cache=cache, logits_to_keep=packed.cu_seq_lens[1:].long() - 1)
        return _full(out.logits)[0].float()
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), config.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
    # with images, the model derives its M-RoPE positions from the placeholders and the padding mask
    inputs = dict(packed.extras) if packed.extras else {"position_ids": position_ids.to(device)}
    out = model(
        input_ids=ids.to(device), attention_mask=attention_mask.to(device), kv_cache=cache, logits_to_keep=1, **inputs
    )
    return _last_logits(out.logits)


def _packed_images(
    images: Sequence[dict[str, torch.Tensor] | None] | None, count: int, device: torch.device
) -> dict[str, torch.Tensor] | None:
    """The images of every prompt, in prompt order, as one ``pixel_values`` and ``image_grid_thw`` (``None``: no
    prompt has images)."""
    if images is None:
        return None
    if len(images) != count:
        raise ValueError(f"generate: {len(images)} image entries for {count} prompts")
    present = [entry for entry in images if entry]
    if not present:
        return None
    return {key: torch.cat([entry[key] for entry in present]).to(device) for key in ("pixel_values", "image_grid_thw")}


def _apply_stop_when(
    stop_when: Callable[[list[list[int]]], Sequence[bool]],
    steps: list[torch.Tensor],
    finished: torch.Tensor,
    ends: list[int],
    step: int,
) -> torch.Tensor:
    """``finished`` plus the sequences ``stop_when`` ends now (their output is cut after this step's token)."""
    done = finished.tolist()
    flags = stop_when(torch.stack(steps, dim=1).tolist())
    for row, flag in enumerate(flags):
        if flag and not done[row]:
            ends[row] = step + 1
            done[row] = True
    return torch.tensor(done, device=finished.device)


def _all_finished(finished: torch.Tensor, group: Any) -> bool:
    """Whether every sequence has stopped, here and (with ``group``) on every rank of ``group``."""
    if group is None:
        return bool(finished.all())
    done = finished.all().to(torch.int32).reshape(1)
    torch.distributed.all_reduce(done, op=torch.distributed.ReduceOp.MIN, group=group)
    return bool(done.item())


def _last_logits(logits: torch.Tensor) -> torch.Tensor:
    return _full(logits)[:, -1].float()


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A replicated tensor from a tensor-parallel (DTensor) output; a plain tensor unchanged."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _cut_at_stop(rows: list[list[int]], stop: set[int]) -> list[list[int]]:
    out = []
    for row in rows:
        end = next((i + 1 for i, t in enumerate(row) if t in stop), len(row))
        out.append(row[:end])
    return out
