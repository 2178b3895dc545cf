"""``xtl convert to-fp8``: per-block FP8 (``float8_e4m3fn``) quantization of the large linear weights of a checkpoint.

Each chosen weight ``W`` (2D ``(out, in)``, or 3D ``(experts, d0, d1)`` quantized expert by expert) is split into
128x128 blocks. Every block gets a power-of-two scale ``s >= amax(block) / 448`` (``ue8m0`` format) and is stored as
``saturate(W / s)`` in ``float8_e4m3fn``; the scales go to ``<name>_scale_inv`` (``float32``, shape
``(ceil(d0/128), ceil(d1/128))``, stacked per expert for 3D) in the same shard, so ``W ~= fp8.float() * scale_inv``
block-wise, which is the layout vLLM and SGLang load for block-quantized FP8.

The tensors to quantize come either from a reference FP8 checkpoint (every ``X_scale_inv`` it stores marks ``X``) or
from :data:`QUANT_PATTERNS`. The dequantization error is bounded element-wise by ``2**-4 * |w| + 2**-10 * s``: three
mantissa bits give a relative rounding error of at most 2**-4 for normal fp8 values, and subnormals (below 2**-6) are
spaced 2**-9 apart; no value saturates because ``s >= amax / 448``.

Quantization and the ``quantization_config`` block come from :mod:`xtl.model.hf.fp8`, the functions
``save_hf(fp8="blockwise")`` uses too, so both write the same bytes for the same weights.

Example:
    >>> from xtl.tools.fp8 import convert_to_fp8
    >>> report = convert_to_fp8("bf16_ckpt", "fp8_ckpt")  # doctest: +SKIP
    >>> report.max_rel_error  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from xtl.model.hf import (
    DEFAULT_MAX_SHARD_SIZE,
    INDEX_NAME,
    QUANT_PATTERNS,
    SCALE_SUFFIX,
    CheckpointReader,
    ShardWriter,
    block_fp8_config,
    copy_non_tensor_files,
    dequantize_blockwise,
    is_standard_layout,
    quantizable,
    quantize_blockwise,
    save_shard,
    write_index,
)
from xtl.model.hf.fp8 import BLOCK, FP8_DTYPE, FP8_MAX
from xtl.tools._cli import (
    EXIT_CODES_HELP,
    EXIT_FAILED,
    EXIT_OK,
    ToolInputError,
    add_max_shard_size_argument,
    make_parser,
    progress,
    run_cli,
)
from xtl.tools.repack import repack_into
from xtl.utils import atomic_directory

__all__ = [
    "BLOCK",
    "FP8_DTYPE",
    "FP8_MAX",
    "QUANT_PATTERNS",
    "Fp8Report",
    "convert_to_fp8",
    "dequantize_blockwise",
    "error_bound",
    "main",
    "quantization_config",
    "quantize_blockwise",
    "reference_quantized_names",
    "select_tensors",
    "should_quantize",
]

_FLOAT_DTYPES = {"BF16", "F16", "F32"}

EXAMPLES = f"""examples:
  xtl convert to-fp8 --source bf16_ckpt --output fp8_ckpt                       # default rule set
  xtl convert to-fp8 --source bf16_ckpt --output fp8_ckpt --reference fp8_ref    # same tensors as fp8_ref
  xtl convert to-fp8 --source engine_ckpt --output fp8_ckpt --no-repack          # keep source shard names
  xtl convert to-fp8 --source bf16_ckpt --output fp8_ckpt --dry-run              # list decisions only

Non-standard source shard names (anything but model.safetensors / model-i-of-N) are repacked into standard
shards of --max-shard-size unless --no-repack is given.

