"""``FSDPStrategy(async_save=True)``: DCP checkpoints written in the background keep the crash-consistent rename
(only a complete directory gets the real name) and resume exactly; the option needs distributed checkpoints."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.checkpoint.filesystem import _FileSystemWriter

import xtl.strategies.fsdp as fsdp
from tests.cli.test_cli import ROOT, SMALL_MODEL
from xtl.errors import ConfigError
from xtl.strategies import FSDPStrategy
from xtl.strategies.checkpoint_io import DCP_METADATA, LIGHTNING_METADATA, checkpoint_problem, raise_if_unreadable

STEPS = 4
FSDP_RUN = """\
trainer:
  devices: 2
  precision: 32-true
  val_check_interval: null
  enable_progress_bar: false
  strategy:
    class_path: xtl.strategies.FSDPStrategy
    init_args: {process_group_backend: gloo, async_save: ASYNC}
  callbacks:
    - class_path: xtl.callbacks.TrainingCheckpoint
      init_args: {dirpath: checkpoints, save_last: true, every_n_train_steps: 2, save_top_k: -1}
data:
  val_sources: null
"""


def _fit(work: Path, cache: Path, async_save: bool, *extra: str) -> dict[int, str]:
    """A 2-process gloo FSDP ``xtl fit`` of the tiny recipe in ``work``; the ``train/loss`` it logged per step."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "fsdp.yaml").write_text(FSDP_RUN.replace("ASYNC", str(async_save).lower()))
    command = [sys.executable, "-m", "xtl", "fit", "--config", str(ROOT / "configs/tiny_sft.yaml")]
    command += ["--config", str(work / "fsdp.yaml"), "--trainer.max_steps", str(STEPS)]
    command += ["--data.cache_dir", str(cache), "--data.pack_max_length", "128", *SMALL_MODEL, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    losses: dict[int, str] = {}
    for metrics in sorted((work / "runs/tiny_sft/logs").glob("version_*/metrics.csv")):
        for row in csv.DictReader(metrics.open()):
            if row.get("train/loss"):
                losses[int(row["step"])] = row["train/loss"]
    return losses


@pytest.mark.distributed
class TestAsyncSave:
    @pytest.fixture(scope="class")
    def plain(self, tmp_path_factory, data_cache) -> dict[int, str]:
        """The uninterrupted run with synchronous checkpoints."""
        return _fit(tmp_path_factory.mktemp("plain"), data_cache, False)

    @pytest.fixture(scope="class")
    def async_run(self, tmp_path_factory, data_cache) -> tuple[Path, dict[int, str]]:
        """The same run with ``async_save``: checkpoints at steps 2 and 4, ``last.ckpt`` after each."""
        work = tmp_path_factory.mktemp("async")
        return work, _fit(work, data_cache, True)

    def test_async_saving_leaves_the_losses_unchanged(self, plain, async_run):
        assert sorted(plain) == list(range(STEPS))
        assert async_run[1] == plain

    def test_only_complete_checkpoints_are_left_under_their_names(self, async_run):
        """After the fit no temporary copy is left; every checkpoint is whole, and ``last.ckpt`` holds the final
        step (its background write was finished and renamed at teardown)."""
        checkpoints = async_run[0] / "runs/tiny_sft/checkpoints"
        assert sorted(p.name for p in checkpoints.iterdir()) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt",
                                                                  "last.ckpt"]  # fmt: skip
        for checkpoint in checkpoints.iterdir():
            raise_if_unreadable(checkpoint)
        meta = torch.load(checkpoints / "last.ckpt" / LIGHTNING_METADATA, weights_only=False)
        assert meta["global_step"] == STEPS

    def test_resume_from_a_middle_checkpoint_is_exact(self, plain, async_run, tmp_path, data_cache):
        """Resumed (async again) from the step-2 checkpoint: steps 2 and 3 log bitwise the uninterrupted losses."""
        middle = async_run[0] / "runs/tiny_sft/checkpoints/epoch=0-step=2.ckpt"
        resumed = _fit(tmp_path, data_cache, True, "--ckpt_path", str(middle))
        assert resumed == {step: plain[step] for step in (2, 3)}


