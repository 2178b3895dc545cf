"""Streaming against cached training data: tokens per second the training loader delivers on the same corpus.

Usage::

    python benchmarks/data_streaming.py [--rows 50000 --shards 8 --steps 300 --pack 1024 --window 4096 --workers 1
                                         --pairs 5 --warmup 1 --threads 1 --out /tmp/xtl-stream-bench]

Corpus: the tiny SFT set (``tiny:sft_train.jsonl``, 6000 chats) repeated to ``--rows`` rows (copy ``c`` of a row
has `` #c`` appended to its first message, so no two rows are equal), written once as ``--shards`` JSONL shards and
as one file holding the same rows.

Sides, each from a fresh ``XTLDataModule`` (the ``qwen3`` template, the tiny tokenizer, ``pack_max_length=--pack``,
``best_fit``, ``micro_batches_per_step=2``) to its ``--steps``-th step batch, construction and ``setup`` included:

- streaming: ``streaming: true`` on the shards, windows of ``--window`` rows, ``--workers`` tokenize processes: the
  rows are read, tokenized, packed and collated on the fly;
- cached (warm): the single file with its tokenization cache and pack plan already built (a warm start): packs are
  read from the memory-mapped cache and collated, with the loader's ``num_workers=0`` (the CPU default).

Metric: real (non-padding) tokens delivered per second of wall time. Protocol (``benchmarks/_paired.py``):
``--threads`` pinned (torch, OpenMP, the Rust tokenizer), ``--warmup`` untimed pairs, then ``--pairs`` (>= 5) timed
pairs in alternating order; median ratio streaming / cached with its min..max. For context, once and unpaired: the
cold cached path (an empty cache folder: tokenizing the whole corpus with ``--workers`` processes, best-fit packing,
then the same steps).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _paired import add_protocol_args, load_average, pin_threads, print_configs, run_pairs  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line arguments (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=50_000, help="corpus rows (the tiny SFT set repeated)")
    parser.add_argument("--shards", type=int, default=8, help="JSONL shards of the streaming side")
    parser.add_argument("--steps", type=int, default=300, help="step batches per side per pair")
    parser.add_argument("--pack", type=int, default=1024, help="pack_max_length")
    parser.add_argument("--window", type=int, default=4096, help="streaming: rows per packing window")
    parser.add_argument("--workers", type=int, default=1, help="tokenize processes (streaming; the cold build)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/xtl-stream-bench"))
    add_protocol_args(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark and print its figures."""
    args = parse_args(argv)
    _pin(args.threads)
    print(f"load average before: {load_average()}")
    corpus = write_corpus(args.out / "corpus", args.rows, args.shards)
    cache = args.out / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    cold = run_side(cached_module(corpus, cache, args), args.steps)  # builds the cache: the warm side's start
    print_configs(
        streaming={**_common(args), "sources": f"{args.shards} shards, streaming", "window": args.window,
                   "tokenize_workers": args.workers, "steps": args.steps},
        cached={**_common(args), "sources": "1 file, cached (warm)", "num_workers": 0, "steps": args.steps},
    )  # fmt: skip
    print(f"corpus: {args.rows} rows, {sum(p.stat().st_size for p in corpus.glob('shard*')) / 1e6:.1f} MB")

    def side(make: Callable[[], Any]) -> Callable[[], float]:
        def run() -> float:
            return run_side(make(), args.steps).tokens_per_second

        return run

    result = run_pairs(
        side(lambda: streaming_module(corpus, cache, args)),
        side(lambda: cached_module(corpus, cache, args)),
        args.pairs,
        args.warmup,
        metric="real tokens/s",
        higher_is_better=True,
        on_pair=lambda i, a, b: print(f"  pair {i + 1}: {a:.4g} | {b:.4g} | ratio {a / b:.3f}", flush=True),
    )
    print(result.summary("streaming", "cached (warm)"))
    corpus_tokens = int(cold.module.train_split.data.num_tokens.sum())
    print(
        f"context, once: cold cached path (tokenize {args.rows} rows, {corpus_tokens} tokens, with {args.workers} "
        f"process(es), pack, then {args.steps} steps): {cold.seconds:.2f} s, {cold.tokens_per_second:.4g} real "
        f"tokens/s delivered, {corpus_tokens / cold.seconds:.4g} corpus tokens/s"
    )
    print(f"load average after: {load_average()}")