{EXIT_CODES_HELP} (1: a dequantized weight broke the fp8 error bound)"""


@dataclass
class Fp8Report:
    """Outcome of :func:`convert_to_fp8`."""

    quantized: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    max_abs_error: float = 0.0
    max_rel_error: float = 0.0
    bound_violations: list[str] = field(default_factory=list)
    repacked: bool = False

    def summary(self) -> str:
        """Return a human-readable summary.

        Returns:
            str: Multi-line summary.
        """
        return (
            f"quantized {len(self.quantized)} tensors, kept {len(self.kept)} in their dtype"
            f"{' (repacked into standard shards)' if self.repacked else ''}\n"
            f"round trip: max |w - dequant(w)| = {self.max_abs_error:.3e}, "
            f"max ||w - dequant(w)|| / ||w|| = {self.max_rel_error:.3e}, "
            f"bound violations: {len(self.bound_violations)}"
        )


def should_quantize(name: str, shape: tuple[int, ...], dtype: str) -> bool:
    """Default rule: quantize floating 2D/3D tensors whose name matches :data:`QUANT_PATTERNS` (the rule of
    ``save_hf(fp8="blockwise")``, :func:`xtl.model.hf.quantizable`).

    Args:
        name (str): Tensor name.
        shape (tuple[int, ...]): Tensor shape.
        dtype (str): safetensors dtype string.

    Returns:
        bool: True to quantize.
    """
    return dtype in _FLOAT_DTYPES and quantizable(name, shape)


def reference_quantized_names(reference: str | Path) -> set[str]:
    """Names quantized in a reference FP8 checkpoint: ``X`` for every ``X_scale_inv`` in its index.

    Args:
        reference (str | Path): Reference FP8 checkpoint directory.

    Returns:
        set[str]: Tensor names.
    """
    names = CheckpointReader(reference).weight_map
    return {n[: -len(SCALE_SUFFIX)] for n in names if n.endswith(SCALE_SUFFIX)}


def error_bound(weight: torch.Tensor, scale_inv: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """Element-wise bound on ``|w - dequant(quant(w))|``: ``2**-4 * |w| + 2**-10 * s`` (see module docstring).

    Args:
        weight (torch.Tensor): Original weight.
        scale_inv (torch.Tensor): Its per-block scales.
        block (int): Block edge.

    Returns:
        torch.Tensor: float32 bound, same shape as ``weight``.
    """
    rows, cols = weight.shape[-2:]
    scale = scale_inv.repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)[..., :rows, :cols]
    return weight.float().abs() * 2.0**-4 + scale * 2.0**-10


def convert_to_fp8(
    source: str | Path,
    output: str | Path,
    reference: str | Path | None = None,
    repack: bool | None = None,
    max_shard_size: str = DEFAULT_MAX_SHARD_SIZE,
) -> Fp8Report:
    """Quantize a checkpoint to block FP8 and write it, with ``quantization_config`` in ``config.json``.

    Args:
        source (str | Path): bf16/fp16/fp32 HF checkpoint directory with a ``config.json``.
        output (str | Path): Output directory (written atomically, replaced if it exists).
        reference (str | Path | None): FP8 checkpoint whose quantized-tensor set is replicated exactly.
        repack (bool | None): Repack into standard shards; ``None`` does so only for non-standard source names.
        max_shard_size (str): Shard size limit with a unit (``"5GB"``, ``"4GiB"``) when repacking.

    Returns:
        Fp8Report: Decisions and round-trip error.
    """
    reader = CheckpointReader(source)
    config_path = reader.directory / "config.json"
    if not config_path.is_file():
        raise ToolInputError(f"{config_path} not found: to-fp8 writes quantization_config into it")
    chosen = select_tensors(reader, reference)
    report = Fp8Report(quantized=sorted(chosen), kept=sorted(set(reader.weight_map) - chosen))
    report.repacked = (not is_standard_layout(reader.shards)) if repack is None else repack
    with atomic_directory(output) as tmp:
        if report.repacked:
            writer = ShardWriter(tmp, max_shard_size)  # a bad size fails here, before any quantization
            with tempfile.TemporaryDirectory(prefix=".fp8-stage-", dir=tmp.parent) as stage:
                _quantize_shards(reader, chosen, Path(stage), report)
                repack_into(CheckpointReader(stage), writer)
        else:
            _quantize_shards(reader, chosen, tmp, report)
        copy_non_tensor_files(reader.directory, tmp)
        config = json.loads(config_path.read_text())
        config["quantization_config"] = quantization_config(reader, chosen)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return report


def select_tensors(reader: CheckpointReader, reference: str | Path | None = None) -> set[str]:
    """Choose the tensors to quantize: the reference's set (checked against the source) or the default rules.

    Args:
        reader (CheckpointReader): Source checkpoint.
        reference (str | Path | None): Optional reference FP8 checkpoint.

    Returns:
        set[str]: Names to quantize.
    """
    if reference is None:
        return {n for n in reader.weight_map if should_quantize(n, reader.info(n)[1], reader.info(n)[0])}
    chosen = reference_quantized_names(reference)
    missing = sorted(chosen - reader.weight_map.keys())
    if missing:
        raise ToolInputError(
            f"{len(missing)} tensor(s) quantized in the reference are absent from the source, e.g. {missing[0]}"
        )
    bad = sorted(n for n in chosen if len(reader.info(n)[1]) not in (2, 3) or reader.info(n)[0] not in _FLOAT_DTYPES)
    if bad:
        raise ToolInputError(
            f"reference marks {bad[0]} {reader.info(bad[0])} for fp8; only 2D/3D float tensors can be"
        )
    return chosen


def quantization_config(reader: CheckpointReader, chosen: set[str]) -> dict:
    """Build the ``quantization_config`` block, listing every unquantized matrix module explicitly.

    Args:
        reader (CheckpointReader): Source checkpoint.
        chosen (set[str]): Quantized tensor names.

    Returns:
        dict: ``quant_method=fp8``, ``weight_block_size=[128, 128]``, ``scale_fmt=ue8m0``, ...
    """
    return block_fp8_config(n for n in reader.weight_map if n not in chosen and len(reader.info(n)[1]) >= 2)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``to-fp8`` options to ``parser``.

    Args:
        parser (argparse.ArgumentParser): Parser or sub-parser.
    """
    parser.add_argument("--source", required=True, type=Path, help="bf16/fp16 checkpoint directory")
    parser.add_argument("--output", required=True, type=Path, help="output directory (replaced atomically)")
    parser.add_argument("--reference", type=Path, help="fp8 checkpoint whose quantized-tensor set is replicated")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--repack", dest="repack", action="store_true", default=None, help="always repack shards")
    group.add_argument("--no-repack", dest="repack", action="store_false", help="keep the source shard names")
    add_max_shard_size_argument(parser, "shard limit when repacking")
    parser.add_argument("--dry-run", action="store_true", help="print the quantization decisions, write nothing")


