"""The ``xtl`` command: Lightning subcommands (``fit``, ``validate``, ``test``, ``predict``) and the tools.

Examples::

    xtl fit --config configs/tiny_sft.yaml
    xtl fit --config configs/tiny_sft.yaml --config callbacks/eval.yaml --config callbacks/hf_export.yaml
    xtl fit --config runs/tiny_sft/config.yaml --ckpt_path last      # resume exactly
    xtl validate --config configs/tiny_sft.yaml --ckpt_path runs/tiny_sft/checkpoints/last.ckpt
    xtl memory qwen3-8b --gpus-per-node 8 --seq-len 32768
    xtl convert to-fp8 --help
    xtl eval --help                                                  # lm-eval tasks on a checkpoint
    xtl build-cache --config configs/tiny_sft.yaml
"""

from __future__ import annotations

import os
import sys

LIGHTNING_SUBCOMMANDS = ("fit", "validate", "test", "predict")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``xtl`` console script (``argv``: the arguments after ``xtl``).

    Returns:
        The exit code of the subcommand or tool (2 for an unknown command).
    """
    try:
        return _dispatch(list(sys.argv[1:] if argv is None else argv), explicit=argv is not None)
    except BrokenPipeError:  # output piped into a reader that stopped early (``| head``): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _dispatch(argv: list[str], explicit: bool) -> int:
    if argv and argv[0] in LIGHTNING_SUBCOMMANDS:
        from xtl.cli import main as lightning

        return lightning(argv if explicit else None)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    from xtl.tools import TOOLS

    if argv[0] in TOOLS:
        return TOOLS[argv[0]](argv[1:])
    names = ", ".join([*LIGHTNING_SUBCOMMANDS, *TOOLS])
    print(f"xtl: unknown command {argv[0]!r}; commands: {names}", file=sys.stderr)
    return 2