class TestAsyncSaveUnit:
    """One process (a gloo group of one): the background write is held until the test releases it."""

    def test_async_save_without_distributed_checkpoints_is_refused(self):
        with pytest.raises(ConfigError) as err:
            FSDPStrategy(async_save=True, save_distributed_checkpoint=False)
        message = str(err.value)
        assert "\n" not in message
        assert "trainer.strategy.init_args.async_save" in message and "save_distributed_checkpoint: true" in message

    @pytest.fixture
    def strategy(self, tmp_path, monkeypatch):
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
        release = threading.Event()
        write_data = _FileSystemWriter.write_data

        def held_write_data(writer, plan, planner):
            assert release.wait(timeout=30), "the test never released the write"
            return write_data(writer, plan, planner)

        monkeypatch.setattr(_FileSystemWriter, "write_data", held_write_data)
        strategy = FSDPStrategy(async_save=True, process_group_backend="gloo")
        strategy.release = release
        try:
            yield strategy
        finally:
            release.set()
            strategy.finish_pending_save()
            if strategy._checkpoint_group is not None:
                dist.destroy_process_group(strategy._checkpoint_group)
            dist.destroy_process_group()

    @staticmethod
    def _save(strategy: FSDPStrategy, path: Path, weight: torch.Tensor) -> None:
        checkpoint = {
            "state_dict": {"weight": weight},
            "optimizer_states": [{"state": {0: {"exp_avg": weight * 2}}, "param_groups": [{"lr": 0.1}]}],
            "global_step": 7,
        }
        strategy.save_checkpoint(checkpoint, path)

    @staticmethod
    def _release_later(strategy: FSDPStrategy) -> threading.Timer:
        timer = threading.Timer(0.3, strategy.release.set)
        timer.start()
        return timer

    def test_the_rename_waits_for_the_background_write(self, strategy, tmp_path, monkeypatch):
        path, weight = tmp_path / "last.ckpt", torch.arange(6.0)
        self._save(strategy, path, weight)
        tmp = path.with_name(".last.ckpt.tmp")
        # the save returned while its tensors are still being written: only the temporary copy exists
        assert not path.exists() and (tmp / LIGHTNING_METADATA).is_file() and not (tmp / DCP_METADATA).exists()
        weight.add_(100.0)  # training goes on: the checkpoint keeps the values it was saved with

        seen = []
        replace, future = fsdp._replace, strategy._pending_save.future

        def checked_replace(src: Path, dst: Path) -> None:
            seen.append((future.done(), checkpoint_problem(src)))
            replace(src, dst)

        monkeypatch.setattr(fsdp, "_replace", checked_replace)
        self._release_later(strategy)
        strategy.finish_pending_save()
        assert seen == [(True, None)], "renamed before the directory was complete"
        assert not tmp.exists()
        raise_if_unreadable(path)
        state = {"state_dict": {"weight": torch.zeros(6)}}
        dcp.load(state, checkpoint_id=path)
        assert torch.equal(state["state_dict"]["weight"], torch.arange(6.0))

    def test_a_load_waits_for_the_pending_save(self, strategy, tmp_path, monkeypatch):
        path = tmp_path / "epoch=0-step=2.ckpt"
        self._save(strategy, path, torch.ones(3))
        monkeypatch.setattr(ModelParallelStrategy, "load_checkpoint", lambda self, p, weights_only=None: {"at": p})
        self._release_later(strategy)
        assert strategy.load_checkpoint(path) == {"at": path}  # raise_if_unreadable found it whole

    def test_the_next_save_finishes_the_pending_one_first(self, strategy, tmp_path):
        first, second = tmp_path / "epoch=0-step=2.ckpt", tmp_path / "epoch=0-step=4.ckpt"
        self._save(strategy, first, torch.ones(3))
        self._release_later(strategy)
        self._save(strategy, second, torch.ones(3))
        assert checkpoint_problem(first) is None and not first.with_name(f".{first.name}.tmp").exists()
        assert strategy._pending_save is not None and strategy._pending_save.path == second

    def test_removing_a_pending_checkpoint_waits_then_removes_it(self, strategy, tmp_path):
        path = tmp_path / "epoch=0-step=2.ckpt"
        self._save(strategy, path, torch.ones(3))
        self._release_later(strategy)
        strategy.remove_checkpoint(str(path))
        strategy.finish_pending_save()  # nothing is left to rename back into place
        assert sorted(p.name for p in tmp_path.iterdir() if p.name != "store") == []

    def test_teardown_finishes_the_pending_save(self, strategy, tmp_path, monkeypatch):
        monkeypatch.setattr(ModelParallelStrategy, "teardown", lambda self: None)
        path = tmp_path / "last.ckpt"
        self._save(strategy, path, torch.ones(3))
        self._release_later(strategy)
        strategy.teardown()
        assert checkpoint_problem(path) is None and strategy._checkpoint_group is None
