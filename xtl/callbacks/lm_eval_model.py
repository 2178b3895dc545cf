"""An xtl model as an lm-evaluation-harness model: packed log-likelihoods and cached greedy generation.

:class:`XTLLM` answers lm-eval's three request types with the model in place (sharded or not; no export, no second
copy of the weights):

- ``loglikelihood`` / ``loglikelihood_rolling``: the requests (or rolling windows) of a batch are laid end to end in
  one packed row (``SequenceContext``: attention never crosses a request), the LM head runs only on the positions
  that predict continuation tokens, and each request's log-probabilities are summed exactly. Tokenization, left
  truncation and the rolling windows follow lm-eval's ``hf`` model, so the numbers equal ``lm_eval --model hf`` on
  the same weights.
- ``generate_until``: batched KV-cache decoding (:func:`xtl.train.generation.generate`), stopping at the EOS token
  or when a stop sequence appears; the text is cut at the first stop sequence as lm-eval's ``hf`` model cuts it.

With a process group of several ranks, lm-eval gives each rank its share of the requests and gathers the scores on
rank 0. Sharded parameters need every rank in every forward, so the ranks agree (one all-reduce) on how many packs
and decoding batches they run and on the decoding budget; a rank that has run out of requests runs a one-token pack
meanwhile. Under context parallelism the ranks of a context-parallel group are one lm-eval rank: they take the same
requests, each scores its share of every packed row (:func:`~xtl.train.scorer.score_tokens`, made whole over the
group), and they decode whole sequences in step (the model attends whole sequences meanwhile).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from xtl.batch import SequenceContext
from xtl.data.collate import MicroBatch, split_for_context_parallel
from xtl.data.item import IGNORE_INDEX
from xtl.data.templates import HF_TEMPLATE, get_template
from xtl.model import BaseModel
from xtl.train.generation import GenerationConfig, generate
from xtl.train.scorer import pack_values, score_tokens

Request = tuple[tuple[str, str] | None, list[int], list[int]]


class XTLLM(TemplateLM):
    """lm-eval's model interface over an xtl model and its tokenizer.

    Args:
        model: The xtl model (plain, or sharded by FSDP2 / expert parallelism).
        tokenizer: Its transformers tokenizer.
        batch_size: Requests per packed forward (log-likelihoods) and prompts per decoding batch.
        max_length: Context length in tokens (default: the model's ``max_position_embeddings``, as lm-eval's ``hf``
            model reads it).
        max_gen_toks: Decoding budget when a task sets none (lm-eval's default 256).
        template: The chat template lm-eval's ``apply_chat_template`` renders with: a built-in xtl template
            (``qwen3``, ...) or ``None`` / ``hf`` for the tokenizer's own.
        template_kwargs: Built-in template overrides.
        group: Process group of the ranks that evaluate together (``None``: this process alone).
        context_group: The context-parallel group of this rank within ``group`` (``None``: none); its ranks are
            consecutive in ``group`` (the parallel layout's order) and form one lm-eval rank.
        whole_sequences: A context in which the model attends whole sequences of each rank (decoding under context
            parallelism: :meth:`~xtl.strategies.parallelize.ParallelizingStrategy.whole_sequences`).
    """

    def __init__(
        self,
        model: BaseModel,
        tokenizer: Any,
        batch_size: int = 16,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        template: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
        group: Any = None,
        context_group: Any = None,
        whole_sequences: Callable[[], AbstractContextManager[None]] | None = None,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self._max_length = max_length or int(model.text_model().config.max_position_embeddings)
        self._max_gen_toks = max_gen_toks
        self.template = template
        self.template_kwargs = template_kwargs or {}
        self.group = group
        self.context_group = context_group
        self._whole_sequences = whole_sequences or nullcontext
        self._device = next(model.parameters()).device
        distributed = group is not None and dist.is_initialized()
        self._cp = dist.get_world_size(context_group) if context_group is not None else 1
        self._cp_rank = dist.get_rank(context_group) if context_group is not None else 0
        self._ranks = dist.get_world_size(group) if distributed else 1  # every rank of the group
        self._rank = (dist.get_rank(group) if distributed else 0) // self._cp
        self._world_size = self._ranks // self._cp

    # ---- lm-eval's interface -----------------------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        """The tokenizer's EOS token."""
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """The token an empty context starts from: BOS, else EOS (as lm-eval's ``hf`` model)."""
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        """Context length in tokens."""
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        """Decoding budget when a task sets none."""
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        """Name of the tokenizer (lm-eval fingerprints request caches with it)."""
        return str(self.tokenizer.name_or_path).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """Token ids of ``string`` (the tokenizer's own special-token rule unless ``add_special_tokens`` is given)."""
        extra = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        return list(self.tokenizer.encode(string, **extra))

    def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``tokens``."""
        return self.tokenizer.decode(list(tokens), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """``chat_history`` rendered as text with the chat template (a generation prompt, or the last assistant
        message left open)."""
        if self.template in (None, HF_TEMPLATE):
            return self.tokenizer.apply_chat_template(
                chat_history,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=not add_generation_prompt,
            )
        rendered = get_template(self.template, **self.template_kwargs).render(
            chat_history, add_generation_prompt=add_generation_prompt
        )
        text = rendered.text
        if not add_generation_prompt and chat_history and chat_history[-1]["role"] == "assistant":
            content = chat_history[-1]["content"]
            text = text[: text.rindex(content) + len(content)]  # leave the final message open
        return text

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = True) -> list[tuple[float, bool]]:
        """``(log p(continuation | context), greedy)`` of each ``(context, continuation)`` request (lm-eval's
        tokenization of the pair; no progress bar)."""
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm)

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """The log-likelihood of each whole string: disjoint windows of at most ``max_length`` tokens after a prefix
        token, every token predicted once (lm-eval's rolling windows)."""
        windows: list[Request] = []
        counts = []
        for (string,) in (req.args for req in requests):
            rolling = get_rolling_token_windows(
                token_list=self.tok_encode(string),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            parts = [(None, *make_disjoint_window(w)) for w in rolling]
            windows += parts
            counts.append(len(parts))
        scores = self._loglikelihood_tokens(windows)
        totals, start = [], 0
        for count in counts:
            totals.append(sum(score for score, _ in scores[start : start + count]))
            start += count
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Decode each ``(context, gen_kwargs)`` request until EOS, a stop sequence or its token budget."""
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        plans = []  # (request index, prompt ids, decoding settings, stop sequences, budget), in batches
        groups: dict[str, list[int]] = {}
        for index, (_, kwargs) in enumerate(req.args for req in requests):
            groups.setdefault(json.dumps(kwargs, sort_keys=True, default=str), []).append(index)
        for indices in groups.values():
            kwargs = normalize_gen_kwargs(dict(requests[indices[0]].args[1]), self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            budget = int(kwargs.pop("max_gen_toks"))
            settings = _decoding_settings(kwargs)
            keep = self.max_length - budget
            if keep <= 0:
                raise ValueError(
                    f"max_gen_toks {budget} leaves no room for the context in max_length {self.max_length}"
                )
            encoded = {i: self.tok_encode(requests[i].args[0])[-keep:] for i in indices}
            order = sorted(indices, key=lambda i: -len(encoded[i]))
            for start in range(0, len(order), self.batch_size):
                chunk = order[start : start + self.batch_size]
                plans.append((chunk, [encoded[i] for i in chunk], settings, until, budget))
        out: list[str] = [""] * len(requests)
        for turn in range(self._agree(len(plans))):
            if turn < len(plans):
                chunk, prompts, settings, until, budget = plans[turn]
            else:  # this rank has no more requests: one sequence, finished after one token, while the others decode
                chunk, prompts, settings, until, budget = [], [[self.prefix_token_id]], {}, [], 1
            texts = self._decode(prompts, settings, until, budget)
            for index, text in zip(chunk, texts):
                out[index] = text
        return out

    # ---- collectives lm-eval's evaluator uses ------------------------------------------------------------------

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` of every lm-eval rank, stacked (rank order; one per context-parallel group)."""
        if self._ranks == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self._ranks)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.stack(parts[:: self._cp])

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """``obj`` of every lm-eval rank on lm-eval rank ``dst`` (``None`` elsewhere; under context parallelism
        every rank of ``dst``'s group gets them, as each is lm-eval rank ``dst``)."""
        if self._ranks == 1:
            return [obj]
        if self._cp == 1:
            gathered = [None] * self._ranks if self.rank == dst else None
            dist.gather_object(obj, gathered, dst=dist.get_global_rank(self.group, dst), group=self.group)
            return gathered
        everything: list[Any] = [None] * self._ranks
        dist.all_gather_object(everything, obj, group=self.group)
        return everything[:: self._cp] if self.rank == dst else None

    def barrier(self) -> None:
        """Wait for every rank of the group."""
        if self._ranks > 1:
            dist.barrier(group=self.group)

    # ---- private -----------------------------------------------------------------------------------------------

    @torch.no_grad()
    def _loglikelihood_tokens(
        self, requests: list[Request], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """``(sum of log p(continuation), greedy)`` of each ``(key, context ids, continuation ids)`` request."""
        inputs = []
        for _, context, continuation in requests:
            if not context or not continuation:
                raise ValueError("a log-likelihood request needs a context and a continuation token")
            whole = (list(context) + list(continuation))[-(self.max_length + 1) :]
            inputs.append((whole[:-1], whole[-len(continuation) :]))
        order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i][0]))
        batches = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        results: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
        was_training = self.model.training
        self.model.eval()
        try:
            for turn in range(self._agree(len(batches))):
                if turn >= len(batches):
                    self._score([([self.prefix_token_id], [self.prefix_token_id])])
                    continue
                for index, result in zip(batches[turn], self._score([inputs[i] for i in batches[turn]])):
                    results[index] = result
        finally:
            self.model.train(was_training)
        return results

    def _score(self, pack: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """One packed forward over ``(input ids, target ids)`` pairs; the targets are the last inputs' successors
        (under context parallelism each rank scores its share of the row)."""
        ids = torch.tensor([[t for inp, _ in pack for t in inp]])
        seq_ctx = SequenceContext.from_lengths(ids, [len(inp) for inp, _ in pack])
        ends = seq_ctx.doc_bounds[1:]
        keep = torch.tensor([p for end, (_, tgt) in zip(ends, pack) for p in range(end - len(tgt), end)])
        labels = torch.full_like(ids, IGNORE_INDEX)
        labels[0, keep] = torch.tensor([t for _, tgt in pack for t in tgt])
        seq_ctx.loss_positions = keep  # the head runs on the scored positions only
        batch = MicroBatch(seq_ctx, labels, keep.numel(), ids.numel())
        if self._cp > 1:
            batch = split_for_context_parallel(batch, self._cp_rank, self._cp)
        batch = batch.to(self._device)
        scores = score_tokens(self.model, batch.seq_ctx, batch.labels, greedy=True)
        keep = keep.to(self._device)
        picked = pack_values(scores, keep, group=self.context_group)
        greedy = pack_values(scores, keep, scores.greedy.to(picked.dtype), group=self.context_group)
        out, start = [], 0
        for _, tgt in pack:  # summed per request in float32, as lm-eval's hf model sums
            n = len(tgt)
            out.append((float(picked[start : start + n].sum()), bool(greedy[start : start + n].all())))
            start += n
        return out

    def _decode(self, prompts: list[list[int]], settings: dict[str, Any], until: list[str], budget: int) -> list[str]:
        """Decode ``prompts`` (in step with the other ranks) and cut each text at its first stop sequence."""
        steps = self._agree(budget)  # the ranks decode in step up to the largest budget; each row stops at its own

        def stop_when(rows: list[list[int]]) -> list[bool]:
            return [len(row) >= budget or any(s in self.tok_decode(row) for s in until) for row in rows]

        config = GenerationConfig(max_new_tokens=steps, stop_token_ids=(self.eot_token_id,), **settings)
        group = self.group if self._ranks > 1 else None
        with self._whole_sequences():
            rows = generate(self.model, prompts, config, group=group, stop_when=stop_when).sequences
        return [postprocess_generated_text(self.tok_decode(row[:budget]), until, None) for row in rows]

    def _agree(self, count: int) -> int:
        """The largest ``count`` over the ranks (every rank runs as many forwards)."""
        if self._ranks == 1:
            return count
        value = torch.tensor([count], dtype=torch.long)
        if dist.get_backend(self.group) == "nccl":
            value = value.to(self._device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.group)
        return int(value.item())


def _decoding_settings(kwargs: dict[str, Any]) -> dict[str, Any]:
    """:class:`GenerationConfig` fields from a task's generation kwargs (greedy unless it samples)."""
    temperature = float(kwargs.get("temperature", 0.0) or 0.0)
    if not kwargs.get("do_sample", False) or temperature <= 0:
        return {}
    settings: dict[str, Any] = {"temperature": temperature}
    if kwargs.get("top_p") is not None:
        settings["top_p"] = float(kwargs["top_p"])
    if kwargs.get("top_k") is not None:
        settings["top_k"] = int(kwargs["top_k"])
    return settings
