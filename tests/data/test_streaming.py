"""Streaming training data (``xtl/data/streaming.py``, ``streaming_source.py``): the tokens and packs of the cached
path, a stream that depends on nothing but its settings and rank, each rank reading its own share, exact resume."""

from __future__ import annotations

import csv
import gzip
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.cli.test_cli import ROOT, _tiny_args
from tests.inprocess import run_fit
from xtl.data import DataError, DataFileNotFoundError, tiny_assets_dir
from xtl.data.datamodule import XTLDataModule
from xtl.data.streaming import StreamingLoader
from xtl.data.streaming_source import StreamCursor

TINY = tiny_assets_dir()
ROWS = (TINY / "sft_train.jsonl").read_text().splitlines()[:240]
SHARDS = 4  # 60 rows each; the last one gzipped


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``all.jsonl`` (240 chats of the tiny SFT set) and the same rows as 4 shards ``part*.jsonl[.gz]``."""
    root = tmp_path_factory.mktemp("stream_corpus")
    (root / "all.jsonl").write_text("\n".join(ROWS) + "\n")
    (root / "shards").mkdir()
    size = len(ROWS) // SHARDS
    for i in range(SHARDS):
        text = "\n".join(ROWS[i * size : (i + 1) * size]) + "\n"
        if i == SHARDS - 1:
            (root / "shards" / f"part{i}.jsonl.gz").write_bytes(gzip.compress(text.encode()))
        else:
            (root / "shards" / f"part{i}.jsonl").write_text(text)
    return root


def _module(path: str, tmp: Path, rank: int = 0, world: int = 1, **kw) -> XTLDataModule:
    source = {"path": path, "streaming": True, **kw.pop("source", {})}
    args = dict(pack_max_length=128, micro_batches_per_step=2, tokenize_workers=0, stream_window=32)
    args.update(kw)
    return XTLDataModule(
        sources=[source], tokenizer="tiny:", cache_dir=str(tmp / "cache"), progress=False, rank=rank,
        world_size=world, **args,
    )  # fmt: skip


def _loader(module: XTLDataModule) -> StreamingLoader:
    loader = module.train_dataloader()
    assert isinstance(loader, StreamingLoader)
    return loader


def _steps(loader, count: int) -> list[list[tuple]]:
    """``count`` steps of a loader, each micro-batch as (pack index, ids, labels, document boundaries)."""
    out = []
    for step in loader:
        out.append(
            [
                (
                    mb.pack_index,
                    mb.seq_ctx.input_ids.numpy().tobytes(),
                    mb.labels.numpy().tobytes(),
                    tuple(mb.seq_ctx.cu_seq_lens.tolist()),
                )
                for mb in step
            ]  # fmt: skip
        )
        if len(out) == count:
            break
    return out


def _shards(corpus: Path) -> str:
    return str(corpus / "shards" / "part*")


class TestStreamedTokens:
    @pytest.mark.parametrize("kind", ["chat", "text"])
    def test_a_streamed_row_gives_the_tokens_the_cache_holds_for_it(self, kind, corpus, tmp_path):
        path = str(corpus / "all.jsonl")
        extra: dict = {}
        if kind == "text":  # chunked documents: several samples per row
            path = str(tmp_path / "text.jsonl")
            Path(path).write_text(
                "".join(line + "\n" for line in (TINY / "pretrain.jsonl").read_text().split("\n")[:150])
            )
            extra = {"kind": "text", "chunk_size": 16, "chunk_overlap": 3}
        cached = XTLDataModule(
            sources=[{"path": path, **extra}], tokenizer="tiny:", cache_dir=str(tmp_path / "cache"), progress=False
        )
        cached.setup()
        (cache,) = cached.train_split.data.caches
        stream = _module(path, tmp_path, source=extra, stream_window=10**6)
        packs = _loader(stream).packs
        window = next(packs.windows(StreamCursor.start(1)))
        samples = packs.tokenize(window)
        assert len(samples) == len(cache) > len(window.rows) - 1
        if kind == "text":
            assert len(samples) > len(window.rows), "chunking makes several samples of a row"
        for i, (ids, mask) in enumerate(samples):
            a, b = int(cache.offsets[i]), int(cache.offsets[i + 1])
            assert np.array_equal(ids, cache.input_ids[a:b]) and np.array_equal(mask, cache.loss_mask[a:b]), i


class TestPacksOfTheCachedPath:
    @pytest.mark.parametrize("packing", ["best_fit", "hard"])
    def test_a_window_holding_the_corpus_gives_the_cached_packs_in_their_order(self, packing, corpus, tmp_path):
        path = str(corpus / "all.jsonl")
        cached = XTLDataModule(
            sources=[{"path": path}], tokenizer="tiny:", cache_dir=str(tmp_path / "cache"), progress=False,
            pack_max_length=128, micro_batches_per_step=2, packing=packing,
        )  # fmt: skip
        cached.setup()
        expected = _steps(cached.train_dataloader(), 10**6)  # one epoch
        got = _steps(_loader(_module(path, tmp_path, packing=packing, stream_window=10**6)), len(expected))
        assert len(expected) == len(cached.train_split.plan) // 2 > 10
        assert got == expected

    def test_window_g_packs_as_the_cached_path_packs_its_rows_with_seed_plus_g(self, corpus, tmp_path):
        """The stream of windows of 40 rows, one pack per step: window 1 (rows 40..79) is the cached plan of those
        rows with seed 7 + 1, in that plan's epoch-0 order."""
        stream = _loader(
            _module(str(corpus / "all.jsonl"), tmp_path, stream_window=40, seed=7, micro_batches_per_step=1)
        )
        (tmp_path / "w1.jsonl").write_text("\n".join(ROWS[40:80]) + "\n")
        cached = XTLDataModule(
            sources=[{"path": str(tmp_path / "w1.jsonl")}], tokenizer="tiny:", cache_dir=str(tmp_path / "cache"),
            progress=False, pack_max_length=128, micro_batches_per_step=1, seed=8,
        )  # fmt: skip
        cached.setup()
        window1 = _steps(cached.train_dataloader(), 10**6)
        first = next(stream.packs.windows(StreamCursor.start(1)))
        skip = len(stream.packs.pack_window(first, stream.packs.tokenize(first))[1])
        got = _steps(stream, skip + len(window1))[skip:]
        assert got == window1


