"""Self-resuming runs: which checkpoint ``--ckpt_path auto`` (or a restarted job) resumes from.

``--ckpt_path auto`` looks in the ``dirpath`` of every checkpoint callback of the config
(:func:`xtl.run_layout.checkpoint_folders`). In each folder it takes the newest intact checkpoint
(:func:`xtl.strategies.checkpoint_io.find_resume_checkpoint`: by modification time, torn or half-written ones
skipped, an interrupted replacement finished first); across folders, the one saved at the highest ``global_step``
(a tie: the folder named first). None anywhere: ``fit`` starts fresh; ``validate``, ``test`` and ``predict`` stop
with an error.

``--ckpt_path last`` is left to Lightning (each checkpoint callback's newest ``last*.ckpt``), but when no checkpoint
folder of the config holds one it is an error naming the folders (Lightning would warn and train from scratch into
the same folder); a config whose checkpoint callbacks name no ``dirpath`` is left to Lightning entirely.

A ``fit`` without ``--ckpt_path`` that a launcher restarted (``TORCHELASTIC_RESTART_COUNT`` > 0: torchrun's
``--max-restarts``; ``SLURM_RESTART_COUNT`` > 0: a requeued SLURM job) behaves as ``--ckpt_path auto``.
``--ckpt_path none`` opts out: the fit starts from scratch even on a restart (and, like any fresh fit, is refused
where checkpoints exist).

Every rank resolves the path on its own, before Lightning starts, from the same folders: no rank of this job can be
saving a checkpoint then (a save needs every rank, and none has joined the process group yet; the launcher has
stopped every process of an earlier attempt before it restarts), and a checkpoint is only named ``*.ckpt`` once it is
complete, so all ranks see the same checkpoints and choose the same one.

A restarted attempt's process group must not meet the keys of the attempt before it: torchrun hands its workers its
own store (``TORCHELASTIC_USE_AGENT_STORE=True``: static rendezvous, and c10d unless
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``) and keeps that store across restarts, so a restarted rank could read the
address a dead rank of the previous attempt published and fail to connect. :func:`attempt_store` gives each attempt
its own prefix in it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from xtl.errors import ConfigError
from xtl.strategies.checkpoint_io import checkpoint_step, find_resume_checkpoint, recover_interrupted_replace
from xtl.strategies.remote_checkpoint import is_url, newest_complete_checkpoint

LAST = "last"  # --ckpt_path last: Lightning's newest last*.ckpt of the checkpoint callbacks; none there is an error
AUTO = "auto"  # --ckpt_path auto: the newest intact checkpoint of the run's checkpoint folders, else a fresh start
NEVER = "none"  # --ckpt_path none: never resume by itself, not even on a restart
_LAST_NAME = re.compile(r"^last(-\d+)?\.ckpt$")  # Lightning's last checkpoint names: last.ckpt, last-v1.ckpt
RESTART_VARIABLES = ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")


@dataclass(frozen=True)
class Resume:
    """What a subcommand's ``--ckpt_path`` resolved to.

    Attributes:
        path: What Lightning gets: the checkpoint to start from, or ``None`` (from scratch).
        automatic: ``auto`` or a restart chose it: the refusal of a fresh fit over earlier checkpoints does not
            apply.
        lines: What rank 0 prints (``xtl: resuming from PATH (step N)`` / ``xtl: no checkpoint in ...; starting
            fresh``, after ``xtl: restart detected ...`` on a restart).
        found: For ``last``: the checkpoint Lightning will take (a local path, or a URL), to check before the run.
    """

    path: str | None
    automatic: bool = False
    lines: tuple[str, ...] = ()
    found: str | None = None


def resolve_ckpt_path(
    ckpt_path: str | None, subcommand: str, folders: list[str], environ: Mapping[str, str] = os.environ
) -> Resume:
    """Resolve ``auto``, ``none`` and a restart's missing ``--ckpt_path``; any other value is left to Lightning.

    Args:
        ckpt_path: The subcommand's ``ckpt_path`` as parsed.
        subcommand: ``fit``, ``validate``, ``test`` or ``predict``.
        folders: The config's checkpoint folders (:func:`xtl.run_layout.checkpoint_folders`).
        environ: The process environment (the launcher's restart count).

    Raises:
        ConfigError: ``auto`` with no checkpoint folder in the config, or (``validate``, ``test``, ``predict``) with
            no intact checkpoint in them; ``last`` with no ``last`` checkpoint in the config's checkpoint folders.
    """
    if ckpt_path == NEVER:
        return Resume(None)
    if ckpt_path == LAST and folders:  # without a dirpath in the config, Lightning's default folder: its to find
        found = newest_last_checkpoint(folders)
        if found is None:
            raise ConfigError(
                f"--ckpt_path last found no last checkpoint in {', '.join(folders)}: pass --ckpt_path auto (the "
                "newest checkpoint, else a fresh start), a checkpoint file or directory, or leave --ckpt_path out to "
                "start fresh"
            )
        return Resume(LAST, found=found)
    restart = restart_variable(environ) if subcommand == "fit" and ckpt_path is None else None
    if ckpt_path != AUTO and restart is None:
        return Resume(ckpt_path)
    lines = (f"xtl: restart detected ({restart}): resuming as --ckpt_path auto (--ckpt_path none opts out)",)
    lines = lines if restart else ()
    if not folders:
        if restart is None:
            raise ConfigError(
                "--ckpt_path auto resumes from the dirpath of the config's checkpoint callbacks, and "
                "trainer.callbacks has none (e.g. xtl.callbacks.TrainingCheckpoint with dirpath: checkpoints): add "
                "one, or pass --ckpt_path with a checkpoint file or directory"
            )
        return Resume(None, True, (*lines, "xtl: no checkpoint folder in the config; starting fresh"))
    best = newest_checkpoint(folders)
    if best is not None:
        said = "resuming from" if subcommand == "fit" else f"{subcommand} uses"
        return Resume(best[0], True, (*lines, f"xtl: {said} {best[0]} (step {best[1]})"))
    where = ", ".join(folders)
    if subcommand != "fit":
        raise ConfigError(
            f"--ckpt_path auto found no intact checkpoint in {where}: train first (xtl fit), or pass --ckpt_path "
            "with a checkpoint file or directory"
        )
    return Resume(None, True, (*lines, f"xtl: no checkpoint in {where}; starting fresh"))


def newest_checkpoint(folders: list[str]) -> tuple[str, int] | None:
    """The checkpoint to resume from and its ``global_step``: each folder's newest intact one, the highest step of
    them (a tie: the folder named first); ``None`` when no folder holds one."""
    best: tuple[str, int] | None = None
    for folder in folders:
        found = find_resume_checkpoint(folder)
        if found is None:
            continue
        step = checkpoint_step(found)
        if best is None or step > best[1]:
            best = (found, step)
    return best


def newest_last_checkpoint(folders: list[str]) -> str | None:
    """The ``last*.ckpt`` that ``--ckpt_path last`` resumes from, as Lightning chooses it (the most recently
    modified of the folders'; of a URL folder: its newest complete one), or ``None`` when no folder holds one. An
    interrupted replacement of ``last`` is finished first."""
    found: list[tuple[float, str]] = []
    for folder in folders:
        if is_url(folder):
            newest = newest_complete_checkpoint(folder, last_only=True)
            if newest is not None:
                found.append((float("inf"), newest.url))
            continue
        directory = Path(folder)
        if not directory.is_dir():
            continue
        recover_interrupted_replace(directory)
        found += [(p.stat().st_mtime, str(p)) for p in directory.glob("last*.ckpt") if _LAST_NAME.match(p.name)]
    return max(found)[1] if found else None


def restart_variable(environ: Mapping[str, str] = os.environ) -> str | None:
    """``NAME=COUNT`` of the launcher variable saying this process is a restarted attempt, or ``None``."""
    for name in RESTART_VARIABLES:
        value = environ.get(name, "").strip()
        if value.isdigit() and int(value) > 0:
            return f"{name}={value}"
    return None


def attempt_store(timeout: timedelta, environ: Mapping[str, str] = os.environ) -> dist.Store | None:
    """The store of this launch attempt's default process group when torchrun shares its own store with the
    workers (``TORCHELASTIC_USE_AGENT_STORE=True``), else ``None`` (the process group makes its own).

    It is torchrun's store under the prefix ``xtl/attempt_<TORCHELASTIC_RESTART_COUNT>``: that count is the same on
    every rank when all agents restart together (one node; or every node's workers failing); a node that joins with
    a fresh agent counts from 0, so there launch with c10d rendezvous and ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
    (each attempt then has a store of its own, and this returns ``None``).
    """
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(environ["MASTER_ADDR"], int(environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"xtl/attempt_{environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
