"""``TrainingCheckpoint`` with an fsspec URL ``dirpath`` (``memory://``; ``file://`` rooted in another folder for two
ranks) and retention: a checkpoint counts only once its upload is complete, resume (``last``, ``auto``, a URL) gives
the uninterrupted losses bitwise, and ``keep_last`` / ``keep_every_n_steps`` / the best by a metric keep exactly
their checkpoints."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import lightning.pytorch as pl
import pytest
import torch
from jsonargparse import Namespace
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

import xtl.strategies.remote_checkpoint as remote
from tests.cli.test_cli import ROOT, SMALL_MODEL, _run_main, _tiny_args
from xtl.callbacks import TrainingCheckpoint
from xtl.errors import ConfigError
from xtl.model.hf.errors import CheckpointError
from xtl.run_layout import refuse_stale_checkpoints, root_outputs_at

STEPS = 10
KEEP = "keep_last: 2, keep_every_n_steps: 4"
# saves at 2, 4, ..., 10: keep_last 2 keeps 8 and 10, keep_every_n_steps 4 keeps 4 and 8; 2 and 6 are deleted
KEPT = ["epoch=0-step=10.ckpt", "epoch=0-step=4.ckpt", "epoch=0-step=8.ckpt", "last.ckpt"]
RUN = (
    "trainer:\n  val_check_interval: null\n  enable_progress_bar: false\n  callbacks:\n"
    "    - class_path: xtl.callbacks.TrainingCheckpoint\n"
    "      init_args: {{dirpath: {dirpath}, save_last: true, every_n_train_steps: {every}, save_top_k: {top_k},\n"
    "                  {more}}}\n"
    "data:\n  val_sources: null\n"
)


def _config(work: Path, dirpath: str, more: str = KEEP, every: int = 2, top_k: int = -1) -> Path:
    work.mkdir(parents=True, exist_ok=True)
    path = work / "checkpoints.yaml"
    path.write_text(RUN.format(dirpath=dirpath, more=more, every=every, top_k=top_k))
    return path


def _fit(work: Path, cache: Path, config: Path, steps: int, *extra: str) -> int:
    """``xtl fit`` of the tiny recipe in this process, in ``work`` (memory:// is per process)."""
    args = _tiny_args(ROOT / "configs/tiny_sft.yaml", cache, "--config", str(config))
    old = Path.cwd()
    os.chdir(work)
    try:
        return _run_main(["fit", *args, "--trainer.max_steps", str(steps), *extra])
    finally:
        os.chdir(old)


def _losses(work: Path) -> list[dict[int, str]]:
    """The ``train/loss`` by step that each fit in ``work`` logged, in order."""
    versions = sorted((work / "runs/tiny_sft/logs").glob("version_*"), key=lambda p: int(p.name.split("_")[1]))
    runs = []
    for version in versions:
        rows = csv.DictReader((version / "metrics.csv").open())
        runs.append({int(r["step"]): r["train/loss"] for r in rows if r.get("train/loss")})
    return runs


def _names(url: str) -> list[str]:
    return sorted(c.name for c in remote.complete_checkpoints(url))


def _entries(url: str) -> list[str]:
    """The names directly under ``url``."""
    fs, path = fsspec.core.url_to_fs(url)
    return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False))


def _staged_files(work: Path) -> list[Path]:
    return [p for p in (work / "runs/tiny_sft/.staging").rglob("*") if p.is_file()]


@pytest.fixture
def memory_url() -> Iterator[str]:
    """A fresh ``memory://`` folder, deleted afterwards."""
    bucket = f"xtl-test-{uuid.uuid4().hex[:8]}"
    yield f"memory://{bucket}/checkpoints"
    fs = fsspec.filesystem("memory")
    if fs.exists(f"/{bucket}"):
        fs.rm(f"/{bucket}", recursive=True)