class TestDeterminism:
    def test_the_stream_of_each_rank_is_the_same_with_0_1_or_2_tokenize_workers(self, corpus, tmp_path):
        runs = {}
        for workers in (0, 1, 2):
            for rank in (0, 1):
                loader = _loader(_module(_shards(corpus), tmp_path, rank, 2, tokenize_workers=workers))
                loader.packs.rows_per_task = 3  # many small tasks: their completion order varies
                try:
                    runs[workers, rank] = _steps(loader, 18)  # past the end of a pass (15 steps)
                finally:
                    loader.close()
        for rank in (0, 1):
            assert runs[0, rank] == runs[1, rank] == runs[2, rank]
        assert runs[0, 0] != runs[0, 1]


class TestRankShares:
    @staticmethod
    def _passes(path: str, tmp: Path, rank: int, world: int, passes: int) -> list[set[str]]:
        """The row locations of this rank's first passes (a window holding a whole pass ends with it)."""
        packs = _loader(_module(path, tmp, rank, world, stream_window=10**6)).packs
        windows = packs.windows(StreamCursor.start(1))
        return [{location for _, _, location in next(windows).rows} for _ in range(passes)]

    @pytest.mark.parametrize("shards", [True, False], ids=["shard_per_rank", "rows_strided"])
    def test_in_every_pass_the_ranks_read_disjoint_shares_that_cover_the_corpus(self, shards, corpus, tmp_path):
        path = _shards(corpus) if shards else str(corpus / "all.jsonl")
        world = 2 if shards else 3  # 4 shards over 2 ranks; 1 file over 3 ranks (rows i % 3 == r)
        ranks = [self._passes(path, tmp_path, rank, world, 3) for rank in range(world)]
        for epoch in range(3):
            shares = [ranks[rank][epoch] for rank in range(world)]
            assert sum(len(s) for s in shares) == len(ROWS) == len(set().union(*shares))
        if shards:  # whole shards per rank, reshuffled from pass to pass
            assert all(len({loc.split(":")[0] for loc in share}) == 2 for share in ranks[0])
            assert len({frozenset(share) for share in ranks[0]}) > 1
        else:
            lines = [sorted(int(loc.rsplit(":", 1)[1]) for loc in ranks[r][0]) for r in range(world)]
            assert [line[:2] for line in lines] == [[1, 4], [2, 5], [3, 6]]

    def test_a_source_whose_share_is_empty_for_a_rank_names_it(self, tmp_path):
        (tmp_path / "one.jsonl").write_text(ROWS[0] + "\n")
        loader = _loader(_module(str(tmp_path / "one.jsonl"), tmp_path, rank=1, world=2))
        with pytest.raises(DataError, match="rank 1 of 2 gets no rows of one"):
            next(iter(loader))


