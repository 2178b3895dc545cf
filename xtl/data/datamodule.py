"""``XTLDataModule``: the whole data seam behind one ``LightningDataModule`` configurable from YAML."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import xxhash

from xtl.data.cache import DEFAULT_CACHE_DIR, TokenizedCache, build_cache, build_cache_part, wait_for_cache
from xtl.data.collate import StepCollator
from xtl.data.consumer import DataConsumer
from xtl.data.dataset import MixedDataset
from xtl.data.item import DataError
from xtl.data.loader import ResumableDataLoader
from xtl.data.packing import (
    OverlongPolicy,
    PackedDataset,
    PackingMode,
    PackPlan,
    best_fit_pack,
    hard_pack,
    load_plan,
    plan_fingerprint,
    preset_pack,
    save_plan,
)
from xtl.data.preference import BAD_ROW_POLICIES, PREFERENCE_KIND, check_pair_plan, dropped_rows
from xtl.data.prompts import PROMPT_KIND, PromptSet, StepTickets
from xtl.data.sampler import EvalStepSampler, RankSteps, SamplerOrder, StepSampler
from xtl.data.sources import FileHashMemo, Source, SourceSpec, open_source
from xtl.data.streaming import (
    STREAM_PACKING,
    StreamingLoader,
    StreamingPacks,
    default_stream_workers,
    stream_settings,
    streaming_summary,
)
from xtl.data.streaming_source import StreamSource
from xtl.data.tokenize import TokenizeFn, tokenizer_fingerprint
from xtl.data.tokenize_fn import build_tokenize_fn
from xtl.data.unpaired import UNPAIRED_KIND
from xtl.utils import resolve_path, resolve_pretrained

log = logging.getLogger(__name__)
PAIR_KINDS = (PREFERENCE_KIND, UNPAIRED_KIND)  # kinds whose rows become two samples kept together


@dataclass
class PackedSplit:
    """A tokenized, mixed and packed dataset with its plan (one for training, one per validation set).

    ``pairs``: a preference set (``kind: preference``, or ``unpaired_preference``), whose packs hold whole pairs;
    ``dropped_rows``: rows of its sources skipped under ``bad_rows: drop``; ``key``: a fingerprint of what its packs
    hold (:func:`~xtl.data.packing.plan_fingerprint` of the cache entries, the mixing and the packing, or of a preset
    plan's table), for results computed from the packs and cached beside them (precomputed reference
    log-probabilities).
    """

    data: MixedDataset
    plan: PackPlan
    packs: PackedDataset
    pairs: bool = False
    dropped_rows: int = 0
    key: str = ""


class XTLDataModule(pl.LightningDataModule):
    """Sources -> cached tokenization -> packing -> per-rank step batches (``list[MicroBatch]``).

    Every train batch is one optimizer step of this rank: ``micro_batches_per_step`` packed micro-batches. Paths
    starting with ``tiny:`` resolve inside ``xtl.data.tiny_assets_dir()``, ``env:VAR`` to an environment variable
    (``xtl.utils.resolve_path``); ``tokenizer: "tiny:"`` is the embedded tokenizer.

    Preference data (``kind: preference`` sources, :mod:`xtl.data.preference`): every row is a chosen and a rejected
    sample; mixing and ``best_fit`` packing keep each pair whole, so the documents of a micro-batch alternate chosen,
    rejected (pair ``k`` = documents ``2k`` and ``2k + 1``). A set (the training sources, or one validation or test
    set) is all preference sources or none. Rows skipped under ``bad_rows: drop`` are logged and counted in
    ``dropped_rows``. Unpaired preference data (``kind: unpaired_preference``, KTO; :mod:`xtl.data.unpaired`) is
    kept the same way: every row is its own sample and a mismatched one (for the KL estimate), and every document
    carries its row's label (``MicroBatch.doc_tags``).

    Prompt data (``kind: prompt`` sources, :mod:`xtl.data.prompts`) is for RL: nothing is tokenized or packed; the
    RL module draws rows itself (:meth:`take`), the train loader only counts steps, and a prompt validation set
    yields batches of rows (``predict_batch_size`` at a time). A set is all prompt sources or none.

    Args:
        sources (list[SourceSpec]): Training sources, mixed by their ``sample_ratio``.
        tokenizer (str): Tokenizer folder (``AutoTokenizer.from_pretrained``).
        template (str): Chat template for ``kind: chat`` sources (``qwen3``, ``chatml``, ``qwen2.5``, ``llama3``,
            ``hf``).
        pack_max_length (int): Tokens per pack (micro-batch length).
        packing (str): ``best_fit`` (SFT, samples never split), ``hard`` (pretraining stream cut) or ``preset``.
        micro_batches_per_step (int): Packs per rank per optimizer step.
        seed (int): Seed of mixing, packing and sampling.
        num_workers (int | None): DataLoader worker processes per loader. ``None`` (default): 2 when training on
            CUDA, so reading and collating the next packs overlaps the step; 0 otherwise (on CPU the workers compete
            with the step for the same cores and only add start-up and transfer cost). Raise it for image data.
        cache_dir (str | None): Cache root (default ``~/.cache/xtl/tokenized``): tokenized entries, pack plans
            (``plans/``) and remembered source hashes (``fingerprints/``).
        val_sources (dict[str, list[SourceSpec]] | None): Named validation sets.
        sampler (str): ``random``, ``length_grouped`` or ``preset``.
        pack_preset (str | None): ``.npy`` pack table for ``packing: preset``.
        sampler_preset (str | None): ``.npy`` pack order for ``sampler: preset``.
        overlong (str): Samples longer than a pack under best-fit: ``truncate``, ``drop`` or ``error``. A preference
            pair longer than a pack is dropped under ``truncate`` too (cutting it would change what it compares).
        pad_to_max_length (bool): Pad every pack to ``pack_max_length`` (fixed shapes).
        template_kwargs (dict[str, Any] | None): Template overrides (e.g. ``date_string`` for llama3).
        pretrain_eos_token (str | None): EOS appended to ``kind: text`` documents (default: the tokenizer's).
        tokenize_workers (int | None): Processes for building the cache (default: up to 8 for large sources).
        val_micro_batches (int | None): Packs per rank per validation step (default ``micro_batches_per_step``).
        rank (int | None): Data-parallel rank override (default: the training module's parallel layout, see
            :meth:`use_data_parallel`).
        world_size (int | None): Data-parallel world size override.
        progress (bool): Show tokenization progress bars.
        test_sources (dict[str, list[SourceSpec]] | None): Named test sets (``xtl test``), as ``val_sources``.
        predict_source (str | None): JSONL of ``{"messages": [...]}`` prompts for ``xtl predict`` (a trailing
            assistant turn, e.g. a reference answer, is not part of the prompt).
        predict_batch_size (int): Prompts decoded together by ``predict``.
        predict_output (str | None): Where ``predict`` writes its JSONL (default
            ``<trainer.default_root_dir>/predictions.jsonl``).
        image_processor (dict | None): Image settings of a vision-language model
            (:class:`xtl.data.multimodal.ImageProcessorConfig` fields: ``patch_size``, ``merge_size``, ``min_pixels``,
            ``max_pixels``, ...; default: that class's defaults). Whether the data holds images is the model's to say
            (:attr:`model_reads_images`): for such a model ``kind: chat`` sources may hold image content parts
            (``docs/data.md``, "Images"); for a text model this setting is refused.
        persistent_workers (bool): With workers, keep them alive between epochs and validation runs instead of
            forking new ones each time. Resume is unaffected: the loader saves the packs handed to the step
            (``consumed_samples``), never what the workers prefetched.
        prefetch_factor (int | None): With workers, step batches each worker prepares ahead (``None``: PyTorch's
            default, 2).
        pin_memory (bool | None): Collate into page-locked host memory, so the host-to-device copy of a batch is
            asynchronous (``MicroBatch.to`` then copies with ``non_blocking``). ``None`` (default): on when
            training on CUDA.
        shard_cache_build (bool): Under a trainer of several nodes whose ``cache_dir`` every node sees, node ``k`` of
            ``n`` tokenizes shard ``k`` of every source in :meth:`prepare_data` and ``setup`` waits for the assembled
            entries (:func:`xtl.data.cache.build_cache_part`). Off (default): each node builds whole entries (a
            per-node ``cache_dir``; on shared storage one node builds while the others wait).
        stream_window (int): Streaming training sources (``streaming: true``, :mod:`xtl.data.streaming`): rows per
            packing window. Each rank packs its rows window by window; a window holding the whole corpus packs as
            the cached path does. Larger: fuller packs, more memory and a longer resume (one window is tokenized
            again).

    Warm starts are cheap: a source's content hash is remembered by stat signature and sampled blocks
    (:class:`xtl.data.sources.FileHashMemo`) and the pack plan is stored under ``cache_dir/plans`` keyed by every
    input that changes it (cache entries, sample ratios, seed, packing, ``pack_max_length``, ``overlong``, code).
    """

    def __init__(
        self,
        sources: list[SourceSpec],
        tokenizer: str,
        template: str = "qwen3",
        pack_max_length: int = 4096,
        packing: PackingMode = "best_fit",
        micro_batches_per_step: int = 1,
        seed: int = 0,
        num_workers: int | None = None,
        cache_dir: str | None = None,
        val_sources: dict[str, list[SourceSpec]] | None = None,
        sampler: SamplerOrder = "random",
        pack_preset: str | None = None,
        sampler_preset: str | None = None,
        overlong: OverlongPolicy = "truncate",
        pad_to_max_length: bool = True,
        template_kwargs: dict[str, Any] | None = None,
        pretrain_eos_token: str | None = None,
        tokenize_workers: int | None = None,
        val_micro_batches: int | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        progress: bool = True,
        test_sources: dict[str, list[SourceSpec]] | None = None,
        predict_source: str | None = None,
        predict_batch_size: int = 8,
        predict_output: str | None = None,
        image_processor: dict[str, Any] | None = None,
        persistent_workers: bool = True,
        prefetch_factor: int | None = None,
        pin_memory: bool | None = None,
        shard_cache_build: bool = False,
        stream_window: int = 4096,
    ) -> None:
        super().__init__()
        if not sources:
            raise DataError("XTLDataModule needs at least one training source")
        if num_workers is not None and num_workers < 0:
            raise DataError(f"num_workers must be >= 0 (or null for the default), got {num_workers}")
        if prefetch_factor is not None and prefetch_factor < 1:
            raise DataError(f"prefetch_factor must be >= 1 (or null for the default), got {prefetch_factor}")
        self.sources = [_as_spec(s) for s in sources]
        self.tokenizer_path = tokenizer
        self.template = template
        self.pack_max_length = pack_max_length
        self.packing = packing
        self.micro_batches_per_step = micro_batches_per_step
        self.seed = seed
        self.num_workers = num_workers
        self.persistent_workers = persistent_workers
        self.prefetch_factor = prefetch_factor
        self.pin_memory = pin_memory
        self.shard_cache_build = shard_cache_build
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir else DEFAULT_CACHE_DIR.expanduser()
        self._hash_memo = FileHashMemo(self.cache_dir / "fingerprints")
        self._caches: dict[str, TokenizedCache] = {}
        self.val_sources = {k: [_as_spec(s) for s in v] for k, v in (val_sources or {}).items()}
        self.test_sources = {k: [_as_spec(s) for s in v] for k, v in (test_sources or {}).items()}
        if predict_batch_size < 1:
            raise DataError(f"predict_batch_size must be >= 1, got {predict_batch_size}")
        self.predict_source = predict_source
        self.predict_batch_size = predict_batch_size
        self.predict_output = predict_output
        self.image_processor = image_processor
        self._image_indexes: dict[Path, Any] = {}
        self._consumer: DataConsumer | None = None
        self.sampler_order = sampler
        self.pack_preset = pack_preset
        self.sampler_preset = sampler_preset
        self.overlong = overlong
        self.pad_to_max_length = pad_to_max_length
        self.template_kwargs = dict(template_kwargs or {})
        self.pretrain_eos_token = pretrain_eos_token
        self.tokenize_workers = tokenize_workers
        self.val_micro_batches = val_micro_batches or micro_batches_per_step
        self._rank = rank
        self._world_size = world_size
        self._data_parallel: tuple[int, int] | None = None
        self.progress = progress
        self.tokenizer: Any = None
        self.train_split: PackedSplit | None = None
        self.val_splits: dict[str, PackedSplit] = {}
        self.test_splits: dict[str, PackedSplit] = {}
        self._consumed_samples = 0
        self._train_loader: ResumableDataLoader | None = None
        self.dropped_rows: dict[str, int] = {}  # preference source path -> rows skipped under bad_rows: drop
        self._open_sources: dict[Path, Any] = {}  # cache entry -> its source (row locations for errors)
        self._check_sets()
        self.stream_window = stream_window
        self.streaming = self._check_streaming()
        self._stream_state: dict[str, Any] = {}  # a streaming state loaded before the train loader exists
        self._streams: list[StreamSource] | None = None
        self.prompts = PromptSet(self.sources, seed, "data.sources") if _is_prompt_set(self.sources) else None

    # -- Lightning hooks -------------------------------------------------------------------------------------------

    def prepare_data(self) -> None:
        """Build the tokenization caches (runs on one process per node; others find them warm in ``setup``); with
        ``shard_cache_build`` on several nodes, this node's shard of each (:meth:`cache_shard`)."""
        shard = self.cache_shard()
        for spec in self.cached_specs():
            if shard is None:
                self._cache(spec)
            else:
                source, fn = self.cache_inputs(spec)
                build_cache_part(source, fn, self.cache_dir, *shard, self.tokenize_workers, progress=self.progress)

    def setup(self, stage: str | None = None) -> None:
        """Load caches (building any that are missing) and compute the pack plans.

        Args:
            stage (str | None): Lightning stage; ignored (everything is cheap once cached).
        """
        if self.train_split is not None or self.prompts is not None or self._streams is not None:
            return
        if self.streaming:  # nothing to tokenize or pack ahead: list the shards
            self._streams = [self._stream_source(spec) for spec in self.sources]
            if self.trainer is None or self.trainer.is_global_zero:
                line = streaming_summary(self._streams, self.packing, self.pack_max_length, self.stream_window)
                print(line, flush=True)
        else:
            self.train_split = self._split(self.sources, self.packing, self.pack_preset, "data.sources")
            report = self.train_split.plan.report()
            log.info("xtl data: %s sources %s, packing %s", self.packing, self.train_split.data.summary(), report)
            if self.trainer is None or self.trainer.is_global_zero:
                summary = packing_summary(
                    report, self.pack_max_length, len(self.sources), self.train_split.dropped_rows
                )
                print(summary, flush=True)
        eval_packing = "best_fit" if self.packing == "preset" else self.packing
        for name, specs in self.val_sources.items():
            self.val_splits[name] = self._split(specs, eval_packing, None, f"data.val_sources.{name}")
        for name, specs in self.test_sources.items():
            self.test_splits[name] = self._split(specs, eval_packing, None, f"data.test_sources.{name}")

    def train_dataloader(self) -> ResumableDataLoader | StreamingLoader:
        """This rank's training step batches, resuming at ``consumed_samples``.

        Returns:
            ResumableDataLoader | StreamingLoader: Yields ``list[MicroBatch]`` of length ``micro_batches_per_step``
            (prompt data: step numbers); a :class:`~xtl.data.streaming.StreamingLoader` for streaming sources.
        """
        if self.prompts is not None:
            _ = self.prompts.rows  # a bad source fails before the first step
            return torch.utils.data.DataLoader(StepTickets(), batch_size=None)
        self.setup()
        if self.streaming:
            return self._streaming_loader()
        assert self.train_split is not None
        rank, world = self.data_parallel_rank()
        plan = self.train_split.plan
        try:
            sampler = StepSampler(
                num_packs=len(plan),
                micro_batches_per_step=self.micro_batches_per_step,
                rank=rank,
                world_size=world,
                seed=self.seed,
                order=self.sampler_order,
                pack_tokens=plan.pack_tokens() if self.sampler_order == "length_grouped" else None,
                preset=self.sampler_preset,
                consumed_samples=self.consumed_samples,
            )
        except DataError as err:
            sources = ", ".join(_resolve(spec.path) for spec in self.sources)
            raise DataError(f"training sources {sources}: {err}") from None
        self._train_loader = ResumableDataLoader(
            self.train_split.packs, sampler, self.collator(), **self.loader_kwargs()
        )
        return self._train_loader

    def val_dataloader(self) -> list[torch.utils.data.DataLoader]:
        """One loader per named validation set, in ``val_set_names`` order (Lightning's ``dataloader_idx``).

        Each batch is this rank's share of one step: a list of up to ``val_micro_batches`` micro-batches (possibly
        empty on some ranks at the tail, so every rank runs the same number of steps).

        Returns:
            list[DataLoader]: The loaders (empty when there are no validation sources).
        """
        if any(_is_prompt_set(specs) for specs in self.val_sources.values()):
            return [PromptSet(specs, key=f"data.val_sources.{name}").loader(self.predict_batch_size)
                    for name, specs in self.val_sources.items()]  # fmt: skip
        self.setup()
        return self._eval_loaders(self.val_splits)

    def test_dataloader(self) -> list[torch.utils.data.DataLoader]:
        """One loader per named test set, in ``test_set_names`` order, batched as :meth:`val_dataloader`.

        Returns:
            list[DataLoader]: The loaders.

        Raises:
            DataError: Without ``test_sources``.
        """
        if not self.test_sources:
            raise DataError("test needs data.test_sources: named sets in the format of val_sources")
        self.setup()
        return self._eval_loaders(self.test_splits)

    def predict_dataloader(self) -> torch.utils.data.DataLoader:
        """The prompts of ``predict_source`` in file order, ``predict_batch_size`` at a time, the same on every rank
        (generation under a sharded strategy needs every rank in every forward).

        Each batch is a list of ``{"messages": [...], "prompt": [...]}`` rows, ``prompt`` being ``messages``
        without a trailing assistant turn.

        Returns:
            DataLoader: The prompt batches.

        Raises:
            DataError: Without ``predict_source``, or for a line that is not ``{"messages": [...]}``.
        """
        if not self.predict_source:
            raise DataError('predict needs data.predict_source: a JSONL file of {"messages": [...]} prompts')
        rows = _prompt_rows(Path(_resolve(self.predict_source)))
        return torch.utils.data.DataLoader(
            rows, batch_size=self.predict_batch_size, sampler=EvalStepSampler(len(rows)), collate_fn=list
        )

    def teardown(self, stage: str | None = None) -> None:
        """Stop the tokenize processes of a streaming train loader (a later iteration starts them again).

        Args:
            stage (str | None): Lightning stage; ignored.
        """
        if isinstance(self._train_loader, StreamingLoader):
            self._train_loader.close()

    def state_dict(self) -> dict[str, Any]:
        """Data resume state (``consumed_samples``), saved by Lightning in the checkpoint.

        Returns:
            dict: The state.
        """
        if isinstance(self._train_loader, StreamingLoader):  # every rank's position: in the loader's state
            return self._train_loader.state_dict(gather=False)
        if self.streaming and self._stream_state:
            return dict(self._stream_state)
        state: dict[str, Any] = {"consumed_samples": self.consumed_samples, "seed": self.seed}
        if self.prompts is not None:
            state["consumed_prompts"] = self.prompts.consumed
            if self.prompts.task_consumed:
                state["task_consumed_prompts"] = dict(self.prompts.task_consumed)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume: the next train loader starts after ``consumed_samples`` packs.

        Args:
            state_dict (dict): From ``state_dict()``.
        """
        self._consumed_samples = int(state_dict["consumed_samples"])
        if self.streaming:
            self._stream_state = dict(state_dict)
            if isinstance(self._train_loader, StreamingLoader):
                self._train_loader.load_state_dict(state_dict)
            return
        if self.prompts is not None:
            self.prompts.consumed = int(state_dict.get("consumed_prompts", 0))
            self.prompts.task_consumed = dict(state_dict.get("task_consumed_prompts", {}))
        if self._train_loader is not None:
            self._train_loader.step_sampler.consumed_samples = self._consumed_samples

    # -- public helpers --------------------------------------------------------------------------------------------

    def take(self, count: int) -> list[dict[str, Any]]:
        """RL: this rank's next ``count`` prompt rows (:meth:`xtl.data.prompts.PromptSet.take`; every rank calls it
        together).

        Raises:
            DataError: The training sources are not ``kind: prompt``.
        """
        if self.prompts is None:
            raise DataError("RL draws prompts from kind: prompt sources: set data.sources[*].kind: prompt")
        return self.prompts.take(count, *self.data_parallel_rank())

    def take_task(self, task: str, count: int) -> list[dict[str, Any]]:
        """RL with several tasks: this rank's next ``count`` prompt rows of ``task`` (a ``data_source``;
        :meth:`xtl.data.prompts.PromptSet.take_task`).

        Raises:
            DataError: The training sources are not ``kind: prompt``, or no row has that ``data_source``.
        """
        if self.prompts is None:
            raise DataError("RL draws prompts from kind: prompt sources: set data.sources[*].kind: prompt")
        return self.prompts.take_task(task, count, *self.data_parallel_rank())

    @property
    def consumed_samples(self) -> int:
        """Packs consumed by all ranks (from the live train loader when there is one)."""
        if self._train_loader is not None:
            return self._train_loader.consumed_samples
        return self._consumed_samples

    @property
    def val_set_names(self) -> list[str]:
        """Names of the validation sets, in ``dataloader_idx`` order."""
        return list(self.val_sources)

    @property
    def test_set_names(self) -> list[str]:
        """Names of the test sets, in ``dataloader_idx`` order."""
        return list(self.test_sources)

    def loader_kwargs(self) -> dict[str, Any]:
        """The worker and memory settings every loader of this module gets (defaults resolved).

        Returns:
            dict: ``num_workers``, ``persistent_workers``, ``pin_memory`` and, with workers, ``prefetch_factor``.
        """
        on_cuda = self._on_cuda()
        workers = self.num_workers if self.num_workers is not None else (2 if on_cuda else 0)
        kwargs: dict[str, Any] = {
            "num_workers": workers,
            "persistent_workers": self.persistent_workers and workers > 0,
            "pin_memory": on_cuda if self.pin_memory is None else self.pin_memory,
        }
        if workers > 0 and self.prefetch_factor is not None:
            kwargs["prefetch_factor"] = self.prefetch_factor
        return kwargs

    def use_data_parallel(self, rank: int, size: int) -> None:
        """Read the share of data-parallel rank ``rank`` of ``size`` ranks that read different data.

        xtl's training module passes its parallel layout's ``data_rank`` and ``dp_size`` at setup (every rank of a
        context-parallel group reads the same data), before any loader is made.

        Args:
            rank (int): This process's data-parallel rank.
            size (int): Data-parallel ranks.
        """
        self._data_parallel = (rank, size)

    def feed(self, consumer: DataConsumer) -> None:
        """Name the module whose model this data module feeds when it runs without a trainer (under a trainer it
        asks the trainer's module)."""
        self._consumer = consumer

    @property
    def model_reads_images(self) -> bool:
        """Whether the model fed reads images (:attr:`DataConsumer.reads_images` of the trainer's module, or of the
        module given to :meth:`feed`; a text model without either): its ``kind: chat`` sources then tokenize with
        image placeholders (``vlm_chat``) and its packs carry the processed images.

        Raises:
            DataError: ``image_processor`` is set for a model that reads no images.
        """
        module = self.trainer.lightning_module if self.trainer is not None else self._consumer
        images = isinstance(module, DataConsumer) and module.reads_images
        if self.image_processor is not None and not images:
            raise DataError("data.image_processor: the model reads no images (a text model); remove image_processor")
        return images

    def data_parallel_rank(self) -> tuple[int, int]:
        """``(rank, world_size)`` of data parallelism: the constructor's overrides, else what the training module
        passed (:meth:`use_data_parallel`), else each of the trainer's processes reads its own share (a module that
        passes no layout), else one process reads everything.

        Returns:
            tuple[int, int]: Rank and world size.
        """
        if self._rank is not None or self._world_size is not None:
            return self._rank or 0, self._world_size or 1
        if self._data_parallel is not None:
            return self._data_parallel
        trainer = self.trainer
        if trainer is not None:
            return trainer.global_rank, trainer.world_size
        return 0, 1

    def cache_inputs(self, spec: SourceSpec) -> tuple[Source, TokenizeFn]:
        """The raw source and the tokenize function of ``spec``'s cache entry, as training builds and finds it.

        Args:
            spec (SourceSpec): One of :meth:`cached_specs`.

        Returns:
            tuple[Source, TokenizeFn]: What :func:`xtl.data.cache.build_cache` takes (its key names the entry).
        """
        self.load_tokenizer()  # a bad tokenizer fails before the source is read
        resolved = _resolved_spec(spec)
        source = open_source(resolved, hf_cache_dir=self.cache_dir / "hf", hash_memo=self._hash_memo)
        return source, self.tokenize_fn(spec)

    def tokenize_fn(self, spec: SourceSpec) -> TokenizeFn:
        """The tokenize function of ``spec`` (the same for its cache entry and for its rows streamed).

        Args:
            spec (SourceSpec): A source of this module.

        Returns:
            TokenizeFn: The function (holding the tokenizer).
        """
        tokenizer = self.load_tokenizer()
        kind = "vlm_chat" if spec.kind == "chat" and self.model_reads_images else spec.kind
        return build_tokenize_fn(
            kind,
            tokenizer,
            template=self.template,
            text_key=spec.text_key,
            messages_key=spec.messages_key,
            chunk_size=spec.chunk_size,
            chunk_overlap=spec.chunk_overlap,
            template_kwargs=self.template_kwargs,
            eos_token=self.pretrain_eos_token,
            image_processor=self.image_processor,
            bad_rows=spec.bad_rows,
            margin_key=spec.margin_key,
            images=self.model_reads_images,
        )

    def cached_specs(self) -> list[SourceSpec]:
        """The sources whose tokenization is cached: every training, validation and test source but prompt data.

        Returns:
            list[SourceSpec]: In ``prepare_data``'s order (training, then validation, then test sets).
        """
        eval_sets = [*self.val_sources.values(), *self.test_sources.values()]
        specs = self.sources + [s for specs in eval_sets for s in specs]
        return [spec for spec in specs if spec.kind != PROMPT_KIND and not spec.streaming]

    def cache_shard(self) -> tuple[int, int] | None:
        """``(node_rank, num_nodes)`` of the trainer when ``shard_cache_build`` is on and it runs on several nodes
        (Lightning reads them from ``NODE_RANK`` / ``GROUP_RANK`` / ``SLURM_NODEID`` and ``trainer.num_nodes``); else
        ``None``: each node builds whole entries.

        Returns:
            tuple[int, int] | None: This node's shard and the shard count.
        """
        trainer = self.trainer
        if not self.shard_cache_build or trainer is None or trainer.num_nodes <= 1:
            return None
        return trainer.node_rank, trainer.num_nodes

    def load_tokenizer(self) -> Any:
        """Load (once) the tokenizer named by ``tokenizer``.

        Returns:
            PreTrainedTokenizerBase: The tokenizer.
        """
        if self.tokenizer is None:
            from transformers import AutoTokenizer

            path = resolve_pretrained(self.tokenizer_path, "data.tokenizer")
            if not Path(path).exists():
                raise DataError(f"tokenizer {path} does not exist; set `tokenizer` to a folder with tokenizer.json")
            self.tokenizer = AutoTokenizer.from_pretrained(path)
        return self.tokenizer

    # -- private ---------------------------------------------------------------------------------------------------

    def _check_sets(self) -> None:
        """Fail before tokenizing on a set that mixes preference with other kinds, or settings pairs cannot take."""
        sets = [("data.sources", self.sources)]
        sets += [(f"data.val_sources.{name}", specs) for name, specs in self.val_sources.items()]
        sets += [(f"data.test_sources.{name}", specs) for name, specs in self.test_sources.items()]
        for key, specs in sets:
            for spec in specs:
                if spec.bad_rows not in BAD_ROW_POLICIES:
                    raise DataError(
                        f"{key}: source {spec.path}: bad_rows must be 'error' or 'drop', got {spec.bad_rows!r}"
                    )
                if spec.bad_rows == "drop" and spec.kind not in PAIR_KINDS:
                    raise DataError(
                        f"{key}: source {spec.path}: bad_rows: drop applies to kind: preference and "
                        "unpaired_preference only: remove it"
                    )
            kinds = sorted({spec.kind for spec in specs})
            if PROMPT_KIND in kinds and len(kinds) > 1:
                raise DataError(
                    f"{key} mixes kind: prompt with kind: {', '.join(k for k in kinds if k != PROMPT_KIND)}; a set is "
                    "all prompt data (RL) or none of it"
                )
            misplaced = [s.path for s in specs if s.kind != PROMPT_KIND and (s.match or s.data_source)]
            if misplaced:
                raise DataError(f"{key}: source {misplaced[0]}: match and data_source apply to kind: prompt only")
            margins = [s.path for s in specs if s.margin_key is not None and s.kind != PREFERENCE_KIND]
            if margins:
                raise DataError(f"{key}: source {margins[0]}: margin_key applies to kind: preference only")
            paired = [k for k in kinds if k in PAIR_KINDS]
            if paired and len(kinds) > 1:
                raise DataError(
                    f"{key} mixes kind: {paired[0]} with kind: {', '.join(k for k in kinds if k != paired[0])}; "
                    f"a set is all {paired[0]} data or none of it: move those sources to a set of their own"
                )
            if paired and self.packing == "hard":
                raise DataError(
                    f"{key} holds kind: {paired[0]} sources, but packing: hard cuts documents and would split pairs; "
                    "use packing: best_fit"
                )

    def _check_streaming(self) -> bool:
        """Whether the training sources stream; refuse what streaming does not do, naming the key."""
        for key, sets in (("data.val_sources", self.val_sources), ("data.test_sources", self.test_sources)):
            for name, specs in sets.items():
                streamed = [s.path for s in specs if s.streaming]
                if streamed:
                    raise DataError(
                        f"{key}.{name}: source {streamed[0]}: streaming applies to training sources; validation and "
                        "test sets are cached: remove streaming there"
                    )
        streamed = [s for s in self.sources if s.streaming]
        if not streamed:
            return False
        if len(streamed) != len(self.sources):
            raise DataError(
                "data.sources mixes streaming and cached sources; a training set streams all its sources or none"
            )
        for spec in streamed:
            if spec.kind not in ("chat", "text"):
                reason = _NO_STREAM.get(spec.kind, "")
                raise DataError(
                    f"data.sources: source {spec.path}: kind: {spec.kind} cannot stream{reason}; streaming sources "
                    "are kind: chat or text (or set streaming: false)"
                )
        if self.packing not in STREAM_PACKING:
            raise DataError(
                f"data.packing: {self.packing} cannot stream (a pack table indexes the whole tokenized set); a "
                "streaming run packs best_fit or hard"
            )
        if self.sampler_order != "random":
            raise DataError(
                f"data.sampler: {self.sampler_order} orders the packs of the whole set; a streaming run takes each "
                "window's packs in a seeded order: use sampler: random"
            )
        if self.stream_window < 1:
            raise DataError(f"data.stream_window must be >= 1 row, got {self.stream_window}")
        return True

    def _stream_source(self, spec: SourceSpec) -> StreamSource:
        return StreamSource(
            spec.path, spec.format, spec.split, spec.name, float(spec.sample_ratio), f"data.sources ({spec.path})"
        )

    def _streaming_loader(self) -> StreamingLoader:
        """This rank's streaming train loader at ``consumed_samples`` (and the loaded rank positions)."""
        if self.model_reads_images:
            raise DataError(
                "data.sources: streaming rows with images is not supported (images are read through the cache's "
                "image index); set streaming: false for image data"
            )
        trainer = self.trainer
        if trainer is not None and (trainer.max_steps is None or trainer.max_steps < 0):
            raise DataError("trainer.max_steps: a streaming run has no epochs to end it; set trainer.max_steps")
        if trainer is not None and self.val_sources and isinstance(trainer.val_check_interval, float):
            raise DataError(
                f"trainer.val_check_interval: {trainer.val_check_interval} is a share of an epoch, and a streaming "
                "run has none: validate every N steps with an int (and check_val_every_n_epoch: null)"
            )
        assert self._streams is not None
        rank, world = self.data_parallel_rank()
        fns = [self.tokenize_fn(spec) for spec in self.sources]
        workers = self.tokenize_workers if self.tokenize_workers is not None else default_stream_workers()
        packs = StreamingPacks(
            self._streams, fns, self.pack_max_length, self.packing, self.overlong, self.seed, rank, world,
            self.stream_window, workers,
        )  # fmt: skip
        settings = stream_settings(packs, tokenizer_fingerprint(self.load_tokenizer()))
        pin = bool(self.loader_kwargs()["pin_memory"])
        loader = StreamingLoader(packs, self.collator(), self.micro_batches_per_step, settings, pin_memory=pin)
        previous = self._train_loader
        if isinstance(previous, StreamingLoader):  # a loader requested again: go on where the last one stands
            loader.seek(previous.consumed_samples, previous.position)
            previous.close()
        else:
            loader.seek(self._consumed_samples)
            if self._stream_state:
                loader.load_state_dict(self._stream_state)
        self._train_loader = loader  # type: ignore[assignment]
        return loader

    def _on_cuda(self) -> bool:
        trainer = self.trainer
        if trainer is None:
            return False
        try:
            return trainer.strategy.root_device.type == "cuda"
        except (AttributeError, RuntimeError):
            return False

    def _cache(self, spec: SourceSpec) -> TokenizedCache:
        resolved = _resolved_spec(spec)
        memo_key = repr(replace(resolved, sample_ratio=1.0, name=None))  # what prepare_data and setup share
        if memo_key in self._caches:
            return self._caches[memo_key]
        cache = self._build_cache(spec, resolved)
        self._caches[memo_key] = cache
        return cache

    def _build_cache(self, spec: SourceSpec, resolved: SourceSpec) -> TokenizedCache:
        source, fn = self.cache_inputs(spec)
        kind = "vlm_chat" if spec.kind == "chat" and self.model_reads_images else spec.kind
        shard = self.cache_shard()
        if shard is None:
            cache = build_cache(source, fn, self.cache_dir, num_proc=self.tokenize_workers, progress=self.progress)
        else:
            hint = (
                f"node i builds part i/{shard[1]} in prepare_data (data.shard_cache_build): did one fail? Is "
                f"data.cache_dir ({self.cache_dir}) on storage every node sees? (with a cache_dir per node, set "
                "data.shard_cache_build: false)"
            )
            cache = wait_for_cache(source, fn, self.cache_dir, shard[1], hint=hint)
        self._open_sources[cache.directory] = source
        if kind in PAIR_KINDS:
            dropped = dropped_rows(cache)  # also checks that the entry holds whole pairs
            self.dropped_rows[resolved.path] = dropped
            if dropped:
                log.info("xtl data: %s: %d bad preference rows dropped (bad_rows: drop)", resolved.path, dropped)
        if kind == "vlm_chat" or (kind in PAIR_KINDS and self.model_reads_images):  # prompts with images
            from xtl.data.multimodal import load_image_index

            self._image_indexes[cache.directory] = load_image_index(cache, source, fn)
        return cache

    def _split(self, specs: list[SourceSpec], packing: str, preset: str | None, key: str) -> PackedSplit:
        caches = [self._cache(s) for s in specs]
        for spec, cache in zip(specs, caches):
            if len(cache) == 0:
                raise DataError(
                    f"{_resolve(spec.path)}: no usable rows (the source is empty, or every row was filtered out); "
                    "add data or remove it from the sources"
                )
        pairs = bool(specs) and all(s.kind in PAIR_KINDS for s in specs)
        data = MixedDataset(
            caches, [s.sample_ratio for s in specs], self.seed, [s.display_name for s in specs], pairs=pairs
        )
        if packing == "preset":
            if preset is None:
                raise DataError("packing 'preset' needs `pack_preset`: a .npy table of (pack, sample, start, end)")
            plan = preset_pack(_resolve(preset), data.num_tokens, self.pack_max_length)
            if pairs:
                check_pair_plan(plan, data.num_tokens, f"{key}: pack preset {_resolve(preset)}")
                plan.pairs = True
            table = xxhash.xxh3_128()
            for array in (plan.pack_offsets, plan.seg_sample, plan.seg_start, plan.seg_end):
                table.update(np.ascontiguousarray(array, dtype=np.int64).tobytes())
            parts = {**self._plan_parts(caches, specs, data), "packing": "preset", "preset": table.hexdigest()}
            plan_key = plan_fingerprint(parts)
        elif packing in ("hard", "best_fit"):
            plan, plan_key = self._stored_plan(caches, specs, data, packing)
        else:
            raise DataError(f"unknown packing {packing!r}; use best_fit, hard or preset")
        packs = PackedDataset(data, plan)
        if self.model_reads_images:
            packs = self._vision_packs(packs, caches)
        dropped = sum(self.dropped_rows.get(_resolve(s.path), 0) for s in specs) if pairs else 0
        return PackedSplit(data, plan, packs, pairs=pairs, dropped_rows=dropped, key=plan_key)

    def _plan_parts(self, caches: list[TokenizedCache], specs: list[SourceSpec], data: MixedDataset) -> dict:
        """What every plan of a set depends on besides its packing: the cache entries and their mixing."""
        return {
            "caches": [c.directory.name for c in caches],  # source content, tokenizer, tokenize fn and its arguments
            "sample_ratios": [float(s.sample_ratio) for s in specs],
            "seed": self.seed,
            "pack_max_length": self.pack_max_length,
            "pairs": data.pairs,
            "num_samples": len(data),
            "num_tokens": int(data.num_tokens.sum()),
        }

    def _stored_plan(
        self, caches: list[TokenizedCache], specs: list[SourceSpec], data: MixedDataset, packing: str
    ) -> tuple[PackPlan, str]:
        """The ``hard`` / ``best_fit`` plan and its fingerprint; the plan is read from ``cache_dir/plans`` when its
        inputs are unchanged."""
        parts = self._plan_parts(caches, specs, data)
        parts.update(packing=packing, overlong=self.overlong if packing == "best_fit" else None)
        key = plan_fingerprint(parts)
        path = self.cache_dir / "plans" / f"{packing}-{self.pack_max_length}-{key[:20]}.npz"
        plan = load_plan(path, key)
        if plan is not None:
            log.info("xtl data: pack plan loaded from %s", path)
            return plan, key
        if packing == "hard":
            plan = hard_pack(data.num_tokens, self.pack_max_length, self.seed)
        elif data.pairs:
            locate = self._pair_locator(data, caches)
            plan = best_fit_pack(data.num_tokens, self.pack_max_length, self.seed, self.overlong, True, locate)
        else:
            plan = best_fit_pack(data.num_tokens, self.pack_max_length, self.seed, self.overlong)
        try:
            save_plan(plan, path, key)
        except OSError as err:  # a read-only cache folder: pack again next time
            log.warning("xtl data: cannot store the pack plan in %s (%s)", path, err)
        return plan, key

    def _pair_locator(self, data: MixedDataset, caches: list[TokenizedCache]) -> Callable[[int], str]:
        """``file:line`` of the row of mixed pair ``k`` (for the errors of pair packing)."""

        def locate(pair: int) -> str:
            k, sample = int(data.source_ids[2 * pair]), int(data.sample_ids[2 * pair])
            row = int(caches[k].rows[sample])
            source = self._open_sources.get(caches[k].directory)
            return source.location(row) if source is not None else f"{caches[k].meta['source_path']}[row {row}]"

        return locate

    def _vision_packs(self, packs: PackedDataset, caches: list[Any]) -> Any:
        from xtl.data.multimodal import IMAGE_TOKEN, ImageProcessorConfig, SampleImages, VisionPackedDataset

        indexes = [self._image_indexes.get(c.directory) or [SampleImages(str(c.directory))] * len(c) for c in caches]
        image_token_id = int(self.load_tokenizer().convert_tokens_to_ids(IMAGE_TOKEN))
        settings = ImageProcessorConfig.from_any(self.image_processor) or ImageProcessorConfig()
        return VisionPackedDataset(packs, indexes, settings, image_token_id)

    def _eval_loaders(self, splits: dict[str, PackedSplit]) -> list[torch.utils.data.DataLoader]:
        rank, world = self.data_parallel_rank()
        collate = self.collator()
        loaders = []
        for split in splits.values():
            steps = RankSteps(split.packs, self.val_micro_batches, rank, world)
            loaders.append(
                torch.utils.data.DataLoader(
                    steps,
                    batch_size=None,
                    sampler=EvalStepSampler(len(steps)),
                    collate_fn=collate,
                    **self.loader_kwargs(),
                )
            )
        return loaders

    def collator(self) -> StepCollator:
        """The collate function of every loader of this module: packs -> ``list[MicroBatch]``, padded as set.

        Returns:
            StepCollator: The collator (padding id from the tokenizer).
        """
        tokenizer = self.load_tokenizer()
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        return StepCollator(int(pad_id or 0), self.pack_max_length if self.pad_to_max_length else None)


def packing_summary(
    report: dict[str, float | int], pack_max_length: int, num_sources: int, dropped_rows: int = 0
) -> str:
    """One line for the start of a run: packs, documents, fill ratio, overlong documents dropped or truncated (for
    preference data: pairs, overlong pairs dropped, and ``dropped_rows`` bad rows skipped)."""
    documents = f"{report['documents']} documents"
    if "pairs" in report:
        documents = f"{report['pairs']} preference pairs ({report['documents']} documents)"
    line = (
        f"xtl data: {documents} from {num_sources} source(s) -> {report['packs']} packs of "
        f"<= {pack_max_length} tokens, fill {report['fill_ratio']:.3f}"
    )
    if dropped_rows:
        line += f", {dropped_rows} bad preference rows dropped"
    if report.get("dropped_overlong_pairs"):
        line += f", {report['dropped_overlong_pairs']} pairs longer than pack_max_length dropped"
    elif report["dropped_overlong"]:
        line += f", {report['dropped_overlong']} documents longer than pack_max_length dropped"
    if report["truncated_overlong"]:
        line += (
            f", {report['truncated_overlong']} documents truncated to pack_max_length "
            f"({report['truncated_tokens']} tokens cut)"
        )
    return line


_NO_STREAM = {
    PREFERENCE_KIND: " (pairs are packed whole over the set; not built for streaming)",
    UNPAIRED_KIND: " (its mismatched pairs are drawn over the set; not built for streaming)",
    PROMPT_KIND: " (prompt rows are drawn by the RL module, never tokenized here)",
}


def _is_prompt_set(specs: list[SourceSpec]) -> bool:
    return bool(specs) and all(spec.kind == PROMPT_KIND for spec in specs)


def _resolve(path: str) -> str:
    return resolve_path(path)


def _prompt_rows(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise DataError(f"predict_source {path} does not exist")
    rows = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                messages = json.loads(line)["messages"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise DataError(f"{path}:{lineno}: expected a JSON object with 'messages' ({err})") from err
            if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                raise DataError(f"{path}:{lineno}: 'messages' must be a list of {{'role': ..., 'content': ...}}")
            prompt = messages[:-1] if messages and messages[-1].get("role") == "assistant" else messages
            rows.append({"messages": messages, "prompt": prompt})
    return rows


def _resolved_spec(spec: SourceSpec) -> SourceSpec:
    return replace(spec, path=_resolve(spec.path))


def _as_spec(spec: SourceSpec | dict[str, Any]) -> SourceSpec:
    if isinstance(spec, SourceSpec):
        return spec
    if isinstance(spec, dict):
        try:
            return SourceSpec(**spec)
        except TypeError as exc:
            raise DataError(f"bad source spec {spec}: {exc}") from None
    raise DataError(f"a source must be a SourceSpec or a mapping, got {type(spec).__name__}")
