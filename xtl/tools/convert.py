"""``xtl convert``: checkpoint conversions with sub-commands ``to-fp8``, ``repack`` and ``patch``."""

from __future__ import annotations

import argparse

from xtl.tools import fp8, patch, repack
from xtl.tools._cli import EXIT_CODES_HELP, make_parser, run_cli

SUBCOMMANDS = {"to-fp8": fp8, "repack": repack, "patch": patch}

EXAMPLES = f"""examples:
  xtl convert to-fp8 --source bf16_ckpt --output fp8_ckpt [--reference fp8_ref]
  xtl convert repack --source engine_ckpt --output hf_ckpt --max-shard-size 4GiB
  xtl convert patch --base run_a --extra run_b --out merged [--dry-run] [--hardlink]

Run `xtl convert <sub-command> --help` for its options.
{EXIT_CODES_HELP}"""


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point of ``xtl convert``.

    Args:
        argv (list[str] | None): Arguments (without the program name), starting with the sub-command.

    Returns:
        int: Exit code of the sub-command (0 ok, 1 check failed, 2 usage or input error).
    """
    parser = make_parser("xtl convert", "Convert, re-shard or merge safetensors checkpoints.", EXAMPLES)
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="{to-fp8,repack,patch}")
    for name, module in SUBCOMMANDS.items():
        sub = subparsers.add_parser(
            name,
            help=(module.__doc__ or "").splitlines()[0],
            description=(module.__doc__ or "").splitlines()[0],
            epilog=module.EXAMPLES,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(sub)
    return run_cli(parser, argv, lambda args: SUBCOMMANDS[args.command].run(args))


if __name__ == "__main__":
    raise SystemExit(main())