class TestResume:
    @staticmethod
    def _ranks(path: str, tmp: Path, **kw) -> list[StreamingLoader]:
        return [_loader(_module(path, tmp, rank, 2, **kw)) for rank in (0, 1)]

    @pytest.mark.parametrize("stop", [1, 4, 9])
    def test_state_after_step_k_resumes_with_the_packs_of_the_uninterrupted_run(self, stop, corpus, tmp_path):
        total = 18  # windows of 32 rows (~4 steps), a pass of 120 rows per rank (~15 steps)
        whole = self._ranks(_shards(corpus), tmp_path)
        straight = [_steps(loader, total) for loader in whole]
        first = self._ranks(_shards(corpus), tmp_path)
        head = [_steps(loader, stop) for loader in first]
        states = [loader.state_dict() for loader in first]  # no process group: each holds its own position
        assert [s["consumed_samples"] for s in states] == [stop * 4] * 2
        resumed = self._ranks(_shards(corpus), tmp_path)
        for loader, state in zip(resumed, states):
            loader.load_state_dict(state)
        tail = [_steps(loader, total - stop) for loader in resumed]
        for rank in (0, 1):
            assert head[rank] + tail[rank] == straight[rank], rank
            # one window (32 rows) tokenized twice, never the consumed prefix
            tokenized = first[rank].packs.rows_tokenized + resumed[rank].packs.rows_tokenized
            assert tokenized <= whole[rank].packs.rows_tokenized + 32

    def test_a_resumed_rank_tokenizes_one_window_before_its_first_step(self, corpus, tmp_path):
        (first,) = [_loader(_module(_shards(corpus), tmp_path, 0, 2))]
        _steps(first, 9)
        state = first.state_dict()
        assert state["positions"]["0"][0] >= 2, "resumes in window 2 or later"
        resumed = _loader(_module(_shards(corpus), tmp_path, 0, 2))
        resumed.load_state_dict(state)
        next(iter(resumed))
        assert resumed.packs.rows_tokenized <= 32 < first.packs.rows_tokenized

    def test_without_its_position_a_rank_replays_its_stream_to_the_same_packs(self, corpus, tmp_path, caplog):
        straight = _steps(_loader(_module(_shards(corpus), tmp_path, 1, 2)), 10)
        first = _loader(_module(_shards(corpus), tmp_path, 1, 2))
        _steps(first, 6)
        state = first.state_dict()
        state["positions"] = {}  # e.g. saved by the data module alone
        resumed = _loader(_module(_shards(corpus), tmp_path, 1, 2))
        resumed.load_state_dict(state)
        assert _steps(resumed, 4) == straight[6:]
        assert "replaying its first 12 packs" in caplog.text

    def test_the_data_module_state_resumes_a_loader_made_after_it(self, corpus, tmp_path):
        straight = _steps(_loader(_module(_shards(corpus), tmp_path)), 8)
        module = _module(_shards(corpus), tmp_path)
        _steps(_loader(module), 5)
        state = module.state_dict()
        assert state["consumed_samples"] == 10 and state["positions"]["0"]
        fresh = _module(_shards(corpus), tmp_path)
        fresh.load_state_dict(state)
        assert fresh.consumed_samples == 10
        assert _steps(_loader(fresh), 3) == straight[5:]

    def test_a_loader_requested_again_goes_on_where_the_last_one_stands(self, corpus, tmp_path):
        straight = _steps(_loader(_module(_shards(corpus), tmp_path)), 8)
        module = _module(_shards(corpus), tmp_path)
        head = _steps(_loader(module), 5)
        assert head + _steps(_loader(module), 3) == straight

    @pytest.mark.parametrize(
        ("change", "message"),
        [
            ({"world": 4}, "read by 2 data-parallel ranks, this run has 4"),
            ({"stream_window": 16}, r"other settings \(window differ\)"),
            ({"seed": 1}, r"other settings \(seed differ\)"),
            ({"micro_batches_per_step": 1}, "took 2 packs per rank and step"),
        ],
    )
    def test_a_state_of_another_stream_is_refused_naming_what_differs(self, change, message, corpus, tmp_path):
        loader = _loader(_module(_shards(corpus), tmp_path, 0, 2))
        _steps(loader, 2)
        state = loader.state_dict()
        world = change.pop("world", 2)
        other = _loader(_module(_shards(corpus), tmp_path, 0, world, **change))
        with pytest.raises(DataError, match=message):
            other.load_state_dict(state)

    def test_a_cached_run_state_is_refused(self, corpus, tmp_path):
        loader = _loader(_module(_shards(corpus), tmp_path))
        with pytest.raises(DataError, match="of a cached \\(map-style\\) run"):
            loader.load_state_dict({"consumed_samples": 4, "num_packs": 10, "seed": 0})


