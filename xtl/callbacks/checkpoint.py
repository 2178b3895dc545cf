"""Lightning's ``ModelCheckpoint`` whose ``last`` checkpoint is always the newest state of the run, written to a local
folder or an fsspec URL, and kept as asked (the newest K, every N steps, the best by a metric)."""

from __future__ import annotations

import shutil
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint as LightningModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor

from xtl.callbacks._interrupt import Interrupted, StopRequest, write_line
from xtl.errors import ConfigError
from xtl.model.hf.errors import CheckpointError
from xtl.strategies.checkpoint_io import recover_interrupted_replace
from xtl.strategies.remote_checkpoint import (
    DOWNLOADS,
    commit,
    delete,
    fetch,
    is_download,
    is_url,
    new_token,
    newest_complete_checkpoint,
    read_checkpoint,
    remove_download,
    remove_incomplete,
    staging_dir_for,
    upload,
)

KEY = "trainer.callbacks.TrainingCheckpoint.init_args"


class TrainingCheckpoint(LightningModelCheckpoint):
    """``lightning.pytorch.callbacks.ModelCheckpoint`` (same arguments), with ``save_last`` kept up to date, fsspec
    URL folders and retention rules.

    (Its own name, so that a config naming Lightning's class by its short name ``ModelCheckpoint`` stays
    unambiguous.)

    **last.** Lightning writes ``last.ckpt`` only when another checkpoint is saved (every ``every_n_train_steps``, at
    a validation), so a run that ends between two saves -- ``max_steps`` not a multiple of ``every_n_train_steps`` --
    leaves a ``last.ckpt`` of an earlier step, and evaluation, export or resume from ``last`` would silently use
    it. This class also saves ``last`` when a fit ends at a step that no checkpoint holds yet. ``--ckpt_path last``
    first finishes a distributed checkpoint replacement that a crash interrupted
    (:func:`xtl.strategies.checkpoint_io.recover_interrupted_replace`), so ``last`` is never lost. ``last`` is saved
    as soon as the fit's final optimizer step completes (``max_steps`` reached, or the last batch of the last epoch),
    before validation and the other callbacks' ``on_train_end`` (an HF export, an evaluation): one of them failing
    finds the final step saved. It is saved once per step (``on_train_end`` then skips it).

    **Ctrl-C and SIGTERM.** During the fit the first SIGINT or SIGTERM asks the run to stop at the next optimizer
    step boundary (rank 0 prints ``xtl: interrupted (SIGINT) at step N; saving last.ckpt ...``); there every rank
    agrees on it, ``last`` (without ``save_last``: a checkpoint named by ``filename``) is saved at the step reached,
    and the process exits with 130 (SIGINT) or 143 (SIGTERM) (:mod:`xtl.callbacks._interrupt`). ``--ckpt_path last``
    resumes with no step lost. A second Ctrl-C stops at once, without saving. The first ``TrainingCheckpoint`` of
    the trainer handles the signals; without one, Lightning's handling applies (Ctrl-C stops at once).

    **URL folders.** ``dirpath`` may be an fsspec URL (``s3://bucket/run``, ``gs://...``, ``file:///shared/run``;
    the backend the URL needs, e.g. ``s3fs``, must be installed). Each checkpoint is written to the local
    ``staging_dir`` first (by Lightning, or by DCP on every rank), then uploaded, and counts only once the upload is
    complete (:mod:`xtl.strategies.remote_checkpoint`: the data first, a manifest last); the local copy is then
    removed. Every rank uploads the files it wrote, so a staging folder local to each node works. ``last.ckpt`` is
    replaced safely: a crash mid-upload leaves the previous one counting. ``--ckpt_path last`` / ``auto`` / a
    checkpoint URL download the checkpoint into the staging folder (once per node), which the fit removes once it
    has loaded it.

    **Retention.** ``keep_last`` and ``keep_every_n_steps`` compose with Lightning's best-by-metric rule (``monitor``
    + ``save_top_k`` + ``mode``): a checkpoint is deleted only when no rule keeps it, and ``last`` is always kept.
    With either set, every periodic checkpoint is saved (also one that is not among the ``save_top_k`` best), and
    without a ``monitor`` ``save_top_k`` (``-1`` or ``1``) no longer keeps every checkpoint. The rules apply to the
    checkpoints this callback saved in the run (kept in its state across resumes), locally and remotely.

    Args:
        dirpath: The checkpoint folder: a local path or an fsspec URL.
        keep_last: Keep the ``keep_last`` newest periodic checkpoints (by step; ``last`` not counted).
        keep_every_n_steps: Keep permanently, for each multiple of N steps, the first checkpoint at or after it (the
            checkpoints at multiples of N when ``every_n_train_steps`` divides N).
        staging_dir: With a URL ``dirpath``: the local folder checkpoints are written to before their upload
            (relative: to ``trainer.default_root_dir``; default ``<default_root_dir>/.staging/checkpoints-<hash>``).
            A folder local to each node (e.g. a node-local SSD) works.
        upload_in_background: With a URL ``dirpath``: upload in a background thread while training goes on; the
            checkpoint counts once the next save or the end of the fit has checked it complete (a crash before
            leaves the previous one).
        **kwargs: ``ModelCheckpoint``'s other arguments (``save_last``, ``every_n_train_steps``,
            ``monitor``, ``save_top_k``, ``mode``, ...).
    """

    def __init__(
        self,
        dirpath: str | Path | None = None,
        keep_last: int | None = None,
        keep_every_n_steps: int | None = None,
        staging_dir: str | None = None,
        upload_in_background: bool = False,
        **kwargs: Any,
    ) -> None:
        self._remote = dirpath is not None and is_url(dirpath)
        if self._remote:
            try:
                fsspec.core.url_to_fs(str(dirpath))
            except (ImportError, ValueError) as err:  # fsspec names the package: "Install s3fs to access S3"
                raise ConfigError(f"{KEY}.dirpath {dirpath}: {err}") from None
        super().__init__(dirpath=dirpath, **kwargs)
        if self._remote:
            self.dirpath = str(dirpath).rstrip("/")  # Lightning would make a file:// URL a local path
        self.keep_last = keep_last
        self.keep_every_n_steps = keep_every_n_steps
        self.staging_dir = staging_dir
        self.upload_in_background = upload_in_background
        self._check_retention()
        if self._remote and self.save_last == "link":
            raise ConfigError(
                f"{KEY}.save_last: link makes last.ckpt a symbolic link, which a URL dirpath ({dirpath}) cannot "
                "hold: use save_last: true"
            )
        self._saved: dict[str, int] = {}  # periodic checkpoints saved and not deleted -> their global step
        self._last_step: int | None = None  # the global step last was saved at in this fit
        self._stop: StopRequest | None = None  # the signal handlers (the trainer's first TrainingCheckpoint's)
        self._pending: list[_Upload] = []  # uploads not committed yet
        self._removals: list[str] = []  # remote deletions waiting for the pending uploads
        self._staging: Path | None = None

    @property
    def _retains(self) -> bool:
        return self.keep_last is not None or self.keep_every_n_steps is not None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Lightning's setup; with a URL ``dirpath`` at a fit, also remove what a killed run left: its local staging
        copies (each node) and its incomplete uploads (rank 0)."""
        super().setup(trainer, pl_module, stage)
        if not self._remote:
            return
        self._staging = self._staging_dir(trainer)
        if stage != "fit":
            return
        if trainer.local_rank == 0 and self._staging.is_dir():
            for entry in self._staging.iterdir():
                if entry.name != DOWNLOADS:  # the checkpoint being resumed may be there
                    _remove_local(entry)
        if trainer.is_global_zero:
            remove_incomplete(self.dirpath)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Once every rank has loaded the checkpoint it resumed from, remove the downloaded copy (the first
        ``TrainingCheckpoint`` of the trainer does, on each node) and this callback's other downloads. The first
        ``TrainingCheckpoint`` handles SIGINT and SIGTERM until the final step is saved."""
        super().on_train_start(trainer, pl_module)
        first = _ours(trainer)[0]
        self._last_step = None
        if self is first and not trainer.fast_dev_run:
            self._stop = StopRequest.install(trainer)
        resumed = trainer.ckpt_path
        if resumed is None and not self._remote:
            return
        trainer.strategy.barrier("TrainingCheckpoint.on_train_start")
        if trainer.local_rank != 0:
            return
        if self is first and resumed is not None and is_download(resumed):
            remove_download(resumed)
        if self._staging is not None:
            _remove_local(self._staging / DOWNLOADS)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        """Lightning's periodic saves; then, at an optimizer-step boundary: when this step ends the fit, save
        ``last`` now (before validation and the other callbacks' ``on_train_end``); when a signal asked the run to
        stop (any rank's, agreed by all), save ``last`` and stop with :class:`~xtl.callbacks._interrupt.Interrupted`
        (the trainer's last ``TrainingCheckpoint``, once every one has saved)."""
        super().on_train_batch_end(trainer, pl_module, *args)
        if trainer.fit_loop.epoch_loop._should_accumulate():
            return  # mid-step: gradients are still being accumulated
        self._at_boundary(trainer, ("step", trainer.fit_loop.epoch_loop.total_batch_idx), _ends_fit(trainer))

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Lightning's saves; then, in a fit, stop when a signal came during the validation (a long evaluation would
        otherwise delay the stop by a training step)."""
        super().on_validation_end(trainer, pl_module)
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
            self._at_boundary(trainer, ("validation", trainer.fit_loop.epoch_loop.total_batch_idx), final=False)

    def _at_boundary(self, trainer: pl.Trainer, boundary: tuple[str, int], final: bool) -> None:
        """Where every rank is between two steps: save ``last`` when the fit's final step is done (``final``) or a
        signal asked to stop (then stop, from the trainer's last ``TrainingCheckpoint``)."""
        if trainer.fast_dev_run:  # Lightning saves nothing then
            return
        ours = _ours(trainer)
        stop = ours[0]._stop
        signum = stop.agree(trainer, boundary) if stop is not None else None
        if signum is None and not final:
            return
        saved = self._last_step if self.save_last else self._last_global_step_saved
        if saved != trainer.global_step and (self.save_last or signum is not None):
            previous = self._last_global_step_saved
            self._save_now(trainer)
            if signum is None:  # validation at this step may still save its best-by-metric checkpoint
                self._last_global_step_saved = previous
        if self is not ours[-1]:
            return
        if stop is not None:  # the final step is saved: Ctrl-C during the exports and evaluations stops at once
            stop.uninstall()
        if signum is not None:
            if boundary[0] == "step":  # the step's metrics, which Lightning logs after this hook
                connector = trainer._logger_connector
                connector.on_batch_end()
                connector.update_train_step_metrics()
            if trainer.is_global_zero:
                saved = ", ".join(c.last_model_path or c._last_checkpoint_saved for c in ours)
                write_line(
                    f"xtl: saved {saved} at step {trainer.global_step}; exiting with {128 + signum} "
                    f"({signal.Signals(signum).name}); resume with --ckpt_path last"
                )
            raise Interrupted(signum)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Save ``last`` when the fit's final step is not saved yet; wait for the uploads still running."""
        if self._stop is not None:
            self._stop.uninstall()
        if self.save_last and not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        else:
            super().on_train_end(trainer, pl_module)
        self._finish_uploads(trainer)
        if self._staging is not None and trainer.local_rank == 0:  # the staging folder, once empty
            default = self._staging.parent.name == ".staging"
            for folder in (self._staging, self._staging.parent) if default else (self._staging,):
                try:
                    folder.rmdir()
                except OSError:
                    break

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """The run fails: wait for this rank's background uploads and commit none (they do not count; the next fit
        deletes them), then Lightning's (``save_on_exception``)."""
        if self._stop is not None:
            self._stop.uninstall()
        for pending in self._pending:
            pending.wait()
        self._pending, self._removals = [], []
        super().on_exception(trainer, pl_module, exception)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Give the signals back (where a fit ended without ``on_train_end``)."""
        super().teardown(trainer, pl_module, stage)
        if self._stop is not None:
            self._stop.uninstall()
            self._stop = None

    def state_dict(self) -> dict[str, Any]:
        """Lightning's state and the periodic checkpoints saved so far (path -> step), for the retention rules."""
        return {**super().state_dict(), "saved_steps": dict(self._saved)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Lightning's; the saved checkpoints too when ``dirpath`` is the checkpoint's (as Lightning's top k)."""
        super().load_state_dict(state_dict)
        if state_dict.get("dirpath", self.dirpath) == self.dirpath:
            self._saved = dict(state_dict.get("saved_steps", {}))

    def file_exists(self, filepath: str | Path, trainer: pl.Trainer) -> bool:
        """Whether ``filepath`` holds a checkpoint (a URL: a complete one), decided by rank 0."""
        if not self._remote:
            return super().file_exists(filepath, trainer)
        exists = read_checkpoint(str(filepath)) is not None if trainer.is_global_zero else False
        return trainer.strategy.reduce_boolean_decision(exists, all=False)

    def _check_retention(self) -> None:
        for key in ("keep_last", "keep_every_n_steps"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"{KEY}.{key} must be a whole number of 1 or more, got {value!r}")
        if not self._retains:
            return
        keys = " and ".join(k for k in ("keep_last", "keep_every_n_steps") if getattr(self, k) is not None)
        if self.save_top_k == 0:
            raise ConfigError(
                f"{KEY}.{keys} keeps periodic checkpoints, but save_top_k: 0 saves none (only last): remove "
                f"save_top_k: 0, or remove {keys}"
            )
        if self.monitor is not None and self.save_top_k == -1:
            raise ConfigError(
                f"{KEY}.save_top_k: -1 with monitor: {self.monitor} keeps every checkpoint, so {keys} would delete "
                "none: set save_top_k to the number of best checkpoints to keep"
            )

    def _save_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        """Save (with a URL ``dirpath``: to the staging folder, then upload), then apply the retention rules."""
        if filepath != self.last_model_path:
            self._saved[filepath] = trainer.global_step  # before the save: part of the checkpoint's state
        if self._remote:
            self._save_and_upload(trainer, filepath)
        else:
            super()._save_checkpoint(trainer, filepath)
        if self._retains:
            keep = self._kept_by_rules() | set(self.best_k_models) | {self.best_model_path, self.last_model_path}
            for path in [p for p in self._saved if p not in keep and p != filepath]:
                if self._should_remove_checkpoint(trainer, path, filepath):
                    self._remove_checkpoint(trainer, path)

    def _save_last_checkpoint(self, trainer: pl.Trainer, monitor_candidates: dict[str, Tensor]) -> None:
        """Lightning's, once per step of a fit (the final step's ``last`` is saved before validation and
        ``on_train_end``, which then skip it)."""
        fitting = trainer.state.fn == TrainerFn.FITTING
        if not self.save_last or fitting and self._last_step == trainer.global_step:
            return
        super()._save_last_checkpoint(trainer, monitor_candidates)
        if fitting:
            self._last_step = trainer.global_step

    def _save_now(self, trainer: pl.Trainer) -> None:
        """Save ``last`` (without ``save_last``: a checkpoint named by ``filename``) at this step, and make it
        count on every rank before returning: an asynchronous FSDP save finished, a background upload committed."""
        candidates = self._monitor_candidates(trainer)
        if self.save_last == "link" and self._last_global_step_saved != trainer.global_step:
            self._last_checkpoint_saved = ""  # no checkpoint of this step to link to: last is written in full
        if self.save_last:
            self._save_last_checkpoint(trainer, candidates)
        else:
            self._save_checkpoint(trainer, self.format_checkpoint_name(candidates))
        trainer.lightning_module.parallelizer.finish_pending_save()
        self._finish_uploads(trainer)

    def _save_monitor_checkpoint(self, trainer: pl.Trainer, monitor_candidates: dict[str, Tensor]) -> None:
        """Lightning's; with ``keep_last`` / ``keep_every_n_steps`` a checkpoint that is not among the best is saved
        all the same, for those rules to keep."""
        current = monitor_candidates.get(self.monitor) if self.monitor else None
        if not self._retains or current is None or self.check_monitor_top_k(trainer, current):
            super()._save_monitor_checkpoint(trainer, monitor_candidates)
            return
        self._save_checkpoint(trainer, self._get_metric_interpolated_filepath_name(monitor_candidates, trainer))

    def _remove_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        """Delete a checkpoint no rule keeps (Lightning's top k dropping one that ``keep_last`` still keeps leaves
        it); remotely after the pending uploads are committed."""
        if filepath in self._kept_by_rules():
            return
        self._saved.pop(filepath, None)
        if not self._remote:
            super()._remove_checkpoint(trainer, filepath)
        elif self._pending:
            self._removals.append(filepath)
        elif trainer.is_global_zero:
            delete(filepath)

    def _should_remove_checkpoint(self, trainer: pl.Trainer, previous: str, current: str) -> bool:
        if not self._remote:
            return super()._should_remove_checkpoint(trainer, previous, current)
        return previous != current and previous.startswith(f"{self.dirpath}/")

    def _find_last_checkpoints(self, trainer: pl.Trainer) -> set[str]:
        """``last`` checkpoints of ``dirpath``; of a URL: the newest complete one, downloaded."""
        if self.dirpath is not None and self._remote:
            newest = newest_complete_checkpoint(str(self.dirpath), last_only=True)
            return {str(fetch(newest.url, self._staging_dir(trainer)))} if newest is not None else set()
        if self.dirpath is not None:
            recover_interrupted_replace(Path(self.dirpath))
        return super()._find_last_checkpoints(trainer)

    def _kept_by_rules(self) -> set[str]:
        """The saved checkpoints ``keep_last`` and ``keep_every_n_steps`` keep."""
        by_step = sorted(self._saved.items(), key=lambda item: item[1])
        kept = {path for path, _ in by_step[-self.keep_last :]} if self.keep_last else set()
        if self.keep_every_n_steps:
            first: dict[int, str] = {}
            for path, step in by_step:
                if step >= self.keep_every_n_steps:
                    first.setdefault(step // self.keep_every_n_steps, path)
            kept |= set(first.values())
        return kept

    def _staging_dir(self, trainer: pl.Trainer) -> Path:
        return staging_dir_for(str(self.dirpath), trainer.default_root_dir, self.staging_dir)

    def _save_and_upload(self, trainer: pl.Trainer, filepath: str) -> None:
        """Save to ``<staging>/<name>`` (every rank: ``Trainer.save_checkpoint``), then upload each rank's files
        (in the background, or now) and commit."""
        assert self._staging is not None
        local = self._staging / filepath.rsplit("/", 1)[-1]
        if any(p.local == local or p.step != trainer.global_step for p in self._pending):
            self._finish_uploads(trainer)  # the previous save's uploads count before this one starts
        super()._save_checkpoint(trainer, str(local))
        trainer.lightning_module.parallelizer.finish_pending_save()  # FSDP async_save: the upload needs every file
        token = trainer.strategy.broadcast(new_token() if trainer.is_global_zero else None)
        pending = _Upload(local, filepath, token, trainer.global_step, trainer.global_rank)
        self._pending.append(pending)
        if self.upload_in_background:
            pending.start()
        else:
            pending.run()
            self._finish_uploads(trainer)

    def _finish_uploads(self, trainer: pl.Trainer) -> None:
        """Commit the pending uploads (every rank calls it): wait for this rank's, agree that all ranks' succeeded,
        then rank 0 checks the upload and writes the manifest; then the local copies and the deletions waiting."""
        pending, self._pending = self._pending, []
        for upload_ in pending:
            upload_.wait()
            if trainer.strategy.reduce_boolean_decision(upload_.error is not None, all=False):
                detail = f": {upload_.error}" if upload_.error is not None else " on another rank"
                raise CheckpointError(f"uploading checkpoint {upload_.url} failed{detail}; it does not count")
            error = None
            if trainer.is_global_zero:
                try:
                    commit(upload_.local, upload_.url, upload_.token, upload_.step)
                except CheckpointError as err:
                    error = str(err)
            error = trainer.strategy.broadcast(error)
            if error is not None:
                raise CheckpointError(error)
            if trainer.local_rank == 0:
                _remove_local(upload_.local)
        removals, self._removals = self._removals, []
        for url in removals:
            if trainer.is_global_zero and url not in self._saved and url != self.last_model_path:
                delete(url)


def _ours(trainer: pl.Trainer) -> list[TrainingCheckpoint]:
    """The trainer's ``TrainingCheckpoint`` callbacks, in the order Lightning calls them."""
    return [c for c in trainer.checkpoint_callbacks if isinstance(c, TrainingCheckpoint)]


def _ends_fit(trainer: pl.Trainer) -> bool:
    """Whether the optimizer step that just completed is the fit's last: ``max_steps`` reached, or the last batch
    of the last epoch (an early stop, ``max_time``: not foreseen; ``on_train_end`` saves then)."""
    loop = trainer.fit_loop
    if loop.max_steps != -1 and trainer.global_step >= loop.max_steps:
        return True
    last_epoch = loop.max_epochs not in (None, -1) and trainer.current_epoch + 1 >= loop.max_epochs
    return last_epoch and loop.epoch_loop._num_ready_batches_reached()


@dataclass
class _Upload:
    """One rank's upload of one saved checkpoint, run now or in a background thread."""

    local: Path
    url: str
    token: str
    step: int
    rank: int
    error: BaseException | None = None
    thread: threading.Thread | None = field(default=None, repr=False)

    def run(self) -> None:
        try:
            upload(self.local, self.url, self.token, self.rank)
        except Exception as err:  # reported to every rank when the upload is committed
            self.error = err

    def start(self) -> None:
        self.thread = threading.Thread(target=self.run, name=f"xtl-upload-{self.local.name}", daemon=True)
        self.thread.start()

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()


def _remove_local(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
