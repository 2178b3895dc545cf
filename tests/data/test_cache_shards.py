"""Sharded cache builds: shard boundaries, byte-identical assembly for every kind, concurrent builders, waiting,
errors, and the data module building one shard per node."""

from __future__ import annotations

import contextlib
import filecmp
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import xtl.data.cache as cache_mod
from xtl.data import DataConsumer, DataError, XTLDataModule, tiny_assets_dir
from xtl.data.cache import (
    assemble_cache,
    build_cache,
    build_cache_part,
    cache_key,
    load_cache,
    shard_rows,
    wait_for_cache,
)

from .conftest import write_jsonl

ROWS = 60
ROWS_PER_TASK = 7  # 9 blocks of the 60 rows, the last one short
PROVENANCE = ("build_seconds", "num_proc")  # differ between any two builds of one entry
VLM_SETTINGS = dict(patch_size=8, merge_size=2, temporal_patch_size=2, min_pixels=4096, max_pixels=4096)


class _Model(DataConsumer):
    def __init__(self, images: bool) -> None:
        self.images = images

    @property
    def reads_images(self) -> bool:
        return self.images


def _lines(path: Path, n: int = ROWS) -> list[dict]:
    with path.open() as f:
        return [json.loads(next(f)) for _ in range(n)]


def _write_once(path: Path, rows: list[dict]) -> str:
    if not path.exists():  # a test may change the file later; the corpus is written once per test
        path.parent.mkdir(parents=True, exist_ok=True)
        write_jsonl(path, rows)
    return str(path)


def _corpus(tmp_path: Path, kind: str) -> tuple[dict, dict, bool]:
    """(source spec, data module arguments, model reads images) of a small corpus of ``kind``."""
    tiny = tiny_assets_dir()
    if kind == "chat":
        return {"path": _write_once(tmp_path / "chat.jsonl", _lines(tiny / "sft_train.jsonl"))}, {}, False
    if kind == "chat_1100":  # three blocks of the default 512 rows
        return {"path": _write_once(tmp_path / "big.jsonl", _lines(tiny / "sft_train.jsonl", 1100))}, {}, False
    if kind == "text":
        path = _write_once(tmp_path / "text.jsonl", _lines(tiny / "pretrain.jsonl"))
        return {"path": path, "kind": "text", "chunk_size": 32, "chunk_overlap": 4}, {}, False
    if kind == "preference":  # margins (float32 tags), and bad rows dropped (rows without samples)
        rows = [{**row, "margin": i / 7} for i, row in enumerate(_lines(tiny / "preference_train.jsonl"))]
        for i in (3, 20, 21):
            rows[i]["chosen"] = []
        path = _write_once(tmp_path / "pref.jsonl", rows)
        return {"path": path, "kind": "preference", "margin_key": "margin", "bad_rows": "drop"}, {}, False
    if kind == "unpaired":  # a row's mismatched sample reads the row before it in its block
        path = _write_once(tmp_path / "kto.jsonl", _lines(tiny / "kto_train.jsonl"))
        return {"path": path, "kind": "unpaired_preference"}, {}, False
    if kind == "vlm_chat":
        vlm = tiny.parent / "tiny_vlm"
        if not (tmp_path / "vlm" / "images").exists():
            (tmp_path / "vlm").mkdir()
            (tmp_path / "vlm" / "images").symlink_to(vlm / "images")
        path = _write_once(tmp_path / "vlm" / "train.jsonl", _lines(vlm / "train.jsonl"))
        return {"path": path}, {"tokenizer": str(vlm), "template": "chatml", "image_processor": VLM_SETTINGS}, True
    raise ValueError(kind)


def _datamodule(tmp_path: Path, kind: str, cache_dir: Path, **kwargs) -> XTLDataModule:
    spec, args, images = _corpus(tmp_path, kind)
    base = {
        "tokenizer": "tiny:",
        "template": "qwen3",
        "pack_max_length": 256,
        "progress": False,
        "tokenize_workers": 1,
    }
    dm = XTLDataModule(sources=[spec], cache_dir=str(cache_dir), **{**base, **args, **kwargs})
    dm.feed(_Model(images))
    return dm