class TestEpochs:
    def test_a_rank_starts_its_next_pass_when_its_share_ends(self, tmp_path):
        """2 shards of 12 rows over 2 ranks: every pass a rank reads one whole shard, then the next pass."""
        for i in range(2):
            (tmp_path / f"s{i}.jsonl").write_text("\n".join(ROWS[i * 12 : (i + 1) * 12]) + "\n")
        loaders = [_loader(_module(str(tmp_path / "s*.jsonl"), tmp_path, r, 2, stream_window=8)) for r in (0, 1)]
        steps = [_steps(loader, 12) for loader in loaders]  # ~4 passes of ~3 packs
        assert all(len(s) == 12 for s in steps)
        positions = [loader.position.cursor.sources[0] for loader in loaders]
        assert all(p.epoch >= 3 for p in positions), positions
        shards = [[w.rows[0][2].split(":")[0] for w in _pass_windows(loaders[r].packs, 6)] for r in (0, 1)]
        assert all(a != b for a, b in zip(*shards)), "each pass gives the two shards to the two ranks"
        assert len(set(shards[0])) == 2, "the shard of a rank changes from pass to pass"


def _pass_windows(packs, count: int) -> list:
    """The first window of each of the first ``count`` passes (windows of ``packs.window`` rows)."""
    out, epoch = [], -1
    for window in packs.windows(StreamCursor.start(1)):
        if window.start.sources[0].epoch != epoch:
            epoch = window.start.sources[0].epoch
            out.append(window)
        if len(out) == count:
            return out
    return out


class TestMixing:
    @pytest.fixture
    def two_sources(self, corpus, tmp_path) -> list[dict]:
        text = tmp_path / "text.jsonl"
        text.write_text("\n".join((TINY / "pretrain.jsonl").read_text().split("\n")[:300]) + "\n")
        return [
            {"path": _shards(corpus), "streaming": True, "sample_ratio": 3.0},
            {"path": str(text), "streaming": True, "kind": "text", "sample_ratio": 1.0},
        ]

    def _mixed(self, sources, tmp, rank=0, world=1) -> StreamingLoader:
        return _loader(
            XTLDataModule(
                sources=sources, tokenizer="tiny:", cache_dir=str(tmp / "cache"), progress=False, pack_max_length=128,
                micro_batches_per_step=2, tokenize_workers=0, stream_window=64, rank=rank, world_size=world,
            )
        )  # fmt: skip

    def test_rows_are_drawn_by_sample_ratio_with_a_seeded_interleave(self, two_sources, tmp_path):
        packs = self._mixed(two_sources, tmp_path).packs
        windows = packs.windows(StreamCursor.start(2))
        drawn = [k for _ in range(40) for k, _, _ in next(windows).rows]
        assert len(drawn) >= 2000
        assert abs(drawn.count(0) / len(drawn) - 0.75) < 0.03
        again = self._mixed(two_sources, tmp_path).packs.windows(StreamCursor.start(2))
        assert [k for _ in range(40) for k, _, _ in next(again).rows] == drawn

    def test_a_mixed_stream_resumes_exactly(self, two_sources, tmp_path):
        straight = _steps(self._mixed(two_sources, tmp_path, 1, 2), 12)
        first = self._mixed(two_sources, tmp_path, 1, 2)
        _steps(first, 7)
        resumed = self._mixed(two_sources, tmp_path, 1, 2)
        resumed.load_state_dict(first.state_dict())
        assert _steps(resumed, 5) == straight[7:]