class Delivered:
    """What one side delivered: real tokens, steps and the wall seconds they took (and its module)."""

    def __init__(self, tokens: int, steps: int, seconds: float, module: Any) -> None:
        self.tokens, self.steps, self.seconds, self.module = tokens, steps, seconds, module

    @property
    def tokens_per_second(self) -> float:
        """Real (non-padding) tokens per second."""
        return self.tokens / self.seconds


def run_side(make: Any, steps: int) -> Delivered:
    """Make a module (``make``: a function returning one, or the module), set it up and take ``steps`` step batches
    from its train loader; the time covers all of it."""
    started = time.perf_counter()
    module = make() if callable(make) else make
    with contextlib.redirect_stdout(io.StringIO()):  # the data summary line
        module.setup()
    loader = module.train_dataloader()
    tokens = taken = 0
    try:
        for batch in loader:
            tokens += sum(mb.num_real_tokens for mb in batch)
            taken += 1
            if taken == steps:
                break
    finally:
        if hasattr(loader, "close"):
            loader.close()
    return Delivered(tokens, taken, time.perf_counter() - started, module)


def streaming_module(corpus: Path, cache: Path, args: argparse.Namespace) -> Any:
    """The streaming side's module."""
    from xtl.data import XTLDataModule

    source = {"path": str(corpus / "shard*.jsonl"), "streaming": True}
    return XTLDataModule(
        [source], cache_dir=str(cache), stream_window=args.window, tokenize_workers=args.workers, **_kwargs(args)
    )


def cached_module(corpus: Path, cache: Path, args: argparse.Namespace) -> Any:
    """The cached side's module (the cold build uses it too, on an empty cache folder)."""
    from xtl.data import XTLDataModule

    return XTLDataModule(
        [{"path": str(corpus / "all.jsonl")}], cache_dir=str(cache), tokenize_workers=args.workers, **_kwargs(args)
    )


def write_corpus(folder: Path, rows: int, shards: int) -> Path:
    """The corpus of the module docstring in ``folder`` (kept when it already holds these rows)."""
    from xtl.data import tiny_assets_dir

    marker = folder / "done.json"
    if marker.is_file() and json.loads(marker.read_text()) == {"rows": rows, "shards": shards}:
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    base = [json.loads(line) for line in (tiny_assets_dir() / "sft_train.jsonl").read_text().splitlines()]
    lines = []
    for i in range(rows):
        row = json.loads(json.dumps(base[i % len(base)]))
        copy = i // len(base)
        if copy:
            row["messages"][0]["content"] += f" #{copy}"
        lines.append(json.dumps(row))
    (folder / "all.jsonl").write_text("\n".join(lines) + "\n")
    size = -(-rows // shards)
    for k in range(shards):
        (folder / f"shard{k:03d}.jsonl").write_text("".join(line + "\n" for line in lines[k * size : (k + 1) * size]))
    marker.write_text(json.dumps({"rows": rows, "shards": shards}))
    return folder


def _kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "tokenizer": "tiny:",
        "template": "qwen3",
        "pack_max_length": args.pack,
        "micro_batches_per_step": 2,
        "progress": False,
        "num_workers": 0,
    }


def _common(args: argparse.Namespace) -> dict[str, Any]:
    return {"tokenizer": "tiny:", "template": "qwen3", "pack_max_length": args.pack, "packing": "best_fit",
            "micro_batches_per_step": 2, "threads": args.threads}  # fmt: skip


def _pin(threads: int) -> None:
    import os

    pin_threads(threads)
    os.environ["RAYON_NUM_THREADS"] = str(threads)
    os.environ["TOKENIZERS_PARALLELISM"] = "false" if threads == 1 else "true"


if __name__ == "__main__":
    main()