class TestMemoryRoundTrip:
    @pytest.fixture(scope="class")
    def uninterrupted(self, tmp_path_factory, data_cache) -> Iterator[tuple[Path, str, dict[int, str]]]:
        """10 steps into ``memory://``, a save every 2 with keep_last 2 and keep_every_n_steps 4."""
        work = tmp_path_factory.mktemp("uninterrupted")
        url = f"memory://xtl-test-{uuid.uuid4().hex[:8]}/checkpoints"
        assert _fit(work, data_cache, _config(work, url), STEPS) == 0
        losses = _losses(work)
        assert len(losses) == 1 and sorted(losses[0]) == list(range(STEPS))
        yield work, url, losses[0]
        fsspec.filesystem("memory").rm(url.removeprefix("memory:/").rsplit("/", 1)[0], recursive=True)

    def test_the_folder_holds_exactly_what_the_rules_keep_and_nothing_is_staged(self, uninterrupted):
        work, url, _ = uninterrupted
        assert _names(url) == KEPT
        assert _entries(url) == KEPT  # no torn or stray upload either
        for name in KEPT:  # one upload each, its manifest naming it
            token = remote.read_checkpoint(f"{url}/{name}").token
            assert _entries(f"{url}/{name}") == sorted([remote.MANIFEST, token])
        assert remote.read_checkpoint(f"{url}/last.ckpt").global_step == STEPS
        assert _staged_files(work) == [] and not (work / "runs/tiny_sft/.staging").exists()

    @pytest.mark.parametrize("ckpt", ["last", "auto", "url"])
    def test_resume_gives_the_uninterrupted_losses(self, ckpt, uninterrupted, tmp_path, data_cache, memory_url):
        """6 steps, then resumed to 10 from ``last``, ``auto`` (both: step 6) or the URL of the step-4 checkpoint;
        the checkpoint state (saved steps) resumes too, so retention ends with the same names."""
        config = _config(tmp_path, memory_url)
        assert _fit(tmp_path, data_cache, config, 6) == 0
        assert _names(memory_url) == ["epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt", "last.ckpt"]
        start = 4 if ckpt == "url" else 6
        path = f"{memory_url}/epoch=0-step=4.ckpt" if ckpt == "url" else ckpt
        assert _fit(tmp_path, data_cache, config, STEPS, "--ckpt_path", path) == 0
        want = uninterrupted[2]
        assert _losses(tmp_path)[1] == {step: want[step] for step in range(start, STEPS)}
        if ckpt != "url":  # from step 4 the step-6 checkpoint of the first fit is unknown and stays
            assert _names(memory_url) == KEPT
        assert _staged_files(tmp_path) == []  # the download is removed once loaded

    def test_a_failed_manifest_write_leaves_the_previous_last(
        self, uninterrupted, tmp_path, data_cache, memory_url, monkeypatch
    ):
        """The commit of ``last.ckpt`` at step 4 dies before its manifest is written (its data is uploaded): the
        step-2 ``last`` still counts, whole, and ``--ckpt_path last`` resumes from it exactly."""
        write = remote._write_atomically
        commits = []

        def dying_write(fs, path, data):
            if path.endswith("last.ckpt/manifest.json"):
                commits.append(path)
                if len(commits) == 2:
                    raise RuntimeError("killed before the manifest")
            write(fs, path, data)

        monkeypatch.setattr(remote, "_write_atomically", dying_write)
        config = _config(tmp_path, memory_url)
        with pytest.raises(RuntimeError, match="killed before the manifest"):
            _fit(tmp_path, data_cache, config, 6)
        monkeypatch.setattr(remote, "_write_atomically", write)
        last = f"{memory_url}/last.ckpt"
        assert remote.read_checkpoint(last).global_step == 2 and remote.remote_checkpoint_problem(last) is None
        assert len(_entries(last)) == 3  # manifest, the step-2 upload, the orphaned one
        assert _fit(tmp_path, data_cache, config, 6, "--ckpt_path", "last") == 0
        want = uninterrupted[2]
        assert _losses(tmp_path)[-1] == {step: want[step] for step in range(2, 6)}
        assert len(_entries(last)) == 2  # the orphan was removed at the fit's start

    def test_a_torn_upload_never_counts_and_resume_picks_the_previous(
        self, uninterrupted, tmp_path, data_cache, memory_url, monkeypatch
    ):
        """The upload of the step-4 checkpoint breaks half way (half its bytes are there): the fit stops with one
        error line, the step-4 checkpoint does not count, and ``auto`` resumes from step 2 exactly."""
        memory = type(fsspec.filesystem("memory"))
        put_file = memory.put_file

        def tearing_put_file(self, lpath, rpath, **kwargs):
            if "step=4" in rpath:
                data = Path(lpath).read_bytes()
                self.pipe_file(rpath, data[: len(data) // 2])
                raise ConnectionError("connection reset by peer")
            return put_file(self, lpath, rpath, **kwargs)

        monkeypatch.setattr(memory, "put_file", tearing_put_file)
        config = _config(tmp_path, memory_url)
        assert _fit(tmp_path, data_cache, config, 6) == 2
        monkeypatch.setattr(memory, "put_file", put_file)
        assert _names(memory_url) == ["epoch=0-step=2.ckpt", "last.ckpt"]
        torn = f"{memory_url}/epoch=0-step=4.ckpt"
        assert fsspec.filesystem("memory").exists(torn) and remote.read_checkpoint(torn) is None
        with pytest.raises(CheckpointError, match="no complete upload.*the newest complete checkpoint there is"):
            remote.fetch(torn, tmp_path / "staging")
        assert _fit(tmp_path, data_cache, config, 6, "--ckpt_path", "auto") == 0
        want = uninterrupted[2]
        assert _losses(tmp_path)[-1] == {step: want[step] for step in range(2, 6)}
        assert _names(memory_url) == ["epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt", "last.ckpt"]


class CrashAt(pl.Callback):
    """Raises once the fit reaches ``step`` (before a checkpoint of that step is saved)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError(f"crashed at step {self.step}")


class TestBackgroundUpload:
    def test_an_upload_counts_only_once_committed(self, tmp_path, data_cache, memory_url):
        """Background uploads: the step-4 checkpoint is uploaded while training goes on, and would be committed by
        the next save; the run crashes at step 5 first, so it does not count (its data is there) and ``auto``
        resumes from the step-2 checkpoint. Resumed in the background too, the losses are the plain run's."""
        more = f"{KEEP}, upload_in_background: true"
        config = _config(tmp_path, memory_url, more=more)
        crash = tmp_path / "crash.yaml"
        crash.write_text(
            "trainer:\n  callbacks+:\n    - class_path: tests.callbacks.test_checkpoint_remote.CrashAt\n"
            "      init_args: {step: 5}\n"
        )
        with pytest.raises(RuntimeError, match="crashed at step 5"):
            _fit(tmp_path, data_cache, config, 6, "--config", str(crash))
        assert _names(memory_url) == ["epoch=0-step=2.ckpt", "last.ckpt"]
        uploaded = f"{memory_url}/epoch=0-step=4.ckpt"
        assert remote.read_checkpoint(uploaded) is None and _entries(uploaded) != []
        assert _fit(tmp_path, data_cache, config, 6, "--ckpt_path", "auto") == 0
        plain = tmp_path / "plain"
        assert _fit(plain, data_cache, _config(plain, "checkpoints", more=KEEP), 6) == 0
        assert _losses(tmp_path)[-1] == {step: _losses(plain)[0][step] for step in range(2, 6)}
        assert _names(memory_url) == ["epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt", "last.ckpt"]
        assert _staged_files(tmp_path) == []


class TestRetention:
    def test_best_by_a_metric_composes_with_keep_last(self, tmp_path, data_cache):
        """A local folder, a save every step: the best by ``train/loss`` (mode max: the first steps, where the loss
        is high) stays beside the 2 newest and ``last``; every other checkpoint is deleted."""
        more = "keep_last: 2, monitor: train/loss, mode: max"
        config = _config(tmp_path, "checkpoints", more=more, every=1, top_k=1)
        assert _fit(tmp_path, data_cache, config, 6) == 0
        losses = _losses(tmp_path)[0]
        # the checkpoint at global step s holds the metric logged by the step before it (row s - 1)
        best = 1 + max(losses, key=lambda step: float(losses[step]))
        want = {f"epoch=0-step={s}.ckpt" for s in (best, 5, 6)} | {"last.ckpt"}
        assert best < 5, "the test needs a best checkpoint that keep_last does not keep"
        assert {p.name for p in (tmp_path / "runs/tiny_sft/checkpoints").iterdir()} == want

    @pytest.mark.parametrize(
        ("init", "words"),
        [
            ({"keep_last": 0}, ["keep_last must be a whole number of 1 or more"]),
            ({"keep_every_n_steps": -4}, ["keep_every_n_steps must be"]),
            ({"keep_last": 2, "save_top_k": 0}, ["keep_last keeps periodic checkpoints", "save_top_k: 0"]),
            ({"keep_last": 2, "monitor": "val/loss", "save_top_k": -1}, ["save_top_k: -1 with monitor: val/loss"]),
            ({"dirpath": "memory://a/b", "save_last": "link"}, ["save_last: link", "use save_last: true"]),
            ({"dirpath": "nosuchfs://bucket/run"}, ["dirpath nosuchfs://bucket/run: Protocol not known: nosuchfs"]),
        ],
    )
    def test_bad_combinations_are_refused_naming_the_key(self, init, words):
        with pytest.raises(ConfigError) as err:
            TrainingCheckpoint(**init)
        message = str(err.value)
        assert "\n" not in message and "trainer.callbacks.TrainingCheckpoint.init_args." in message
        for word in words:
            assert word in message

    def test_a_bad_combination_is_one_error_line_from_the_cli(self, tmp_path, data_cache, capsys):
        config = _config(tmp_path, "checkpoints", more="keep_last: 2", top_k=0)
        assert _fit(tmp_path, data_cache, config, 2) == 2
        err = capsys.readouterr().err
        assert "xtl: error: trainer.callbacks.TrainingCheckpoint.init_args.keep_last keeps" in err
        assert "Traceback" not in err


class TestRemoteProtocol:
    """The upload protocol on a folder of files (a checkpoint file; a DCP directory staged on two nodes)."""

    @staticmethod
    def _dcp(folder: Path, shards: dict[str, int]) -> Path:
        """A DCP directory ``folder/d.ckpt`` with ``.metadata`` naming ``shards`` (name -> size), ``meta.pt`` and
        the shard files; returns it."""
        path = folder / "d.ckpt"
        path.mkdir(parents=True)
        storage = {MetadataIndex(name): _StorageInfo(name, 0, size) for name, size in shards.items()}
        torch.save({"global_step": 3}, path / "meta.pt")
        with (path / ".metadata").open("wb") as f:
            import pickle

            pickle.dump(Metadata(state_dict_metadata={}, storage_data=storage), f)
        for name, size in shards.items():
            (path / name).write_bytes(b"x" * size)
        return path

    def test_each_node_uploads_its_shards_and_rank_0_checks_them_all(self, tmp_path, memory_url):
        """Node-local staging: node 0 holds the metadata and rank 0's shard, node 1 only rank 1's. Rank 0's check
        reads the byte ranges of ``.metadata``: without rank 1's upload the commit is refused."""
        node0 = self._dcp(tmp_path / "node0", {"__0_0.distcp": 10, "__1_0.distcp": 20})
        node1 = tmp_path / "node1/d.ckpt"
        node1.mkdir(parents=True)
        (node0 / "__1_0.distcp").rename(node1 / "__1_0.distcp")
        url, token = f"{memory_url}/d.ckpt", remote.new_token()
        remote.upload(node0, url, token, rank=0)
        remote.upload(node1, url, token, rank=0)  # rank 0 of node 1 would upload nothing of rank 1's
        with pytest.raises(CheckpointError, match=r"shard d.ckpt/__1_0.distcp has no bytes uploaded of 20"):
            remote.commit(node0, url, token, global_step=3)
        assert remote.read_checkpoint(url) is None
        remote.upload(node1, url, token, rank=1)
        remote.commit(node0, url, token, global_step=3)
        files = remote.read_checkpoint(url).files
        assert files == {"d.ckpt/.metadata": (node0 / ".metadata").stat().st_size, "d.ckpt/__0_0.distcp": 10,
                         "d.ckpt/__1_0.distcp": 20, "d.ckpt/meta.pt": (node0 / "meta.pt").stat().st_size}  # fmt: skip
        local = remote.fetch(url, tmp_path / "staging")
        assert sorted(p.name for p in local.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]

    def test_a_replacement_counts_only_once_committed_and_then_drops_the_old_upload(self, tmp_path, memory_url):
        local = tmp_path / "last.ckpt"
        url = f"{memory_url}/last.ckpt"
        local.write_bytes(b"first")
        first = remote.new_token()
        remote.upload(local, url, first, 0)
        remote.commit(local, url, first, 1)
        local.write_bytes(b"second!")
        second = remote.new_token()
        remote.upload(local, url, second, 0)
        assert remote.read_checkpoint(url).token == first  # uploaded, not committed: the first still counts
        assert remote.remove_incomplete(memory_url) == [] and remote.read_checkpoint(url).token == first
        assert not fsspec.filesystem("memory").exists(f"{url}/{second}")  # the uncommitted upload was removed
        remote.upload(local, url, second, 0)
        remote.commit(local, url, second, 2)
        assert _entries(url) == sorted([remote.MANIFEST, second])
        assert remote.fetch(url, tmp_path / "staging").read_bytes() == b"second!"

    def test_a_truncated_upload_is_refused_and_a_torn_checkpoint_removed(self, tmp_path, memory_url):
        local = tmp_path / "epoch=0-step=2.ckpt"
        local.write_bytes(b"0123456789")
        url, token = f"{memory_url}/{local.name}", remote.new_token()
        remote.upload(local, url, token, 0)
        fs, root = fsspec.core.url_to_fs(url)
        fs.pipe_file(f"{root}/{token}/{local.name}", b"01234")
        with pytest.raises(CheckpointError, match="has 5 bytes uploaded of 10"):
            remote.commit(local, url, token, 2)
        assert remote.remove_incomplete(memory_url) == [url] and not fs.exists(root)

    def test_a_manifest_naming_missing_bytes_is_not_complete(self, tmp_path, memory_url):
        local = tmp_path / "a.ckpt"
        local.write_bytes(b"0123456789")
        url, token = f"{memory_url}/a.ckpt", remote.new_token()
        remote.upload(local, url, token, 0)
        remote.commit(local, url, token, 2)
        fs, root = fsspec.core.url_to_fs(url)
        fs.pipe_file(f"{root}/{token}/a.ckpt", b"012")
        assert "has 3 bytes, its manifest says 10" in remote.remote_checkpoint_problem(url)
        assert remote.complete_checkpoints(memory_url) == []

    def test_the_manifest_is_replaced_by_a_rename_on_posix(self, tmp_path, monkeypatch):
        """``file://``: the manifest is written beside and renamed over the old one (never truncated in place)."""
        url = f"file://{tmp_path}/remote/x.ckpt"
        local = tmp_path / "x.ckpt"
        local.write_bytes(b"abc")
        renames = []
        replace = os.replace
        monkeypatch.setattr(os, "replace", lambda a, b: (renames.append((str(a), str(b))), replace(a, b)))
        token = remote.new_token()
        remote.upload(local, url, token, 0)
        remote.commit(local, url, token, 1)
        manifest = tmp_path / "remote/x.ckpt/manifest.json"
        assert renames == [(f"{manifest}.tmp-{os.getpid()}", str(manifest))]
        assert json.loads(manifest.read_text())["files"] == {"x.ckpt": 3}


class TestRunLayout:
    @staticmethod
    def _config(root: Path, dirpath: str) -> Namespace:
        callback = Namespace(class_path="xtl.callbacks.TrainingCheckpoint", init_args=Namespace(dirpath=dirpath))
        return Namespace(trainer=Namespace(default_root_dir=str(root), logger=None, callbacks=[callback]))

    def test_a_url_dirpath_is_left_alone(self, tmp_path):
        config = self._config(tmp_path, "s3://bucket/run/checkpoints")
        root_outputs_at(config, "fit")
        assert config.trainer.callbacks[0].init_args.dirpath == "s3://bucket/run/checkpoints"

    def test_a_fresh_fit_into_a_url_folder_with_checkpoints_is_refused(self, tmp_path, memory_url):
        config = self._config(tmp_path, memory_url)
        refuse_stale_checkpoints(config)  # empty
        local = tmp_path / "last.ckpt"
        local.write_bytes(b"abc")
        token = remote.new_token()
        remote.upload(local, f"{memory_url}/last.ckpt", token, 0)
        refuse_stale_checkpoints(config)  # an upload that never completed does not count
        remote.commit(local, f"{memory_url}/last.ckpt", token, 1)
        with pytest.raises(ConfigError, match=f"{memory_url} already holds .*newest: last.ckpt"):
            refuse_stale_checkpoints(config)


FSDP = """\
trainer:
  devices: 2
  precision: 32-true
  val_check_interval: null
  enable_progress_bar: false
  strategy:
    class_path: xtl.strategies.FSDPStrategy
    init_args: {process_group_backend: gloo}
  callbacks:
    - class_path: xtl.callbacks.TrainingCheckpoint
      init_args: {dirpath: "URL", save_last: true, every_n_train_steps: 2, save_top_k: -1, keep_last: 2,
                  upload_in_background: true}
data:
  val_sources: null
"""


@pytest.mark.slow
@pytest.mark.distributed
class TestTwoRanksFileURL:
    """FSDP on 2 gloo ranks, DCP checkpoints uploaded in the background to a ``file://`` URL in another folder."""

    @staticmethod
    def _fit(work: Path, cache: Path, url: str, steps: int, *extra: str) -> dict[int, str]:
        work.mkdir(parents=True, exist_ok=True)
        (work / "fsdp.yaml").write_text(FSDP.replace("URL", url))
        command = [sys.executable, "-m", "xtl", "fit", "--config", str(ROOT / "configs/tiny_sft.yaml")]
        command += ["--config", str(work / "fsdp.yaml"), "--trainer.max_steps", str(steps)]
        command += ["--data.cache_dir", str(cache), "--data.pack_max_length", "128", *SMALL_MODEL, *extra]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        proc = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=400)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return _losses(work)[-1]

    def test_round_trip_with_retention_and_exact_resume(self, tmp_path, data_cache):
        url = f"file://{tmp_path / 'bucket'}/checkpoints"
        full = self._fit(tmp_path / "full", data_cache, url, 6)
        assert sorted(full) == list(range(6))
        assert _names(url) == ["epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt", "last.ckpt"]
        last = remote.read_checkpoint(f"{url}/last.ckpt")
        assert last.global_step == 6
        assert sorted(last.files) == [f"last.ckpt/{n}" for n in (".metadata", "__0_0.distcp", "__1_0.distcp",
                                                                  "meta.pt")]  # fmt: skip
        assert _staged_files(tmp_path / "full") == []
        resumed = self._fit(tmp_path / "resumed", data_cache, url, 6, "--ckpt_path", f"{url}/epoch=0-step=4.ckpt")
        assert resumed == {step: full[step] for step in (4, 5)}
        assert _staged_files(tmp_path / "resumed") == []
