"""The ``xtl`` command: LightningCLI for ``fit``/``validate``/``test`` plus tool subcommands.

Examples::

    xtl fit --config configs/tiny_sft.yaml
    xtl fit --config configs/tiny_sft.yaml --config callbacks/eval.yaml --config callbacks/hf_export.yaml
    xtl fit --config runs/tiny_sft/version_0/config.yaml --ckpt_path last      # resume exactly
    xtl validate --config configs/tiny_sft.yaml --ckpt_path runs/tiny_sft/checkpoints/last.ckpt
    xtl memory qwen3-8b --dp 8 --seq-len 32768
    xtl convert to-fp8 --help
"""

from __future__ import annotations

import sys
import warnings

from lightning.pytorch.cli import LightningCLI

from xtl.data import XTLDataModule
from xtl.train import LanguageModule

LIGHTNING_SUBCOMMANDS = ("fit", "validate", "test", "predict")

# xtl checkpoints the state after each optimizer step on purpose (one training_step is one optimizer step, and
# resuming from it is exact); Lightning's advice to save pre-optimization state does not apply.
warnings.filterwarnings("ignore", message="Using ModelCheckpoint with manual optimization")


class XTLCLI(LightningCLI):
    """LightningCLI with xtl's module base (``class_path`` picks the family) and data module."""

    def __init__(self, args: list[str] | None = None, run: bool = True) -> None:
        super().__init__(
            LanguageModule,
            XTLDataModule,
            subclass_mode_model=True,
            subclass_mode_data=False,
            save_config_kwargs={"overwrite": True},
            auto_configure_optimizers=False,
            args=args,
            run=run,
        )


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``xtl`` console script."""
    explicit = argv is not None
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] not in LIGHTNING_SUBCOMMANDS and not argv[0].startswith("-"):
        from xtl.tools import TOOLS

        if argv[0] in TOOLS:
            return TOOLS[argv[0]](argv[1:])
        names = ", ".join([*LIGHTNING_SUBCOMMANDS, *TOOLS])
        print(f"xtl: unknown command {argv[0]!r}; commands: {names}", file=sys.stderr)
        return 2
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        if not argv:
            return 2
    XTLCLI(args=argv if explicit else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
