"""``xtl convert repack``: re-shard a safetensors directory into HF-standard ``model-i-of-N`` shards.

Example:
    >>> from xtl.tools.repack import repack
    >>> repack("messy_ckpt", "clean_ckpt", max_shard_size="4GiB")  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
from pathlib import Path

from xtl.model.hf import DEFAULT_MAX_SHARD_SIZE, CheckpointReader, ShardWriter, copy_non_tensor_files
from xtl.tools._cli import EXIT_CODES_HELP, EXIT_OK, add_max_shard_size_argument, make_parser, progress, run_cli
from xtl.utils import atomic_directory

SCALE_SUFFIX = "_scale_inv"

EXAMPLES = f"""examples:
  xtl convert repack --source ckpt_engine --output ckpt_hf                # {DEFAULT_MAX_SHARD_SIZE} shards
  xtl convert repack --source ckpt_engine --output ckpt_hf --max-shard-size 500MB
  xtl convert repack --source ckpt_engine --output ckpt_hf --max-shard-size 300KiB

{EXIT_CODES_HELP}"""


def repack(source: str | Path, output: str | Path, max_shard_size: str = DEFAULT_MAX_SHARD_SIZE) -> dict[str, str]:
    """Re-shard ``source`` into ``output`` with standard shard names, a fresh index and copied non-tensor files.

    Tensors are copied unchanged (same dtype, shape and bytes), in the source's shard/header order. A weight and
    its ``<name>_scale_inv`` sibling always land in the same shard. ``output`` is written atomically.

    Args:
        source (str | Path): Source checkpoint directory (any shard names; an index is required for >1 shard).
        output (str | Path): Output directory (replaced if it exists).
        max_shard_size (str): Shard size limit with a unit (``"5GB"``, ``"4GiB"``); a single tensor larger than
            this gets its own shard.

    Returns:
        dict[str, str]: The written weight map (tensor name -> shard file).
    """
    reader = CheckpointReader(source)
    with atomic_directory(output) as tmp:
        weight_map = repack_into(reader, ShardWriter(tmp, max_shard_size))
        copy_non_tensor_files(reader.directory, tmp)
    return weight_map


def repack_into(reader: CheckpointReader, writer: ShardWriter) -> dict[str, str]:
    """Write the tensors of ``reader`` through ``writer`` (standard shards plus index), one group at a time.

    Args:
        reader (CheckpointReader): Source checkpoint.
        writer (ShardWriter): Writer into the output directory.

    Returns:
        dict[str, str]: The written weight map.
    """
    groups = scale_groups(reader)
    with progress(total=sum(len(g) for g in groups), desc="repack") as bar:
        for names in groups:
            writer.add_group((name, reader.load(name)) for name in names)
            bar.update(len(names))
    return writer.finish()


def scale_groups(reader: CheckpointReader) -> list[list[str]]:
    """Group every tensor with its ``_scale_inv`` sibling (if any) so the two are never split across shards.

    Args:
        reader (CheckpointReader): Source checkpoint.

    Returns:
        list[list[str]]: Tensor names per group, in reader order.
    """
    names = reader.keys()
    present = set(names)
    groups = []
    for name in names:
        if name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in present:
            continue  # emitted together with its weight
        groups.append([name] + ([name + SCALE_SUFFIX] if name + SCALE_SUFFIX in present else []))
    return groups


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``repack`` options to ``parser``.

    Args:
        parser (argparse.ArgumentParser): Parser or sub-parser.
    """
    parser.add_argument("--source", required=True, type=Path, help="source checkpoint directory")
    parser.add_argument("--output", required=True, type=Path, help="output directory (replaced atomically)")
    add_max_shard_size_argument(parser, "max shard size")


def run(args: argparse.Namespace) -> int:
    """Run ``repack`` from parsed arguments.

    Args:
        args (argparse.Namespace): Parsed ``add_arguments`` options.

    Returns:
        int: Exit code.
    """
    weight_map = repack(args.source, args.output, args.max_shard_size)
    print(f"wrote {len(weight_map)} tensors in {len(set(weight_map.values()))} shard(s) to {args.output}")
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point of ``xtl convert repack``.

    Args:
        argv (list[str] | None): Arguments (without the program name).

    Returns:
        int: Exit code (0 ok, 2 usage or input error).
    """
    parser = make_parser("xtl convert repack", "Re-shard a safetensors checkpoint into standard shards.", EXAMPLES)
    add_arguments(parser)
    return run_cli(parser, argv, run)


if __name__ == "__main__":
    raise SystemExit(main())