class TestRemoteAndDatasetsShards:
    def test_fsspec_memory_shards_stream_as_the_local_ones(self, corpus, tmp_path):
        import fsspec

        fs = fsspec.filesystem("memory")
        try:
            for shard in sorted((corpus / "shards").iterdir()):
                fs.pipe(f"/xtl_stream_test/shards/{shard.name}", shard.read_bytes())
            remote = _steps(_loader(_module("memory://xtl_stream_test/shards/part*", tmp_path, 1, 2)), 8)
        finally:
            fs.rm("/xtl_stream_test", recursive=True)
        assert remote == _steps(_loader(_module(_shards(corpus), tmp_path, 1, 2)), 8)

    def test_datasets_streaming_of_local_json_files_gives_the_line_reader_packs(self, corpus, tmp_path):
        hf = _loader(_module(_shards(corpus), tmp_path, 0, 2, source={"format": "json"}))
        assert hf.packs.sources[0].formats == ["json"] * SHARDS
        local = _loader(_module(_shards(corpus), tmp_path, 0, 2))
        assert _steps(hf, 16) == _steps(local, 16)  # across a window of rows skipped by datasets' skip()

    def test_datasets_streaming_resumes_exactly(self, corpus, tmp_path):
        kw = {"source": {"format": "json"}}
        straight = _steps(_loader(_module(_shards(corpus), tmp_path, 0, 2, **kw)), 8)
        first = _loader(_module(_shards(corpus), tmp_path, 0, 2, **kw))
        _steps(first, 5)
        resumed = _loader(_module(_shards(corpus), tmp_path, 0, 2, **kw))
        resumed.load_state_dict(first.state_dict())
        assert _steps(resumed, 3) == straight[5:]


class TestRefusals:
    @pytest.mark.parametrize(
        ("kwargs", "message"),
        [
            ({"packing": "preset"}, "data.packing: preset cannot stream"),
            ({"sampler": "length_grouped"}, "data.sampler: length_grouped orders the packs of the whole set"),
            ({"source": {"kind": "preference"}}, "kind: preference cannot stream"),
            ({"source": {"kind": "prompt"}}, "kind: prompt cannot stream"),
            ({"val_sources": {"held": [{"path": "x.jsonl", "streaming": True}]}}, "data.val_sources.held: source"),
            ({"stream_window": 0}, "data.stream_window must be >= 1"),
        ],
    )
    def test_what_streaming_does_not_do_is_refused_naming_the_key(self, kwargs, message, corpus, tmp_path):
        with pytest.raises(DataError, match=message):
            _module(_shards(corpus), tmp_path, **kwargs)

    def test_a_set_of_streaming_and_cached_sources_is_refused(self, corpus, tmp_path):
        with pytest.raises(DataError, match="mixes streaming and cached sources"):
            XTLDataModule(
                sources=[{"path": _shards(corpus), "streaming": True}, {"path": str(corpus / "all.jsonl")}],
                tokenizer="tiny:",
            )

    @pytest.mark.parametrize(
        ("source", "error", "message"),
        [
            ({"path": "nothing/*.jsonl"}, DataFileNotFoundError, "matches no data files"),
            ({"format": "hf_disk"}, DataError, "format 'hf_disk' cannot stream"),
        ],
    )
    def test_bad_shards_are_refused_at_setup(self, source, error, message, corpus, tmp_path):
        module = _module(source.pop("path", _shards(corpus)), tmp_path, source=source)
        with pytest.raises(error, match=message):
            module.setup()

    def test_a_run_without_max_steps_is_refused(self, corpus, tmp_path):
        from lightning.pytorch import Trainer

        module = _module(_shards(corpus), tmp_path)
        module.trainer = Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
        with pytest.raises(DataError, match="trainer.max_steps: a streaming run has no epochs"):
            module.train_dataloader()

    def test_validation_at_a_share_of_an_epoch_is_refused(self, corpus, tmp_path):
        from lightning.pytorch import Trainer

        module = _module(_shards(corpus), tmp_path, val_sources={"held": [{"path": str(corpus / "all.jsonl")}]})
        module.trainer = Trainer(max_steps=5, val_check_interval=0.5, logger=False, enable_checkpointing=False)
        with pytest.raises(DataError, match="trainer.val_check_interval: 0.5 is a share of an epoch"):
            module.train_dataloader()


