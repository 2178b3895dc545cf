"""``xtl convert patch``: ``out = base ∪ (extra \\ base)`` at tensor level; base wins on overlap.

Base shards are re-emitted (copied, or hard-linked with ``hardlink=True``) under new standard names
``model-i-of-N``; the tensors only ``extra`` has are packed into new shards appended after them; base's
non-tensor files (config, tokenizer, code, README, sub-directories) are copied; ``extra``'s are not.

Example:
    >>> from xtl.tools.patch import diff_checkpoints, patch_checkpoint
    >>> print(diff_checkpoints("base", "extra").summary())  # doctest: +SKIP
    >>> patch_checkpoint("base", "extra", "merged")  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from xtl.model.hf import DEFAULT_MAX_SHARD_SIZE, CheckpointReader, ShardWriter, copy_non_tensor_files
from xtl.tools._cli import EXIT_CODES_HELP, EXIT_OK, add_max_shard_size_argument, make_parser, progress, run_cli
from xtl.utils import atomic_directory

EXAMPLES = f"""examples:
  xtl convert patch --base run_a --extra run_b --out merged --dry-run   # show the diff summary only
  xtl convert patch --base run_a --extra run_b --out merged
  xtl convert patch --base run_a --extra run_b --out merged --hardlink --max-shard-size 2GB

{EXIT_CODES_HELP}"""


@dataclass
class PatchPlan:
    """Tensor-level diff of two checkpoints."""

    in_base: int
    in_extra: int
    added: list[str]
    dropped: list[str]

    def summary(self) -> str:
        """Return the diff summary printed before writing.

        Returns:
            str: One line per count.
        """
        return (
            f"tensors in base:  {self.in_base}\n"
            f"tensors in extra: {self.in_extra}\n"
            f"added from extra (extra-only): {len(self.added)}\n"
            f"dropped from extra (overlap, base wins): {len(self.dropped)}"
        )


def diff_checkpoints(base: str | Path, extra: str | Path) -> PatchPlan:
    """Compare the tensor names of two checkpoints.

    Args:
        base (str | Path): Base checkpoint directory.
        extra (str | Path): Extra checkpoint directory.

    Returns:
        PatchPlan: Counts plus the added and dropped names (sorted).
    """
    base_names = CheckpointReader(base).weight_map.keys()
    extra_names = CheckpointReader(extra).weight_map.keys()
    return PatchPlan(
        in_base=len(base_names),
        in_extra=len(extra_names),
        added=sorted(extra_names - base_names),
        dropped=sorted(extra_names & base_names),
    )


def patch_checkpoint(
    base: str | Path,
    extra: str | Path,
    out: str | Path,
    max_shard_size: str = DEFAULT_MAX_SHARD_SIZE,
    hardlink: bool = False,
) -> dict[str, str]:
    """Write ``out = base ∪ (extra \\ base)`` atomically.

    Args:
        base (str | Path): Base checkpoint directory (wins on overlap; its non-tensor files are copied).
        extra (str | Path): Checkpoint providing the extra-only tensors.
        out (str | Path): Output directory (replaced if it exists).
        max_shard_size (str): Size limit with a unit (``"5GB"``) of the new shards holding extra-only tensors.
        hardlink (bool): Hard-link base shards instead of copying them (falls back to a copy across devices).

    Returns:
        dict[str, str]: The written weight map.
    """
    base_reader, extra_reader = CheckpointReader(base), CheckpointReader(extra)
    plan = diff_checkpoints(base, extra)
    with atomic_directory(out) as tmp:
        writer = ShardWriter(tmp, max_shard_size)
        for shard in base_reader.shards:
            names = [n for n, s in base_reader.weight_map.items() if s == shard]
            size = sum(base_reader.nbytes(n) for n in names)
            writer.add_file(base_reader.directory / shard, names, size, hardlink)
        with progress(total=len(plan.added), desc="patch") as bar:
            for name in plan.added:
                writer.add(name, extra_reader.load(name))
                bar.update(1)
        weight_map = writer.finish()
        copy_non_tensor_files(base_reader.directory, tmp)
    return weight_map


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``patch`` options to ``parser``.

    Args:
        parser (argparse.ArgumentParser): Parser or sub-parser.
    """
    parser.add_argument("--base", required=True, type=Path, help="base checkpoint (wins on overlap)")
    parser.add_argument("--extra", required=True, type=Path, help="checkpoint providing extra-only tensors")
    parser.add_argument("--out", required=True, type=Path, help="output directory (replaced atomically)")
    add_max_shard_size_argument(parser, "limit for the new shards")
    parser.add_argument("--hardlink", action="store_true", help="hard-link base shards instead of copying")
    parser.add_argument("--dry-run", action="store_true", help="print the diff summary, write nothing")


def run(args: argparse.Namespace) -> int:
    """Run ``patch`` from parsed arguments.

    Args:
        args (argparse.Namespace): Parsed ``add_arguments`` options.

    Returns:
        int: Exit code.
    """
    plan = diff_checkpoints(args.base, args.extra)
    print(plan.summary())
    if args.dry_run:
        print("dry run: nothing written")
        return EXIT_OK
    weight_map = patch_checkpoint(args.base, args.extra, args.out, args.max_shard_size, args.hardlink)
    print(f"wrote {len(weight_map)} tensors in {len(set(weight_map.values()))} shard(s) to {args.out}")
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point of ``xtl convert patch``.

    Args:
        argv (list[str] | None): Arguments (without the program name).

    Returns:
        int: Exit code (0 ok, 2 usage or input error).
    """
    parser = make_parser("xtl convert patch", "Merge extra-only tensors into a base checkpoint.", EXAMPLES)
    add_arguments(parser)
    return run_cli(parser, argv, run)


if __name__ == "__main__":
    raise SystemExit(main())
