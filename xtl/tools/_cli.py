"""Shared command-line plumbing: exit codes, error type, the ``main`` wrapper, the shard-size option, progress bars."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from tqdm import tqdm

from xtl.errors import UserError, debug_enabled, short_message

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2


class ToolInputError(UserError):
    """Raised for a usage or input problem (missing file, bad index, mismatched names); maps to exit code 2.

    Every :class:`xtl.errors.UserError` (the checkpoint package's ``CheckpointError`` included) maps to 2 as well.
    """


def run_cli(
    parser: argparse.ArgumentParser, argv: list[str] | None, handler: Callable[[argparse.Namespace], int]
) -> int:
    """Parse ``argv`` with ``parser`` and run ``handler``, turning errors into the documented exit codes.

    Args:
        parser (argparse.ArgumentParser): The tool's parser.
        argv (list[str] | None): Arguments without the program name; ``None`` reads ``sys.argv[1:]``.
        handler (Callable[[argparse.Namespace], int]): Runs the tool and returns its exit code.

    Returns:
        int: 0 on success, 1 when a check failed or differences were found, 2 on a usage or input error.
    """
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 0 for --help and 2 for bad usage
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    try:
        return handler(args)
    except (UserError, FileNotFoundError, FileExistsError, NotADirectoryError) as exc:
        if debug_enabled():
            raise
        print(f"error: {short_message(exc)}", file=sys.stderr)
        return EXIT_USAGE


def make_parser(prog: str, description: str, epilog: str) -> argparse.ArgumentParser:
    """Build an ``ArgumentParser`` whose help keeps the examples in ``epilog`` verbatim.

    Args:
        prog (str): Program name shown in usage, e.g. ``"xtl memory"``.
        description (str): One-paragraph description.
        epilog (str): Examples and exit codes.

    Returns:
        argparse.ArgumentParser: The parser.
    """
    return argparse.ArgumentParser(
        prog=prog, description=description, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def add_max_shard_size_argument(parser: argparse.ArgumentParser, what: str) -> None:
    """Add ``--max-shard-size`` (alias ``--shard-size``): a size with a unit, default ``5GB`` like ``save_hf``.

    The value is checked while parsing (a bare number is a usage error) and kept as text.

    Args:
        parser (argparse.ArgumentParser): Parser or sub-parser.
        what (str): What the limit applies to, for the help text.
    """
    from xtl.model.hf.format import DEFAULT_MAX_SHARD_SIZE

    parser.add_argument(
        "--max-shard-size",
        "--shard-size",
        dest="max_shard_size",
        metavar="SIZE",
        type=_shard_size,
        default=DEFAULT_MAX_SHARD_SIZE,
        help=f"{what}, with a unit: 5GB, 500MB, 4GiB, 300KiB (default {DEFAULT_MAX_SHARD_SIZE})",
    )


def progress(total: int, desc: str) -> tqdm:
    """Return a tqdm progress bar on stderr (silent when stderr is not a terminal unless XTL_PROGRESS=1).

    Args:
        total (int): Number of steps.
        desc (str): Label.

    Returns:
        tqdm: Progress bar usable as a context manager.
    """
    show = sys.stderr.isatty() or os.environ.get("XTL_PROGRESS", "0") == "1"
    return tqdm(total=total, desc=desc, unit="tensor", disable=not show, file=sys.stderr)


EXIT_CODES_HELP = "exit codes: 0 ok, 1 check failed / differences found, 2 usage or input error"


def _shard_size(text: str) -> str:
    from xtl.model.hf.format import parse_size

    try:
        parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err
    return text
