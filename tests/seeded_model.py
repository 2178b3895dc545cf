"""A tiny xtl model built from a config mapping, initialized from a seed and saved as an HF directory (for tests that
need a policy or a teacher on disk)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from xtl.model import MODEL_TYPES


def save_seeded_model(config: dict[str, Any], path: Path, seed: int = 0) -> Path:
    """Build the model of ``config`` (``model_type`` and its fields), initialize it from ``seed``, save it to
    ``path`` as an HF directory and return ``path``."""
    fields = dict(config)
    with torch.device("meta"):
        model = MODEL_TYPES[fields.pop("model_type")](**fields).build()
    model.materialize("cpu")
    torch.manual_seed(seed)
    model.init_weights()
    model.save_hf(path)
    return path
