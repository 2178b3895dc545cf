"""Silence third-party messages a user cannot act on (``XTL_DEBUG=1`` shows them all).

Imported by ``xtl/__init__.py``, so every xtl process (the command, notebooks, benchmarks) is quiet:

- torchao logs "Failed to load ... _C_mxfp8 / _C_cutlass_90a" when its optional CUDA extensions do not match the
  machine, and registers enums as pytree constants, which torch's pytree module warns about;
- torch's DTensor notes that gathering an expert-parallel weight whole (for an export or a parity check) takes two
  all-gathers;
- Lightning warns that a rank's list of evaluation dataloaders is empty when a run has no validation sets, that a
  resumed run's checkpoint folder is not empty, that manual optimization checkpoints after the step (xtl's
  design), that evaluation metrics are logged without ``sync_dist`` (they are synced torchmetrics), about torch
  deprecations inside itself, and advertises its cloud logger;
- transformers warns about its own deprecations inside peft.
"""

from __future__ import annotations

import logging
import warnings

from xtl.errors import debug_enabled

# (logger name, text of its records that are dropped)
_LOG_NOISE = (
    ("torchao", "Failed to load"),
    # Lightning's advertisement for its cloud logger
    ("lightning.fabric.utilities.rank_zero", "💡 Tip"),
    ("lightning.pytorch.utilities.rank_zero", "💡 Tip"),
    ("torch.utils._pytree", "register_constant"),
    # gathering an expert-parallel weight whole (export, parity check): the DTensor takes two all-gathers
    ("torch.distributed.tensor._redistribute", "sequential all_gather"),
)
# warnings whose text matches these regular expressions (from its start)
_WARNING_NOISE = (
    r"Total length of `list` across ranks is zero",
    # xtl checkpoints the state after each optimizer step on purpose (one training_step is one optimizer step, and
    # resuming from it is exact): Lightning's advice to save the state before the step does not apply
    r"Using ModelCheckpoint with manual optimization",
    # torch's pytree deprecations inside Lightning and transformers' inside peft
    r".*LeafSpec",
    r".*is_gradient_checkpointing. is deprecated",
    # a resumed run's checkpoint folder is not empty by design (xtl refuses a fresh run into a used one)
    r"Checkpoint directory .* exists and is not empty",
    # LanguageModule cuts context-parallel shares in its own batch hook; the datamodule has none to override
    r"You have overridden `on_before_batch_transfer` in `LightningModule`",
    # evaluation metrics are torchmetrics sums, synced over the ranks before they are logged
    r"It is recommended to use `self.log\('(val|test)/",
)


class _DropContaining(logging.Filter):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def silence_third_party_noise() -> None:
    """Install the filters (idempotent; nothing is filtered when ``XTL_DEBUG`` is set)."""
    if debug_enabled():
        return
    for name, text in _LOG_NOISE:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropContaining) and f.text == text for f in logger.filters):
            logger.addFilter(_DropContaining(text))
    for pattern in _WARNING_NOISE:
        warnings.filterwarnings("ignore", message=pattern)