def run(args: argparse.Namespace) -> int:
    """Run ``to-fp8`` from parsed arguments.

    Args:
        args (argparse.Namespace): Parsed ``add_arguments`` options.

    Returns:
        int: Exit code.
    """
    if args.dry_run:
        reader = CheckpointReader(args.source)
        chosen = select_tensors(reader, args.reference)
        for name in sorted(reader.weight_map):
            print(f"{'fp8 ' if name in chosen else 'keep'}  {name}  {list(reader.info(name)[1])}")
        print(f"{len(chosen)} of {len(reader.weight_map)} tensors would be quantized")
        return EXIT_OK
    report = convert_to_fp8(args.source, args.output, args.reference, args.repack, args.max_shard_size)
    print(report.summary())
    for name in report.bound_violations:
        print(f"bound violated: {name}")
    print(f"wrote {args.output} ({INDEX_NAME}, config.json with quantization_config)")
    return EXIT_FAILED if report.bound_violations else EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point of ``xtl convert to-fp8``.

    Args:
        argv (list[str] | None): Arguments (without the program name).

    Returns:
        int: Exit code (0 ok, 1 error bound violated, 2 usage or input error).
    """
    parser = make_parser("xtl convert to-fp8", "Quantize large linear weights to 128x128 block FP8.", EXAMPLES)
    add_arguments(parser)
    return run_cli(parser, argv, run)


def _quantize_shards(reader: CheckpointReader, chosen: set[str], out_dir: Path, report: Fp8Report) -> None:
    weight_map: dict[str, str] = {}
    total = 0
    with progress(total=len(reader.weight_map), desc="to-fp8") as bar:
        for shard in reader.shards:
            tensors: dict[str, torch.Tensor] = {}
            for name, tensor in reader.iter_shard(shard):
                if name in chosen:
                    q, scale = quantize_blockwise(tensor)
                    _record_error(name, tensor, q, scale, report)
                    tensors[name], tensors[name + SCALE_SUFFIX] = q, scale
                else:
                    tensors[name] = tensor
                bar.update(1)
            save_shard(out_dir / shard, tensors)
            weight_map.update(dict.fromkeys(tensors, shard))
            total += sum(t.numel() * t.element_size() for t in tensors.values())
            del tensors
    write_index(out_dir, weight_map, total)


def _record_error(name: str, weight: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, report: Fp8Report) -> None:
    diff = (weight.float() - dequantize_blockwise(q, scale)).abs()
    report.max_abs_error = max(report.max_abs_error, float(diff.max()) if diff.numel() else 0.0)
    norm = float(weight.float().norm())
    if norm > 0:
        report.max_rel_error = max(report.max_rel_error, float(diff.norm()) / norm)
    if bool((diff > error_bound(weight, scale)).any()):
        report.bound_violations.append(name)


if __name__ == "__main__":
    raise SystemExit(main())