def _fragment(tmp: Path, corpus: Path, trainer: str = "", validate: bool = False) -> Path:
    """A config fragment streaming the 4 shards (windows of 48 rows, one tokenize process); validation on the cached
    held-out set every 3 steps, or none."""
    val = "  limit_val_batches: 2\n  val_check_interval: 3\n" if validate else "  val_check_interval: null\n"
    fragment = tmp / "stream.yaml"
    fragment.write_text(
        f"data:\n  sources:\n    - {{path: {json.dumps(_shards(corpus))}, kind: chat, streaming: true}}\n"
        f"  stream_window: 48\n  tokenize_workers: 1\n{'' if validate else '  val_sources: null'}\n"
        f"trainer:\n{val}{trainer}"
    )
    return fragment


def _logged(work: Path) -> dict[str, list[str]]:
    """The train and validation losses of a run folder, as logged, in the order of its runs (a resumed run
    appends a log version)."""
    logged: dict[str, list[str]] = {"train/loss": [], "val/loss": []}
    for metrics in sorted(work.glob("runs/tiny_sft/logs/version_*/metrics.csv")):
        for row in csv.DictReader(metrics.open()):
            for key, values in logged.items():
                if row.get(key):
                    values.append(row[key])
    return logged


class TestFit:
    def test_a_streaming_fit_resumed_after_4_steps_logs_the_losses_of_6_straight(self, corpus, data_cache, tmp_path):
        """With validation on the cached held-out set every 3 steps (a map-style loader beside the stream)."""
        fragment = _fragment(tmp_path, corpus, validate=True)
        args = _tiny_args(ROOT / "configs/tiny_sft.yaml", data_cache, "--config", str(fragment))
        args = ["fit", *args, "--model.init_args.schedule.decay_steps", "10", "--trainer.precision", "32-true"]
        (tmp_path / "straight").mkdir()
        (tmp_path / "resumed").mkdir()
        _, output = run_fit([*args, "--trainer.max_steps", "6"], tmp_path / "straight")
        assert "xtl data: streaming 1 source(s), 4 shard(s)" in output
        run_fit([*args, "--trainer.max_steps", "4"], tmp_path / "resumed")
        _, output = run_fit([*args, "--trainer.max_steps", "6", "--ckpt_path", "last"], tmp_path / "resumed")
        assert "replaying" not in output
        straight, resumed = _logged(tmp_path / "straight"), _logged(tmp_path / "resumed")
        assert len(straight["train/loss"]) == 6 and len(straight["val/loss"]) == 2
        assert resumed == straight

    @pytest.mark.slow
    @pytest.mark.distributed
    def test_two_fsdp_ranks_resume_a_stream_exactly(self, corpus, data_cache, tmp_path):
        fsdp = "  devices: 2\n  strategy: {class_path: xtl.strategies.FSDPStrategy}\n"
        args = _tiny_args(
            ROOT / "configs/tiny_sft.yaml", data_cache, "--config", str(_fragment(tmp_path, corpus, trainer=fsdp))
        )
        args = ["fit", *args, "--model.init_args.schedule.decay_steps", "10", "--trainer.precision", "32-true"]
        (tmp_path / "straight").mkdir()
        (tmp_path / "resumed").mkdir()
        straight, _ = run_fit([*args, "--trainer.max_steps", "6"], tmp_path / "straight", processes=True)
        run_fit([*args, "--trainer.max_steps", "4"], tmp_path / "resumed", processes=True)
        meta = torch.load(tmp_path / "resumed/runs/tiny_sft/checkpoints/last.ckpt/meta.pt", weights_only=False)
        (state,) = meta["loops"]["fit_loop"]["state_dict"]["combined_loader"]
        assert sorted(state["positions"]) == ["0", "1"] and state["consumed_samples"] == 16
        _, output = run_fit(
            [*args, "--trainer.max_steps", "6", "--ckpt_path", "last"], tmp_path / "resumed", processes=True
        )
        assert "replaying" not in output
        assert sorted(straight) == list(range(6))
        assert _logged(tmp_path / "resumed") == _logged(tmp_path / "straight")
