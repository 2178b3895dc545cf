"""``xtl build-cache``: tokenize the sources of a training config into its cache ahead of training, whole or in shards.

The config is read as ``xtl fit --config ...`` reads it (the same files, in order, and ``--data.*`` / ``--model.*`` /
``--trainer.*`` options), and the data module and the model are built from it, so every entry gets the key training
looks for: training, validation and test sources alike (prompt data is never tokenized). ``--shard i/n`` tokenizes
shard ``i`` of ``n`` of every source into its part (:func:`xtl.data.cache.build_cache_part`): run the ``n`` shards
as ``n`` independent jobs (a SLURM array, ``n`` machines, ``n`` processes of one) on storage they all see; the job
that finishes last assembles the entries. ``--assemble`` assembles them from parts already on disk (a job that ran
last died before assembling), and training assembles a complete set of parts by itself too.

Example:
    xtl build-cache --config configs/tiny_sft.yaml --shard 0/4
"""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import Any

from xtl.tools._cli import EXIT_CODES_HELP, EXIT_OK, EXIT_USAGE, ToolInputError, make_parser, run_cli

EXAMPLES = f"""examples:
  xtl build-cache --config configs/tiny_sft.yaml                          # every entry, whole, on this machine
  xtl build-cache --config configs/tiny_sft.yaml --data.cache_dir /shared/xtl-cache --shard 0/4
  sbatch --array=0-3 --wrap 'xtl build-cache --config configs/qwen3_8b_pretrain.yaml --shard $SLURM_ARRAY_TASK_ID/4'
  xtl build-cache --config configs/tiny_sft.yaml --assemble               # parts all there, entries not yet

The job of the last shard to finish assembles the entries; the others print which parts are still missing.
Options --data.*, --model.* and --trainer.* are passed to the config parser, as to xtl fit.

{EXIT_CODES_HELP}"""

CONFIG_PREFIXES = ("--data.", "--model.", "--trainer.", "--seed_everything")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``xtl build-cache``.

    Args:
        argv: Arguments without the program name.

    Returns:
        0 on success (also for a shard whose entries wait for other shards), 2 on a usage or input error (a bad
        config or shard, missing or foreign parts at ``--assemble``).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides, own = _split_overrides(argv)
    parser = make_parser("xtl build-cache", __doc__.split("\n\n")[0], EXAMPLES)
    parser.add_argument(
        "--config", action="append", required=True, metavar="FILE", help="a config file of xtl fit (repeatable)"
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--shard",
        type=parse_shard,
        metavar="I/N",
        default=None,
        help="tokenize shard I of N (0 <= I < N) of every source into its part; the last shard to finish assembles",
    )
    mode.add_argument(
        "--assemble", action="store_true", help="assemble the entries from the parts of every shard, all on disk"
    )
    return run_cli(parser, own, lambda args: _run(args, overrides))


def parse_shard(text: str) -> tuple[int, int]:
    """``"i/n"`` -> ``(i, n)`` with ``0 <= i < n``.

    Args:
        text (str): The ``--shard`` value.

    Returns:
        tuple[int, int]: Shard index and count.

    Raises:
        argparse.ArgumentTypeError: Not two integers ``i/n`` with ``0 <= i < n``.
    """
    index, slash, count = text.partition("/")
    if not slash or not index.strip().isdigit() or not count.strip().isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not I/N (e.g. 0/4: shard 0 of 4)")
    i, n = int(index), int(count)
    if not 0 <= i < n:
        raise argparse.ArgumentTypeError(f"{text}: shards of {n} are numbered 0..{n - 1}" if n else f"{text}: N >= 1")
    return i, n


def data_module_from_config(args: list[str]) -> Any:
    """The ``XTLDataModule`` of ``xtl fit <args>``, fed the config's model (whether it reads images decides how chat
    sources are tokenized); nothing else of the run (trainer, callbacks, loggers) is built.

    Args:
        args (list[str]): ``--config FILE`` and ``--key value`` options, as given to ``xtl fit``.

    Returns:
        XTLDataModule: The data module.

    Raises:
        ToolInputError: The config cannot be read, or the model or data module cannot be built from it.
    """
    from jsonargparse import Namespace

    from xtl.cli import ParseOnlyCLI, XTLArgumentParser, user_error_message

    XTLArgumentParser.argv = args
    try:
        cli = ParseOnlyCLI(args=args, run=False)
    except SystemExit as err:  # the parser said what is wrong (one line on stderr)
        raise _Exit(err.code if isinstance(err.code, int) else EXIT_USAGE) from None
    parts = Namespace(model=cli.config.model, data=cli.config.data)
    try:
        with warnings.catch_warnings():  # the method Lightning's CLI calls, deprecated (renamed) in jsonargparse 4.49
            warnings.simplefilter("ignore")
            built = cli.parser.instantiate_classes(parts)
    except Exception as exc:
        message = user_error_message(exc)
        if message is None:
            raise
        raise ToolInputError(message) from None
    built.data.feed(built.model)
    return built.data


# ---- private ---------------------------------------------------------------------------------------------------


class _Exit(Exception):
    """The config parser already reported the problem; exit with this code."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def _run(args: argparse.Namespace, overrides: list[str]) -> int:
    from xtl.data.cache import assemble_cache, build_cache, build_cache_part, cache_key

    config_args = [a for name in args.config for a in ("--config", name)] + overrides
    try:
        dm = data_module_from_config(config_args)
    except _Exit as err:
        return err.code
    specs = dm.cached_specs()
    if not specs:
        print("nothing to build: the config's sources are all prompt data (kind: prompt), which is never tokenized")
        return EXIT_OK
    command = "xtl build-cache " + " ".join(config_args)
    done: set[str] = set()
    missing: list[str] = []
    for spec in specs:
        source, fn = dm.cache_inputs(spec)
        name, _ = cache_key(source, fn)
        if name in done:
            continue
        done.add(name)
        if args.shard is not None:
            entry = build_cache_part(source, fn, dm.cache_dir, *args.shard, dm.tokenize_workers, progress=dm.progress)
            if entry is None:
                missing.append(name)
                print(f"{spec.path}: part {args.shard[0]}/{args.shard[1]} of {dm.cache_dir / name} built")
                continue
        elif args.assemble:
            hint = f"build them with `{command} --shard I/N`"
            entry = assemble_cache(source, fn, dm.cache_dir, hint=hint)
        else:
            entry = build_cache(source, fn, dm.cache_dir, dm.tokenize_workers, progress=dm.progress)
        print(f"{spec.path}: {entry.directory} ({len(entry)} samples, {entry.meta['num_tokens']} tokens)")
    if missing:
        print(
            f"{len(missing)} entr{'y' if len(missing) == 1 else 'ies'} wait for other shards: the last shard to "
            f"finish assembles them (or `{command} --assemble` once every part is there; training also assembles them)"
        )
        return EXIT_OK
    dm.prepare_data()  # every entry is complete: load each as training does (images index, pair checks)
    return EXIT_OK


def _split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """Split the config options (``--data.x v``, ``--model.x=v``, ...) from the tool's own."""
    overrides, own = [], []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith(CONFIG_PREFIXES):
            overrides.append(arg)
            if "=" not in arg and i + 1 < len(argv):
                overrides.append(argv[i + 1])
                i += 1
        else:
            own.append(arg)
        i += 1
    return overrides, own


if __name__ == "__main__":
    raise SystemExit(main())
