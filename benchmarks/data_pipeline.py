"""Data-pipeline benchmarks: cold build against ``datasets.map``, warm start at scale, pack reads, loader workers.

Usage::

    python benchmarks/data_pipeline.py [--samples 10000 --workers 2 --pack 4096 --pairs 5 --warmup 1 --threads 1]
    python benchmarks/data_pipeline.py --warm-start 1000000 [--pack 4096 --pairs 5]
    python benchmarks/data_pipeline.py --pack-read [--samples 50000 --pack 4096 --reads 400]
    python benchmarks/data_pipeline.py --loader [--loader-steps 300 --loader-pack 512 --step-ms 0]

Modes:

1. Cold build (default). A synthetic chat SFT corpus with a realistic length mix (70% short single-turn, 30%
   multi-turn, log-normal lengths, a long tail past the pack length) goes from JSONL to ready training data on
   both sides, from a cold cache every time:

   - xtl: ``build_cache`` (``--workers`` processes, the ``qwen3`` template with its assistant loss mask, the
     embedded tiny tokenizer) then mixing and best-fit packing into packs of ``--pack`` tokens (overlong samples
     truncated to the pack), as ``XTLDataModule`` does on a cold start;
   - peer: ``datasets.load_dataset("json")`` (JSON -> Arrow) then ``Dataset.map(batched=True,
     num_proc=--workers)`` over ``tokenizer.apply_chat_template(batch_of_conversations, tokenize=True,
     truncation=True, max_length=--pack)``: the batched, multi-process recipe with the same tokenizer, the same
     number of processes and the same truncation; it computes no loss mask and does not pack.

   Both configurations, every pair, the median ratio xtl/peer of wall time and of CPU time (this process and its
   children; steadier than wall time on a shared machine) with its min..max, and the tokens each side truncated
   are printed; the ids of both sides are compared on the first rows. Then the fill ratio of best-fit
   packing against pad-to-longest batches of ``--batch`` samples.
2. ``--warm-start N``: builds (once; kept under ``--out``) a cache of N short synthetic chats, then times the warm
   start of a fresh process (``XTLDataModule`` construction, ``setup`` and the first step batch; imports reported
   apart) paired with the same start after deleting the stored pack plan and the remembered source hashes (what
   every warm start did before they were stored: a full hash of the source and best-fit packing again).
3. ``--pack-read``: reading packs of many short samples with one gather (``PackedDataset``) against the former
   per-segment reader (one slice, dtype conversion and label ``where`` per segment, then a concatenation).
4. ``--loader``: iterating the training loader (tiny SFT data, packs of ``--loader-pack`` tokens, two per step,
   creation included) with ``num_workers=0`` against two persistent workers, optionally with ``--step-ms`` of
   compute per step in the main process.

Protocol (``benchmarks/_paired.py``): ``--threads`` (default 1) pinned for torch and OpenMP, for the Rust tokenizer
(``RAYON_NUM_THREADS``, and ``TOKENIZERS_PARALLELISM=false`` at 1 thread) and for Arrow; ``--warmup`` untimed
pairs, then ``--pairs`` (>= 5) timed pairs in alternating order; medians and the min..max of the ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _paired import (  # noqa: E402
    PairedResult,
    add_protocol_args,
    load_average,
    pin_threads,
    print_configs,
    run_pairs,
)

WORDS = (
    "the model data token train pack batch loss rank step cache value query answer think result layer weight "
    "apple river stone cloud tiger lemon pencil garden rocket candle mirror forest window silver planet orange "
    "bridge winter summer dragon castle butter marble rabbit violin coffee desert island jungle meadow ocean"
).split()

WARM_START = """
import json, sys, time
t0 = time.perf_counter()
from xtl.data import SourceSpec, XTLDataModule
t1 = time.perf_counter()
dm = XTLDataModule([SourceSpec(sys.argv[1])], tokenizer="tiny:", pack_max_length=int(sys.argv[3]),
                   micro_batches_per_step=1, cache_dir=sys.argv[2], progress=False, num_workers=0)