def _assert_same_entry(built: Path, reference: Path) -> None:
    """Every file byte for byte, and the meta but for the build's provenance."""
    names = sorted(p.name for p in reference.iterdir())
    assert sorted(p.name for p in built.iterdir()) == names
    for name in names:
        if name != "meta.json":
            assert filecmp.cmp(built / name, reference / name, shallow=False), name
    meta, expected = (json.loads((d / "meta.json").read_text()) for d in (built, reference))
    assert list(meta) == list(expected)
    assert {k: v for k, v in meta.items() if k not in PROVENANCE} == {
        k: v for k, v in expected.items() if k not in PROVENANCE
    }


class TestShardRows:
    @pytest.mark.parametrize("num_rows", [0, 1, 6, 7, 8, 60, 1000])
    @pytest.mark.parametrize("rows_per_task", [1, 7, 512])
    @pytest.mark.parametrize("num_shards", [1, 2, 3, 4, 12])
    def test_contiguous_whole_blocks_as_even_as_blocks_allow(self, num_rows, rows_per_task, num_shards):
        ranges = [shard_rows(num_rows, i, num_shards, rows_per_task) for i in range(num_shards)]
        assert ranges[0][0] == 0 and ranges[-1][1] == num_rows
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert all(start % rows_per_task == 0 or start == num_rows for start, _ in ranges)
        blocks = [-(-stop // rows_per_task) - start // rows_per_task for start, stop in ranges]
        assert sum(blocks) == -(-num_rows // rows_per_task)
        assert max(blocks) - min(blocks) <= 1

    def test_uneven_split_and_empty_shards(self):
        assert [shard_rows(60, i, 2, 7) for i in range(2)] == [(0, 28), (28, 60)]  # 4 and 5 blocks
        assert [shard_rows(10, i, 3, 7) for i in range(3)] == [(0, 0), (0, 7), (7, 10)]

    @pytest.mark.parametrize("shard,count", [(2, 2), (-1, 2), (0, 0)])
    def test_bad_shard(self, shard, count):
        with pytest.raises(DataError, match="index in"):
            shard_rows(10, shard, count)


class TestShardedEqualsUnsharded:
    @pytest.mark.parametrize("kind", ["chat", "text", "preference", "unpaired", "vlm_chat"])
    @pytest.mark.parametrize("num_shards", [2, 3, 12])  # 4+5 blocks; 3 each; 9 shards of one block and 3 empty
    def test_assembled_entry_is_the_unsharded_one(self, tmp_path, kind, num_shards):
        dm = _datamodule(tmp_path, kind, tmp_path / "whole")
        source, fn = dm.cache_inputs(dm.sources[0])
        reference = _whole(source, fn, tmp_path / "whole")
        order = list(range(num_shards)) if num_shards == 2 else list(reversed(range(num_shards)))
        results = [
            build_cache_part(source, fn, tmp_path / "sharded", i, num_shards, 1, ROWS_PER_TASK, progress=False)
            for i in order
        ]
        assert all(r is None for r in results[:-1])  # nobody assembles before the last part exists
        assert results[-1] is not None and results[-1].directory.name == reference.directory.name
        assert not list((tmp_path / "sharded").glob("*.parts"))  # the parts are removed once assembled
        _assert_same_entry(results[-1].directory, reference.directory)
        loaded = load_cache(tmp_path / "sharded", source, fn)
        assert loaded is not None and len(loaded) == len(reference) > 0
        assert loaded.item(len(loaded) - 1) == reference.item(len(reference) - 1)

    def test_default_blocks(self, tmp_path):
        """512-row blocks: a source of 1100 rows in 2 shards (2 and 1 blocks) and in 4 (one shard empty)."""
        rows = [{"text": f"document {i} " + "word " * (i % 13)} for i in range(1100)]
        dm = XTLDataModule(
            sources=[{"path": str(write_jsonl(tmp_path / "t.jsonl", rows)), "kind": "text"}],
            tokenizer="tiny:",
            cache_dir=str(tmp_path / "whole"),
            progress=False,
        )
        source, fn = dm.cache_inputs(dm.sources[0])
        reference = build_cache(source, fn, tmp_path / "whole", num_proc=1, progress=False)
        for n in (2, 4):
            entries = [build_cache_part(source, fn, tmp_path / f"s{n}", i, n, 1, progress=False) for i in range(n)]
            _assert_same_entry(entries[-1].directory, reference.directory)


def _build_shard(args: tuple) -> bool:
    """One builder process: start with the others, put its part in place with the others (so that every builder finds
    every part there and tries to assemble), say whether this process assembled the entry."""
    tmp_path, shard, num_shards, start, end = args
    dm = _datamodule(tmp_path, "unpaired", tmp_path / "shared")
    source, fn = dm.cache_inputs(dm.sources[0])
    assembled = []
    assemble, atomic = cache_mod._assemble_locked, cache_mod.atomic_directory
    cache_mod._assemble_locked = lambda *a: assembled.append(time.sleep(0.5)) or assemble(*a)  # the others queue up

    @contextlib.contextmanager
    def renamed_together(target: Path):
        with atomic(target) as tmp:
            yield tmp
        if target.name.startswith("part-"):
            end.wait(timeout=60)

    cache_mod.atomic_directory = renamed_together
    start.wait(timeout=60)
    entry = build_cache_part(source, fn, tmp_path / "shared", shard, num_shards, 1, ROWS_PER_TASK, progress=False)
    (tmp_path / f"result-{shard}").write_text(json.dumps([entry is not None, len(assembled)]))
    return True


def _node(tmp_path: Path, cache: str, rank: int, delay: float, prepare: bool, out: str) -> None:
    """A simulated node (or a rank that is not its node's first): prepare_data on its shard, then setup."""
    val = {"v": [_val(tmp_path)]}
    dm = _datamodule(tmp_path, "chat_1100", tmp_path / cache, shard_cache_build=True, val_sources=val)
    dm.trainer = SimpleNamespace(node_rank=rank, num_nodes=2, lightning_module=None, is_global_zero=rank == 0)
    cache_mod.WAIT_SECONDS = 30  # a part nobody builds fails the test in seconds, not in 10 minutes
    tasks = []
    original = cache_mod._tokenize_range
    cache_mod._tokenize_range = lambda bounds: tasks.append(list(bounds)) or original(bounds)
    time.sleep(delay)
    if prepare:
        dm.prepare_data()
    dm.setup()
    assert dm.train_split is not None
    entries = sorted(str(c.directory) for c in dm._caches.values())
    (tmp_path / out).write_text(json.dumps({"tasks": tasks, "entries": entries, "plan": dm.train_split.key}))


def _val(tmp_path: Path) -> dict:
    return {"path": _write_once(tmp_path / "val.jsonl", _lines(tiny_assets_dir() / "sft_eval.jsonl", 5))}


def _blocks(num_rows: int, shard: int, num_shards: int) -> list[tuple[int, int]]:
    """The 512-row tasks of a shard."""
    start, stop = shard_rows(num_rows, shard, num_shards)
    return [(s, min(s + 512, stop)) for s in range(start, stop, 512)]


class TestCoordination:
    def test_concurrent_builders_in_processes_assemble_once(self, tmp_path):
        dm = _datamodule(tmp_path, "unpaired", tmp_path / "whole")
        source, fn = dm.cache_inputs(dm.sources[0])
        reference = _whole(source, fn, tmp_path / "whole")
        ctx = mp.get_context("fork")
        start, end = ctx.Barrier(3), ctx.Barrier(3)
        procs = [ctx.Process(target=_build_shard, args=((tmp_path, i, 3, start, end),)) for i in range(3)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
            assert p.exitcode == 0
        results = [json.loads((tmp_path / f"result-{i}").read_text()) for i in range(3)]
        assert sum(count for _, count in results) == 1  # one assembly, whoever ended last
        assert any(complete for complete, _ in results)
        name, _ = cache_key(source, fn)
        _assert_same_entry(tmp_path / "shared" / name, reference.directory)

    def test_two_nodes_build_one_shard_each_into_a_shared_cache_dir(self, tmp_path):
        """Node 1 starts late: node 0 reaches setup first and waits; a third process (a second rank of node 0)
        only runs setup. Each node tokenizes its own shard only; all three load the entries of a plain build."""
        _datamodule(tmp_path, "chat_1100", tmp_path / "unused")  # the corpus is written before the processes start
        _val(tmp_path)
        ctx = mp.get_context("fork")
        runs = [("shared", 0, 0.0, True, "node0"), ("shared", 1, 2.0, True, "node1"), ("shared", 0, 0.5, False, "r1")]
        procs = [ctx.Process(target=_node, args=(tmp_path, *run)) for run in runs]
        for p in procs:
            p.start()
        for p in procs:
            p.join(180)
            assert p.exitcode == 0
        out = {name: json.loads((tmp_path / name).read_text()) for name in ("node0", "node1", "r1")}
        plain = _datamodule(tmp_path, "chat_1100", tmp_path / "plain", val_sources={"v": [_val(tmp_path)]})
        plain.setup()
        expected = {c.directory.name: c.directory for c in plain._caches.values()}
        assert len(expected) == 2
        for result in out.values():
            assert sorted(Path(e).name for e in result["entries"]) == sorted(expected)
            assert result["plan"] == plain.train_split.key
        for e in out["node0"]["entries"]:
            _assert_same_entry(Path(e), expected[Path(e).name])
        for node, name in ((0, "node0"), (1, "node1")):  # its shard of each source, nothing else
            assert sorted(tuple(t) for t in out[name]["tasks"]) == sorted(_blocks(1100, node, 2) + _blocks(5, node, 2))
        assert out["r1"]["tasks"] == []

    def test_per_node_cache_dir_times_out_naming_the_missing_part(self, tmp_path, monkeypatch):
        monkeypatch.setattr(cache_mod, "WAIT_SECONDS", 0.3)
        dm = _datamodule(tmp_path, "chat", tmp_path / "node0-only", shard_cache_build=True)
        dm.trainer = SimpleNamespace(node_rank=0, num_nodes=2, lightning_module=None, is_global_zero=True)
        dm.prepare_data()
        with pytest.raises(DataError, match=r"part\(s\) 1/2 missing") as err:
            dm.setup()
        assert "part(s) 1/2 missing" in str(err.value) and "shard_cache_build: false" in str(err.value)

    def test_one_node_or_option_off_builds_whole_entries(self, tmp_path):
        for cache, option, nodes in (("a", True, 1), ("b", False, 2)):
            dm = _datamodule(tmp_path, "chat", tmp_path / cache, shard_cache_build=option)
            dm.trainer = SimpleNamespace(node_rank=0, num_nodes=nodes, lightning_module=None, is_global_zero=True)
            assert dm.cache_shard() is None
            dm.prepare_data()
            assert len(list((tmp_path / cache).glob("chat-*[0-9a-f]"))) == 1
            assert not list((tmp_path / cache).glob("*.parts"))

    def test_parts_whose_builder_died_before_assembling_are_assembled_by_a_reader(self, tmp_path, monkeypatch):
        dm = _datamodule(tmp_path, "text", tmp_path / "c")
        source, fn = dm.cache_inputs(dm.sources[0])
        with monkeypatch.context() as m:
            m.setattr(cache_mod, "assemble_cache", lambda *a, **k: None)  # every builder dies before assembling
            for i in range(3):
                assert build_cache_part(source, fn, tmp_path / "c", i, 3, 1, ROWS_PER_TASK, progress=False) is None
        reference = _whole(source, fn, tmp_path / "whole")
        monkeypatch.setattr(cache_mod, "_tokenize_into", _forbidden)
        entry = wait_for_cache(source, fn, tmp_path / "c", 3, timeout=0)
        _assert_same_entry(entry.directory, reference.directory)

    def test_plain_build_assembles_a_complete_set_of_parts(self, tmp_path, monkeypatch):
        dm = _datamodule(tmp_path, "chat", tmp_path / "c")
        source, fn = dm.cache_inputs(dm.sources[0])
        with monkeypatch.context() as m:
            m.setattr(cache_mod, "assemble_cache", lambda *a, **k: None)
            for i in range(2):
                build_cache_part(source, fn, tmp_path / "c", i, 2, 1, ROWS_PER_TASK, progress=False)
        monkeypatch.setattr(cache_mod, "_tokenize_into", _forbidden)
        entry = build_cache(source, fn, tmp_path / "c", progress=False)
        assert len(entry) == ROWS and not list((tmp_path / "c").glob("*.parts"))


def _whole(source, fn, cache_dir: Path):
    """The unsharded build of the same blocks."""
    return build_cache(source, fn, cache_dir, num_proc=1, rows_per_task=ROWS_PER_TASK, progress=False)


def _forbidden(*args, **kwargs):
    raise AssertionError("tokenized although every part was on disk")


class TestErrors:
    def test_assembling_with_a_missing_part_names_it(self, tmp_path):
        dm = _datamodule(tmp_path, "chat", tmp_path / "c")
        source, fn = dm.cache_inputs(dm.sources[0])
        build_cache_part(source, fn, tmp_path / "c", 1, 3, 1, ROWS_PER_TASK, progress=False)
        with pytest.raises(DataError, match=r"part\(s\) 0/3, 2/3 missing in .*chat-\w+\.parts; do this"):
            assemble_cache(source, fn, tmp_path / "c", hint="do this")
        with pytest.raises(DataError, match=r"incomplete after waiting 0 s: part\(s\) 0/3, 2/3 missing"):
            wait_for_cache(source, fn, tmp_path / "c", 3, timeout=0)
        with pytest.raises(DataError, match="no parts"):
            assemble_cache(source, fn, tmp_path / "empty")

    def test_parts_of_another_key_are_named_with_what_differs(self, tmp_path):
        dm = _datamodule(tmp_path, "chat", tmp_path / "c")
        source, fn = dm.cache_inputs(dm.sources[0])
        old_name, _ = cache_key(source, fn)
        build_cache_part(source, fn, tmp_path / "c", 1, 2, 1, ROWS_PER_TASK, progress=False)
        path = Path(dm.sources[0].path)
        path.write_text(path.read_text().replace("Answer", "Reply"))  # the source changes between the shard jobs
        dm = _datamodule(tmp_path, "chat", tmp_path / "c")
        source, fn = dm.cache_inputs(dm.sources[0])
        name, _ = cache_key(source, fn)
        assert name != old_name
        build_cache_part(source, fn, tmp_path / "c", 0, 2, 1, ROWS_PER_TASK, progress=False)
        with pytest.raises(
            DataError, match=rf"1/2 missing.*1/2 exist in {old_name}\.parts, built with another source"
        ):
            assemble_cache(source, fn, tmp_path / "c")
        parts = tmp_path / "c" / f"{name}.parts"
        shutil.copytree(tmp_path / "c" / f"{old_name}.parts" / "part-00001-of-00002", parts / "part-00001-of-00002")
        with pytest.raises(DataError, match=rf"built for cache entry {old_name}, not {name} \(its source content"):
            assemble_cache(source, fn, tmp_path / "c")


@pytest.mark.slow
@pytest.mark.distributed
class TestTwoNodesFit:
    def test_each_node_tokenizes_its_shard_and_both_train(self, tmp_path):
        """``xtl fit`` on 2 simulated nodes (torchrun, one process each, HSDP 2 x 1 on gloo) with
        ``data.shard_cache_build``: node k tokenizes part k/2 of every source, and both train on the assembled
        entries, which are a plain build's."""
        from tests.cli.test_cli import ROOT, SMALL_MODEL
        from tests.strategies.test_layout import HSDP
        from tests.train.test_step import _free_port
        from xtl.tools.build_cache import main as build_cache_main

        (tmp_path / "hsdp.yaml").write_text(HSDP)
        config = ["--config", str(ROOT / "configs/tiny_sft.yaml"), "--config", str(tmp_path / "hsdp.yaml")]
        common = ["fit", *config, *SMALL_MODEL, "--data.pack_max_length", "128", "--trainer.max_steps", "2"]
        common += ["--data.cache_dir", str(tmp_path / "shared"), "--data.shard_cache_build", "true"]
        common += ["--trainer.num_nodes", "2", "--trainer.devices", "1"]
        port, procs = _free_port(), []
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        for node in (0, 1):
            launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"]
            launch += ["--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "xtl"]
            work = tmp_path / f"node{node}"
            work.mkdir()
            with (work / "log.txt").open("w") as log:
                procs.append(subprocess.Popen([*launch, *common], cwd=work, env=env, stdout=log, stderr=log))
        codes = [proc.wait(timeout=600) for proc in procs]
        logs = [(tmp_path / f"node{n}/log.txt").read_text() for n in (0, 1)]
        assert codes == [0, 0], "".join(log[-3000:] for log in logs)
        for node, log in enumerate(logs):
            assert f"tokenizing sft_train.jsonl part {node}/2" in log
            assert f"part {1 - node}/2" not in log
        plain = tmp_path / "plain"
        assert build_cache_main([*config, "--data.cache_dir", str(plain), "--data.progress", "false"]) == 0
        entries = list(plain.glob("sft_*-*[0-9a-f]"))
        assert len(entries) == 2  # training and test set (the HSDP fragment drops the validation set)
        for entry in entries:
            _assert_same_entry(tmp_path / "shared" / entry.name, entry)
        assert not list((tmp_path / "shared").glob("*.parts"))
