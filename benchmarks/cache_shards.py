"""Sharded cache build: 2 shards tokenized by 2 processes at once (then assembled) against one unsharded build.

Usage::

    python benchmarks/cache_shards.py [--rows 50000 --shards 2 --pairs 5 --warmup 1 --threads 1]

The corpus is the tiny SFT set (``xtl/assets/tiny/sft_train.jsonl``) repeated to ``--rows`` chats, tokenized with
the embedded tiny tokenizer and the ``qwen3`` template, from a cold cache every time:

- sharded (side A): ``--shards`` processes (forked, so no import is timed) each run ``build_cache_part`` on their
  shard with one tokenizing process; the last to finish assembles the entry. Wall time from the first start to the
  assembled entry. This is what ``--shard i/n`` jobs or ``data.shard_cache_build`` on ``n`` nodes do, here on one
  machine's cores.
- unsharded (side B): ``build_cache`` with one tokenizing process.

The two entries are checked equal byte for byte (data files). CPU time of all processes is reported beside the wall
time: on a shared machine the shards may not get a core each, and the CPU ratio is the overhead of sharding (the
assembly, each process's setup) whatever the load. Protocol (``benchmarks/_paired.py``): threads pinned,
``--warmup`` untimed pairs, ``--pairs`` timed pairs in alternating order, the median ratio with its min..max.
"""

from __future__ import annotations

import argparse
import filecmp
import multiprocessing as mp
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _paired import add_protocol_args, load_average, pin_threads, print_configs, run_pairs  # noqa: E402


def main() -> None:
    """Run the benchmark and print both configurations and the paired result."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=50000, help="chats in the corpus (the tiny SFT set repeated)")
    parser.add_argument("--shards", type=int, default=2, help="shards, each built by its own process")
    add_protocol_args(parser)
    args = parser.parse_args()
    pin_threads(args.threads)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)

    from transformers import AutoTokenizer

    from xtl.data import ChatTokenizeFn, JsonlSource, tiny_assets_dir
    from xtl.data.cache import build_cache, build_cache_part

    work = Path(tempfile.mkdtemp(prefix="xtl-cache-shards-"))
    lines = (tiny_assets_dir() / "sft_train.jsonl").read_text().splitlines(keepends=True)
    corpus = work / "corpus.jsonl"
    corpus.write_text("".join(lines[i % len(lines)] for i in range(args.rows)))
    source = JsonlSource(corpus)
    fn = ChatTokenizeFn(AutoTokenizer.from_pretrained(tiny_assets_dir()), template="qwen3")
    source.fingerprint(), len(source)  # hashed and indexed once, before the forks

    cpu: dict[str, list[float]] = {"sharded": [], "unsharded": []}

    def cpu_seconds() -> float:
        own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime

    def fresh(name: str) -> Path:
        shutil.rmtree(work / name, ignore_errors=True)
        return work / name

    def sharded() -> float:
        cache = fresh("sharded")
        ctx = mp.get_context("fork")
        started, used = time.perf_counter(), cpu_seconds()
        quiet = {"progress": False}
        shards = [(source, fn, cache, i, args.shards, 1) for i in range(args.shards)]
        procs = [ctx.Process(target=build_cache_part, args=shard, kwargs=quiet) for shard in shards]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
            if p.exitcode != 0:
                raise SystemExit(f"a shard builder failed (exit code {p.exitcode})")
        cpu["sharded"].append(cpu_seconds() - used)
        return time.perf_counter() - started

    def unsharded() -> float:
        cache = fresh("unsharded")
        started, used = time.perf_counter(), cpu_seconds()
        build_cache(source, fn, cache, num_proc=1, progress=False)
        cpu["unsharded"].append(cpu_seconds() - used)
        return time.perf_counter() - started

    print_configs(
        sharded={"rows": args.rows, "shards": args.shards, "processes": args.shards, "threads": args.threads},
        unsharded={"rows": args.rows, "processes": 1, "threads": args.threads},
    )
    print(f"cpus {os.cpu_count()}, load average before {load_average()}")
    result = run_pairs(
        sharded,
        unsharded,
        args.pairs,
        args.warmup,
        on_pair=lambda i, a, b: print(f"pair {i}: sharded {a:.2f} s, unsharded {b:.2f} s", flush=True),
    )
    entries = [next(p for p in (work / side).iterdir() if p.is_dir()) for side in ("sharded", "unsharded")]
    for name in ("input_ids.bin", "loss_mask.bin", "offsets.npy", "rows.npy"):
        assert filecmp.cmp(entries[0] / name, entries[1] / name, shallow=False), name
    tokens = os.path.getsize(entries[1] / "input_ids.bin") // 4
    print(f"entries equal byte for byte ({tokens} tokens); load average after {load_average()}")
    print(result.summary("sharded", "unsharded"))
    ratios = [a / b for a, b in zip(cpu["sharded"][args.warmup :], cpu["unsharded"][args.warmup :])]
    print(
        f"CPU seconds (all processes): sharded median {statistics.median(cpu['sharded'][args.warmup :]):.3f} | "
        f"unsharded median {statistics.median(cpu['unsharded'][args.warmup :]):.3f} | ratio median "
        f"{statistics.median(ratios):.3f} (min {min(ratios):.3f} .. max {max(ratios):.3f}): the sharding overhead; "
        f"on {args.shards} free cores the wall ratio is about this / {args.shards}"
    )
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