dm.setup("fit")
batch = next(iter(dm.train_dataloader()))
t2 = time.perf_counter()
print(json.dumps({"imports": t1 - t0, "start": t2 - t1, "packs": len(dm.train_split.plan)}))
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line arguments (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--warm-start", type=int, metavar="N", help="time warm starts on a cache of N short chats")
    mode.add_argument("--pack-read", action="store_true", help="one-gather pack reads vs per-segment reads")
    mode.add_argument("--loader", action="store_true", help="loader with 0 vs 2 persistent workers")
    parser.add_argument("--samples", type=int, default=None, help="corpus rows (build 10000, pack-read 50000)")
    parser.add_argument("--workers", type=int, default=2, help="processes of both sides (xtl num_proc = map num_proc)")
    parser.add_argument("--pack", type=int, default=4096, help="pack_max_length (and the peer's max_length)")
    parser.add_argument("--peer-batch-size", type=int, default=1000, help="rows per batched map call (its default)")
    parser.add_argument("--batch", type=int, default=8, help="samples per pad-to-longest batch (fill ratio)")
    parser.add_argument("--reads", type=int, default=400, help="--pack-read: packs read per side per pair")
    parser.add_argument("--loader-steps", type=int, default=300, help="--loader: step batches per side per pair")
    parser.add_argument("--loader-pack", type=int, default=512, help="--loader: pack_max_length (tiny recipe: 512)")
    parser.add_argument("--step-ms", type=float, default=0.0, help="--loader: compute per step in the main process")
    parser.add_argument(
        "--no-byte-offsets", action="store_true", help="ablation: xtl takes token offsets from the tokenizer"
    )
    parser.add_argument("--out", type=Path, default=Path("/tmp/xtl-data-bench"))
    add_protocol_args(parser)
    return parser.parse_args(argv)


def main() -> None:
    """Run the selected benchmark and print its figures."""
    args = parse_args()
    _pin(args.threads)
    print(f"load average before: {load_average()}")
    if args.warm_start:
        warm_start(args)
    elif args.pack_read:
        pack_read(args)
    elif args.loader:
        loader(args)
    else:
        cold_build(args)
    print(f"load average after: {load_average()}")


# -- 1. cold build ----------------------------------------------------------------------------------------------


def cold_build(args: argparse.Namespace) -> None:
    """xtl cache build + packing against batched, multi-process ``datasets.map`` (module docstring, mode 1)."""
    import datasets
    from transformers import AutoTokenizer

    from xtl.data import ChatTokenizeFn, JsonlSource, MixedDataset, best_fit_pack, build_cache, tiny_assets_dir

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    samples = args.samples or 10_000
    out = args.out / "build"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    corpus = out / "sft.jsonl"
    started = time.perf_counter()
    _write_corpus(corpus, samples, seed=0)
    print(f"corpus: {samples} chats, {corpus.stat().st_size / 1e6:.1f} MB ({time.perf_counter() - started:.1f}s)")

    tokenizer = AutoTokenizer.from_pretrained(tiny_assets_dir())
    fn = ChatTokenizeFn(tokenizer, template="qwen3")
    if args.no_byte_offsets:  # ablation: the former path, offsets tracked by the tokenizer
        fn._token_bytes = None
    state: dict[str, Any] = {}

    def xtl_side() -> float:
        shutil.rmtree(out / "xtl-cache", ignore_errors=True)
        with _Timer() as timer:
            cache = build_cache(JsonlSource(corpus), fn, out / "xtl-cache", num_proc=args.workers, progress=False)
            data = MixedDataset([cache], [1.0], seed=0)
            plan = best_fit_pack(data.num_tokens, args.pack, seed=0, overlong="truncate")
        state["xtl"] = (cache, plan)
        state.setdefault("cpu_xtl", []).append(timer.cpu)
        return timer.wall

    def peer_map(batch: dict[str, list]) -> dict[str, list]:
        out_ = tokenizer.apply_chat_template(
            batch["messages"], tokenize=True, truncation=True, max_length=args.pack, return_dict=True
        )
        return {"input_ids": out_["input_ids"]}

    def peer_side() -> float:
        shutil.rmtree(out / "hf-cache", ignore_errors=True)
        with _Timer() as timer:
            ds = datasets.load_dataset("json", data_files=str(corpus), split="train", cache_dir=str(out / "hf-cache"))
            ds = ds.map(
                peer_map,
                batched=True,
                batch_size=args.peer_batch_size,
                num_proc=args.workers,
                remove_columns=ds.column_names,
                load_from_cache_file=False,
            )
        state["peer"] = ds
        state.setdefault("cpu_peer", []).append(timer.cpu)
        return timer.wall

    print_configs(
        xtl=_config(
            "xtl.data.build_cache + MixedDataset + best_fit_pack",
            args,
            render="qwen3 Python renderer + assistant loss mask",
            batched="True ("
            + (
                "one encode_batch call per task, offsets from the tokenizer)"
                if args.no_byte_offsets
                else "one encode_batch_fast call per task, token offsets from byte lengths)"
            ),
            batch_size="512 rows per task",
            packing=f"best_fit, pack_max_length={args.pack}",
            truncation=f"overlong=truncate to {args.pack} tokens (at packing)",
            output="memory-mapped cache + pack plan",
        ),
        peer=_config(
            "datasets.load_dataset(json) + Dataset.map",
            args,
            render="the tokenizer's Jinja chat template (apply_chat_template), no loss mask",
            batched="True (apply_chat_template on the batch of conversations)",
            batch_size=f"{args.peer_batch_size} rows per call",
            packing="none (one row per sample)",
            truncation=f"True, max_length={args.pack} (in the tokenizer)",
            output="Arrow (JSON -> Arrow conversion included)",
        ),
    )
    result = run_pairs(xtl_side, peer_side, args.pairs, args.warmup, on_pair=_print_pair)
    print(result.summary("xtl", "datasets.map"))
    cpu = PairedResult(
        "CPU seconds (process + children)", state["cpu_xtl"][args.warmup :], state["cpu_peer"][args.warmup :]
    )
    print(cpu.summary("xtl", "datasets.map"))

    cache, plan = state["xtl"]
    ds = state["peer"]
    lengths = np.asarray(cache.num_tokens)
    total = int(lengths.sum())
    peer_tokens = int(sum(len(ids) for ids in ds["input_ids"]))
    print(
        f"tokens: {total:,} ({total / samples:.0f} per chat). Truncated at --pack {args.pack}: xtl "
        f"{plan.truncated_tokens:,} ({100 * plan.truncated_tokens / total:.1f}%, {plan.num_truncated} chats) | "
        f"datasets.map {total - peer_tokens:,} ({100 * (total - peer_tokens) / total:.1f}%)"
    )
    check = min(200, len(ds))
    same = all(
        ds[i]["input_ids"]
        == np.asarray(cache.input_ids[cache.offsets[i] : cache.offsets[i + 1]])[: args.pack].tolist()
        for i in range(check)
    )
    print(f"same ids on both sides (first {check} chats, truncated alike): {same}")
    _fill_ratio(lengths, plan, args)


def _config(what: str, args: argparse.Namespace, **extra: str) -> dict[str, Any]:
    return {
        "pipeline": what,
        "tokenizer": "embedded tiny byte-level BPE (fast, Rust)",
        "num_proc": args.workers,
        **{k.replace("_", " "): v for k, v in extra.items()},
        "threads": args.threads,
    }


def _fill_ratio(lengths: np.ndarray, plan: Any, args: argparse.Namespace) -> None:
    order = np.random.default_rng(0).permutation(len(lengths))
    clipped = np.minimum(lengths[order], args.pack)
    usable = len(clipped) // args.batch * args.batch
    batches = clipped[:usable].reshape(-1, args.batch)
    pad_fill = batches.sum() / (batches.max(axis=1) * args.batch).sum()
    report = plan.report()
    print(
        f"fill ratio: best-fit packing {report['fill_ratio']:.4f} ({report['packs']} packs of {args.pack}) vs "
        f"pad-to-longest batches of {args.batch}: {pad_fill:.4f}"
    )
    p99 = int(np.percentile(lengths, 99))
    print(f"length mix (tokens): median {int(np.median(lengths))}, mean {lengths.mean():.0f}, p99 {p99}")


# -- 2. warm start ----------------------------------------------------------------------------------------------


def warm_start(args: argparse.Namespace) -> None:
    """Warm start of a fresh process on an N-sample cache, stored plan vs packing again (module docstring, mode 2)."""
    n = args.warm_start
    root = args.out / f"warm-{n}"
    corpus, cache_dir = root / "short.jsonl", root / "cache"
    if not corpus.is_file():
        root.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        _write_short_corpus(corpus.with_suffix(".tmp"), n, seed=0)
        corpus.with_suffix(".tmp").rename(corpus)
        print(
            f"corpus: {n:,} short chats, {corpus.stat().st_size / 1e6:.0f} MB ({time.perf_counter() - started:.1f}s)"
        )
    started = time.perf_counter()
    first = _warm_child(corpus, cache_dir, args.pack)  # builds the cache and the plan if missing
    print(f"cache ready ({time.perf_counter() - started:.1f}s): {first['packs']:,} packs of {args.pack}")

    def stored() -> float:
        return _warm_child(corpus, cache_dir, args.pack)["start"]

    def repack() -> float:
        shutil.rmtree(cache_dir / "plans", ignore_errors=True)
        shutil.rmtree(cache_dir / "fingerprints", ignore_errors=True)
        return _warm_child(corpus, cache_dir, args.pack)["start"]

    settings = f"XTLDataModule([{corpus.name}], tokenizer='tiny:', pack_max_length={args.pack}, num_workers=0)"
    print_configs(
        stored_plan=_warm_config(settings, "stored pack plan + remembered source hash (sampled blocks)", args),
        repack=_warm_config(settings, "plan and hash record deleted: full source hash + best-fit packing", args),
    )
    imports: list[float] = []
    result = run_pairs(stored, repack, args.pairs, args.warmup, on_pair=_print_pair)
    for _ in range(2):
        imports.append(_warm_child(corpus, cache_dir, args.pack)["imports"])
    times = result.a
    print(
        f"warm start with {n:,} cached samples (fresh process, setup + first step batch): median "
        f"{statistics.median(times):.3f}s (min {min(times):.3f} .. max {max(times):.3f}, {len(times)} runs), "
        f"imports {statistics.median(imports):.2f}s apart"
    )
    print(result.summary("stored plan", "repack"))


def _warm_config(settings: str, what: str, args: argparse.Namespace) -> dict[str, Any]:
    return {"datamodule": settings, "warm start": what, "threads": args.threads}


def _warm_child(corpus: Path, cache_dir: Path, pack: int) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, "-c", WARM_START, str(corpus), str(cache_dir), str(pack)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- 3. pack reads ----------------------------------------------------------------------------------------------


def pack_read(args: argparse.Namespace) -> None:
    """One gather per pack against per-segment copies (module docstring, mode 3)."""
    from transformers import AutoTokenizer

    from xtl.data import (
        ChatTokenizeFn,
        JsonlSource,
        MixedDataset,
        PackedDataset,
        best_fit_pack,
        build_cache,
        tiny_assets_dir,
    )

    samples = args.samples or 50_000
    root = args.out / f"read-{samples}"
    corpus = root / "short.jsonl"
    if not corpus.is_file():
        root.mkdir(parents=True, exist_ok=True)
        _write_short_corpus(corpus, samples, seed=1)
    fn = ChatTokenizeFn(AutoTokenizer.from_pretrained(tiny_assets_dir()), template="qwen3")
    cache = build_cache(JsonlSource(corpus), fn, root / "cache", num_proc=args.workers, progress=False)
    data = MixedDataset([cache], [1.0], seed=0)
    packs = PackedDataset(data, best_fit_pack(data.num_tokens, args.pack, seed=0))
    order = np.random.default_rng(0).permutation(len(packs))[: args.reads].tolist()
    segments = float(np.mean([packs.plan.pack_offsets[i + 1] - packs.plan.pack_offsets[i] for i in order]))
    for i in order[:50]:
        new, old = packs[i], _per_segment_pack(packs, i)
        assert np.array_equal(new.input_ids, old.input_ids) and np.array_equal(new.labels, old.labels)
        assert new.lengths == old.lengths

    def timed(read: Callable[[int], Any]) -> Callable[[], float]:
        def run() -> float:
            started = time.perf_counter()
            for i in order:
                read(i)
            return (time.perf_counter() - started) / len(order) * 1e6

        return run

    print_configs(
        gather=_read_config("PackedDataset.__getitem__: one index array, one gather of ids and mask", args, segments),
        per_segment=_read_config(
            "former reader: per segment slice + astype + where, then concatenate", args, segments
        ),
    )
    result = run_pairs(
        timed(packs.__getitem__), timed(lambda i: _per_segment_pack(packs, i)), args.pairs, args.warmup, "us/pack"
    )
    print(result.summary("gather", "per-segment"))


def _read_config(what: str, args: argparse.Namespace, segments: float) -> dict[str, Any]:
    return {
        "reader": what,
        "pack_max_length": args.pack,
        "segments per pack": f"{segments:.0f}",
        "packs read": args.reads,
        "threads": args.threads,
    }


def _per_segment_pack(packs: Any, index: int) -> Any:
    """The pack reader before the one-gather change (kept here as the reference side)."""
    from xtl.data import Pack

    plan = packs.plan
    a, b = int(plan.pack_offsets[index]), int(plan.pack_offsets[index + 1])
    ids, labels, lengths = [], [], []
    for s in range(a, b):
        seg_ids, seg_labels = packs.data.tokens(int(plan.seg_sample[s]), int(plan.seg_start[s]), int(plan.seg_end[s]))
        ids.append(seg_ids)
        labels.append(seg_labels)
        lengths.append(len(seg_ids))
    return Pack(index, np.concatenate(ids), np.concatenate(labels), lengths)


# -- 4. loader workers ------------------------------------------------------------------------------------------


def loader(args: argparse.Namespace) -> None:
    """``num_workers=0`` against two persistent workers (module docstring, mode 4)."""
    import torch

    from xtl.data import SourceSpec, XTLDataModule

    cache_dir = args.out / "loader-cache"

    def module(workers: int) -> Any:
        return XTLDataModule(
            [SourceSpec("tiny:sft_train.jsonl")],
            tokenizer="tiny:",
            pack_max_length=args.loader_pack,
            micro_batches_per_step=2,
            cache_dir=str(cache_dir),
            progress=False,
            num_workers=workers,
        )

    dm0 = module(0)
    with contextlib.redirect_stdout(io.StringIO()):
        dm0.setup()
    steps_per_epoch = len(dm0.train_dataloader())
    weight = torch.randn(256, 256)

    def side(workers: int) -> Callable[[], float]:
        def run() -> float:
            dm = module(workers)
            with contextlib.redirect_stdout(io.StringIO()):  # the packing summary line, once per module
                dm.setup()
            started = time.perf_counter()
            loader_ = dm.train_dataloader()
            taken = 0
            while taken < args.loader_steps:
                for _ in loader_:
                    _busy(weight, args.step_ms)
                    taken += 1
                    if taken == args.loader_steps:
                        break
            elapsed = time.perf_counter() - started
            del loader_
            return elapsed

        return run

    base = f"XTLDataModule(tiny:sft_train.jsonl, pack_max_length={args.loader_pack}, micro_batches_per_step=2)"
    print_configs(
        main_process={"loader": base, "num_workers": 0, "steps": args.loader_steps, "step_ms": args.step_ms},
        workers={
            "loader": base,
            "num_workers": 2,
            "persistent_workers": True,
            "steps": args.loader_steps,
            "step_ms": args.step_ms,
        },
    )
    print(f"({steps_per_epoch} steps per epoch; the time covers creating the loader, its workers and every step)")
    result = run_pairs(side(0), side(2), args.pairs, args.warmup, on_pair=_print_pair)
    print(result.summary("num_workers=0", "num_workers=2"))


def _busy(weight: Any, ms: float) -> None:
    if ms <= 0:
        return
    deadline = time.perf_counter() + ms / 1000
    while time.perf_counter() < deadline:
        weight @ weight


# -- helpers ----------------------------------------------------------------------------------------------------


def _pin(threads: int) -> None:
    pin_threads(threads)
    os.environ["RAYON_NUM_THREADS"] = str(threads)
    os.environ["TOKENIZERS_PARALLELISM"] = "false" if threads == 1 else "true"
    try:
        import pyarrow

        pyarrow.set_cpu_count(threads)
        pyarrow.set_io_thread_count(threads)
    except ImportError:
        pass


def _print_pair(index: int, a: float, b: float) -> None:
    print(f"  pair {index + 1}: {a:.4g} | {b:.4g} | ratio {a / b:.3f}", flush=True)


class _Timer:
    """Wall time and CPU time (this process plus reaped child processes) of a block."""

    def __enter__(self) -> _Timer:
        self._wall = time.perf_counter()
        self._cpu = _cpu_seconds()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self._wall
        self.cpu = _cpu_seconds() - self._cpu


def _cpu_seconds() -> float:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _write_corpus(path: Path, n: int, seed: int) -> None:
    rng = random.Random(seed)
    nrng = np.random.default_rng(seed)
    with path.open("w") as f:
        for _ in range(n):
            multi = rng.random() < 0.3
            turns = rng.randint(2, 5) if multi else 1
            median_words = 220 if multi else 70
            messages = [{"role": "system", "content": "You are a helpful assistant."}] if rng.random() < 0.4 else []
            for _ in range(turns):
                q = int(nrng.lognormal(np.log(median_words * 0.3), 0.8)) + 3
                a = int(nrng.lognormal(np.log(median_words * 0.7), 0.9)) + 1
                messages.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=q)) + "?"})
                messages.append({"role": "assistant", "content": " ".join(rng.choices(WORDS, k=a)) + "."})
            f.write(json.dumps({"messages": messages}) + "\n")


def _write_short_corpus(path: Path, n: int, seed: int) -> None:
    """Single-turn chats of 3..12 words a side (about 30 tokens each), written in blocks."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for start in range(0, n, 10_000):
            lines = []
            for _ in range(min(10_000, n - start)):
                q = " ".join(rng.choices(WORDS, k=rng.randint(3, 12)))
                a = " ".join(rng.choices(WORDS, k=rng.randint(3, 12)))
                lines.append(
                    json.dumps(
                        {"messages": [{"role": "user", "content": q + "?"}, {"role": "assistant", "content": a}]}
                    )
                )
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
