"""Atomic single-file checkpoints for non-distributed runs."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.plugins.io import TorchCheckpointIO


class AtomicCheckpointIO(TorchCheckpointIO):
    """``torch.save`` to a temporary file beside the target, then ``os.replace``: a crash never leaves a torn file."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None) -> None:
        """Save ``checkpoint`` to ``path`` atomically."""
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO does not take storage_options")
        path = Path(path)
        get_filesystem(path).makedirs(str(path.parent), exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            torch.save(checkpoint, tmp)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
