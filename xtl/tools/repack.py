"""``xtl convert repack``: re-shard a safetensors directory into HF-standard ``model-i-of-N`` shards.

Example:
    >>> from xtl.tools.repack import repack
    >>> repack("messy_ckpt", "clean_ckpt", max_shard_bytes=4 * 1024**3)  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
from pathlib import Path

from xtl.tools._cli import EXIT_CODES_HELP, EXIT_OK, make_parser, run_cli
from xtl.tools._st import GIB, CheckpointReader, copy_aux_files, parse_size, plan_shards, write_index, write_shards
from xtl.utils import atomic_directory

SCALE_SUFFIX = "_scale_inv"

EXAMPLES = f"""examples:
  xtl convert repack --source ckpt_engine --output ckpt_hf                # 4 GiB shards
  xtl convert repack --source ckpt_engine --output ckpt_hf --shard-size 0.5
  xtl convert repack --source ckpt_engine --output ckpt_hf --shard-size 300KiB

{EXIT_CODES_HELP}"""


def repack(source: str | Path, output: str | Path, max_shard_bytes: int = 4 * GIB) -> dict[str, str]:
    """Re-shard ``source`` into ``output`` with standard shard names, a fresh index and copied non-tensor files.

    Tensors are copied unchanged (same dtype, shape and bytes), in the source's shard/header order. A weight and
    its ``<name>_scale_inv`` sibling always land in the same shard. ``output`` is written atomically.

    Args:
        source (str | Path): Source checkpoint directory (any shard names; an index is required for >1 shard).
        output (str | Path): Output directory (replaced if it exists).
        max_shard_bytes (int): Shard size limit in bytes; a single tensor larger than this gets its own shard.

    Returns:
        dict[str, str]: The written weight map (tensor name -> shard file).
    """
    reader = CheckpointReader(source)
    with atomic_directory(output) as tmp:
        weight_map = repack_into(reader, tmp, max_shard_bytes)
        copy_aux_files(reader.directory, tmp)
    return weight_map


def repack_into(reader: CheckpointReader, out_dir: Path, max_shard_bytes: int) -> dict[str, str]:
    """Write the tensors of ``reader`` into standard shards plus index inside an existing ``out_dir``.

    Args:
        reader (CheckpointReader): Source checkpoint.
        out_dir (Path): Existing output directory.
        max_shard_bytes (int): Shard size limit in bytes.

    Returns:
        dict[str, str]: The written weight map.
    """
    plan = plan_shards(scale_groups(reader), max_shard_bytes)
    weight_map = write_shards(out_dir, plan, reader.get, 1, len(plan), "repack")
    write_index(out_dir, weight_map, reader.total_size())
    return weight_map


def scale_groups(reader: CheckpointReader) -> list[tuple[list[str], int]]:
    """Group every tensor with its ``_scale_inv`` sibling (if any) so the two are never split across shards.

    Args:
        reader (CheckpointReader): Source checkpoint.

    Returns:
        list[tuple[list[str], int]]: ``(names, nbytes)`` per group, in reader order.
    """
    names = reader.names
    present = set(names)
    groups = []
    for name in names:
        if name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in present:
            continue  # emitted together with its weight
        members = [name] + ([name + SCALE_SUFFIX] if name + SCALE_SUFFIX in present else [])
        groups.append((members, sum(reader.nbytes(m) for m in members)))
    return groups


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``repack`` options to ``parser``.

    Args:
        parser (argparse.ArgumentParser): Parser or sub-parser.
    """
    parser.add_argument("--source", required=True, type=Path, help="source checkpoint directory")
    parser.add_argument("--output", required=True, type=Path, help="output directory (replaced atomically)")
    parser.add_argument(
        "--shard-size", default="4", help="max shard size: GiB as a number (fractions ok) or with a suffix (500MB)"
    )


def run(args: argparse.Namespace) -> int:
    """Run ``repack`` from parsed arguments.

    Args:
        args (argparse.Namespace): Parsed ``add_arguments`` options.

    Returns:
        int: Exit code.
    """
    weight_map = repack(args.source, args.output, parse_size(args.shard_size))
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
