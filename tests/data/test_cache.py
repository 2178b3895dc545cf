"""Tokenization cache: hits, invalidation, atomic builds, concurrent builders, multi-process builds."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from xtl.data import (
    ChatTokenizeFn,
    DataError,
    JsonlSource,
    PretrainTokenizeFn,
    build_cache,
    cache_key,
    load_cache,
)
from xtl.data.sources import FileHashMemo

from .conftest import write_jsonl


class GuardedFn(PretrainTokenizeFn):
    """Pretraining fn that can be told to fail, to sleep, or to leave a marker file per builder process."""

    forbid = False
    fail_after_rows: int | None = None
    sleep_per_batch = 0.0
    marker_dir: Path | None = None

    def batch_arrays(self, rows, locate):
        if self.forbid:
            raise AssertionError("tokenization ran although the cache was warm")
        if self.marker_dir is not None:
            (self.marker_dir / str(os.getpid())).touch()
        if self.fail_after_rows is not None and locate(0).endswith(f":{self.fail_after_rows + 1}"):
            raise DataError("boom in the middle of a build")
        time.sleep(self.sleep_per_batch)
        return super().batch_arrays(rows, locate)


def _texts(n: int, salt: str = "") -> list[dict]:
    return [{"text": f"document {i} {salt} " + "word " * (i % 17)} for i in range(n)]


class TestCacheHit:
    def test_second_build_does_not_tokenize(self, tmp_path, qwen_tokenizer):
        src = JsonlSource(write_jsonl(tmp_path / "a.jsonl", _texts(50)))
        fn = GuardedFn(qwen_tokenizer)
        first = build_cache(src, fn, tmp_path / "cache", progress=False)
        fn.forbid = True
        second = build_cache(JsonlSource(src.path), fn, tmp_path / "cache", progress=False)
        assert second.directory == first.directory
        assert np.array_equal(second.input_ids, first.input_ids)
        for i in range(len(first)):
            item = second.item(i)
            assert item == PretrainTokenizeFn(qwen_tokenizer)(src.row(i))[0]

    def test_load_cache_misses_before_build(self, tmp_path, qwen_tokenizer):
        src = JsonlSource(write_jsonl(tmp_path / "a.jsonl", _texts(5)))
        assert load_cache(tmp_path / "cache", src, PretrainTokenizeFn(qwen_tokenizer)) is None


class TestCacheInvalidation:
    def test_file_change(self, tmp_path, qwen_tokenizer):
        path = write_jsonl(tmp_path / "a.jsonl", _texts(20))
        fn = PretrainTokenizeFn(qwen_tokenizer)
        first = build_cache(JsonlSource(path), fn, tmp_path / "cache", progress=False)
        write_jsonl(path, _texts(20, salt="changed"))
        assert load_cache(tmp_path / "cache", JsonlSource(path), fn) is None
        second = build_cache(JsonlSource(path), fn, tmp_path / "cache", progress=False)
        assert second.directory != first.directory
        assert len(second.input_ids) > len(first.input_ids)

    def test_tokenizer_change(self, tmp_path, qwen_tokenizer, llama_tokenizer):
        path = write_jsonl(tmp_path / "a.jsonl", _texts(5))
        a, _ = cache_key(JsonlSource(path), PretrainTokenizeFn(qwen_tokenizer))
        b, _ = cache_key(JsonlSource(path), PretrainTokenizeFn(llama_tokenizer))
        assert a != b

    def test_tokenize_fn_arguments_change(self, tmp_path, qwen_tokenizer):
        src = JsonlSource(write_jsonl(tmp_path / "a.jsonl", _texts(5)))
        keys = {
            cache_key(src, PretrainTokenizeFn(qwen_tokenizer))[0],
            cache_key(src, PretrainTokenizeFn(qwen_tokenizer, chunk_size=8))[0],
            cache_key(src, ChatTokenizeFn(qwen_tokenizer, template="qwen3"))[0],
            cache_key(src, ChatTokenizeFn(qwen_tokenizer, template="chatml"))[0],
        }
        assert len(keys) == 4


class TestAtomicBuild:
    def test_failed_build_leaves_nothing(self, tmp_path, qwen_tokenizer):
        src = JsonlSource(write_jsonl(tmp_path / "a.jsonl", _texts(40)))
        fn = GuardedFn(qwen_tokenizer)
        fn.fail_after_rows = 20
        with pytest.raises(DataError, match="boom"):
            build_cache(src, fn, tmp_path / "cache", rows_per_task=10, progress=False)
        assert load_cache(tmp_path / "cache", src, fn) is None
        assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")] == []

    def test_killed_build_leaves_no_valid_cache(self, tmp_path, qwen_tokenizer):
        src = JsonlSource(write_jsonl(tmp_path / "a.jsonl", _texts(60)))
        fn = GuardedFn(qwen_tokenizer)
        fn.sleep_per_batch = 0.2
        cache = tmp_path / "cache"
        proc = mp.get_context("fork").Process(target=build_cache, args=(src, fn, cache, 1, 5, False))
        proc.start()
        deadline = time.time() + 30
        while not list(cache.glob(".*.tmp-*")) and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        assert list(cache.glob(".*.tmp-*")), "the killed builder had started writing"
        assert load_cache(cache, src, fn) is None
        fn.sleep_per_batch = 0.0
        entry = build_cache(src, fn, cache, progress=False)  # lock released by the kill; stale temp removed
        assert len(entry) == 60
        assert not list(cache.glob(".*.tmp-*"))


def _concurrent_builder(src, fn, cache, barrier, queue) -> None:
    barrier.wait()
    entry = build_cache(src, fn, cache, num_proc=1, rows_per_task=8, progress=False)
    queue.put((entry.directory.name, np.asarray(entry.input_ids).tobytes(), np.asarray(entry.offsets).tobytes()))


class TestConcurrentBuilders:
    def test_two_processes_build_once(self, tmp_path, qwen_tokenizer):
        src = JsonlSource(write_jsonl(tmp_path / "a.jsonl", _texts(64)))
        len(src)  # index before forking
        markers = tmp_path / "markers"
        markers.mkdir()
        fn = GuardedFn(qwen_tokenizer)
        fn.sleep_per_batch = 0.05
        fn.marker_dir = markers
        ctx = mp.get_context("fork")
        barrier, queue = ctx.Barrier(2), ctx.Queue()
        procs = [
            ctx.Process(target=_concurrent_builder, args=(src, fn, tmp_path / "cache", barrier, queue))
            for _ in range(2)
        ]
        for p in procs:
            p.start()
        results = [queue.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0
        assert len(list(markers.iterdir())) == 1, "exactly one process tokenized"
        assert results[0] == results[1]
        fn.marker_dir = None
        reference = build_cache(src, PretrainTokenizeFn(qwen_tokenizer), tmp_path / "ref", progress=False)
        assert results[0][1] == np.asarray(reference.input_ids).tobytes()


class TestMultiProcessBuild:
    def test_worker_pool_equals_in_process(self, tmp_path, qwen_tokenizer):
        src = JsonlSource(write_jsonl(tmp_path / "a.jsonl", _texts(300)))
        fn = PretrainTokenizeFn(qwen_tokenizer, chunk_size=8)
        pooled = build_cache(src, fn, tmp_path / "c1", num_proc=2, rows_per_task=16, progress=False)
        single = build_cache(src, fn, tmp_path / "c2", num_proc=1, progress=False)
        assert np.array_equal(pooled.input_ids, single.input_ids)
        assert np.array_equal(pooled.loss_mask, single.loss_mask)
        assert np.array_equal(pooled.offsets, single.offsets)
        assert np.array_equal(pooled.rows, single.rows)
        assert pooled.meta["num_proc"] == 2 and len(pooled) > 300  # chunking made several samples per row

    def test_worker_error_names_file_and_line(self, tmp_path, qwen_tokenizer):
        records = _texts(100)
        records[70] = {"body": "no text here"}
        src = JsonlSource(write_jsonl(tmp_path / "a.jsonl", records))
        with pytest.raises(DataError, match=rf"{src.path}:71: no 'text' key"):
            build_cache(src, PretrainTokenizeFn(qwen_tokenizer), tmp_path / "c", num_proc=2, rows_per_task=8)


class TestRememberedSourceHash:
    def test_touched_source_hits_after_a_full_rehash(self, tmp_path, qwen_tokenizer):
        path = write_jsonl(tmp_path / "a.jsonl", _texts(30))
        fn = GuardedFn(qwen_tokenizer)
        first = build_cache(
            JsonlSource(path, FileHashMemo(tmp_path / "fp", 0)), fn, tmp_path / "cache", progress=False
        )
        st = path.stat()
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns - 10**9))  # touched: new mtime, same content
        fn.forbid = True
        memo = FileHashMemo(tmp_path / "fp", 0)
        second = build_cache(JsonlSource(path, memo), fn, tmp_path / "cache", progress=False)
        assert memo.full_hashes == 1 and second.directory == first.directory
        memo = FileHashMemo(tmp_path / "fp", 0)
        assert (
            build_cache(JsonlSource(path, memo), fn, tmp_path / "cache", progress=False).directory == first.directory
        )
        assert memo.full_hashes == 0

    def test_changed_content_rebuilds(self, tmp_path, qwen_tokenizer):
        path = write_jsonl(tmp_path / "a.jsonl", _texts(30, salt="x"))
        fn = GuardedFn(qwen_tokenizer)
        first = build_cache(
            JsonlSource(path, FileHashMemo(tmp_path / "fp", 0)), fn, tmp_path / "cache", progress=False
        )
        st = path.stat()
        write_jsonl(path, _texts(30, salt="y"))  # same size
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert path.stat().st_size == st.st_size
        fn.forbid = True
        with pytest.raises(AssertionError, match="tokenization ran"):
            build_cache(JsonlSource(path, FileHashMemo(tmp_path / "fp", 0)), fn, tmp_path / "cache", progress=False)
        fn.forbid = False
        second = build_cache(JsonlSource(path, FileHashMemo(tmp_path / "fp", 0)), fn, tmp_path / "cache")
        assert second.directory != first.directory
        assert second.item(0) == PretrainTokenizeFn(qwen_tokenizer)(_texts(30, salt="y")[0])[0]


class TestPickling:
    def test_pickled_by_path(self, tmp_path, qwen_tokenizer):
        entry = build_cache(
            JsonlSource(write_jsonl(tmp_path / "a.jsonl", _texts(200))), GuardedFn(qwen_tokenizer), tmp_path
        )
        blob = pickle.dumps(entry)
        assert len(blob) < 1000 < entry.input_ids.nbytes + entry.offsets.nbytes
        again = pickle.loads(blob)
        assert np.array_equal(again.input_ids, entry.input_ids) and again.item(3) == entry.item(3)
