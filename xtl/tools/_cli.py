"""Shared command-line plumbing: exit codes, error type and the ``main`` wrapper every tool uses."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2


class ToolInputError(Exception):
    """Raised for a usage or input problem (missing file, bad index, mismatched names); maps to exit code 2."""


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
    except (ToolInputError, FileNotFoundError, FileExistsError, NotADirectoryError) as exc:
        print(f"error: {exc}", file=sys.stderr)
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


EXIT_CODES_HELP = "exit codes: 0 ok, 1 check failed / differences found, 2 usage or input error"
