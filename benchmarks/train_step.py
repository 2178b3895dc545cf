"""Training throughput and peak memory of xtl vs a transformers ``Trainer`` on an SFT length mix, side by side.

Usage::

    python benchmarks/train_step.py [--steps 12 --hidden 256 --layers 4 --seed 0 --samples 1000 --pack 2048 --rounds 2]

Method:

1. Setup (in a spawned child, so the parent stays a small stdlib-only process): write a synthetic chat SFT JSONL
   whose rendered token lengths follow a long-tailed log-normal mix (median ~150 tokens, clipped to 32..1024,
   20% two-turn conversations) using words of the embedded tiny tokenizer's corpus; build a Qwen3 model
   (``Qwen3Config`` + ``Qwen3ForCausalLM``, fp32) and ``save_pretrained`` it; warm xtl's tokenization cache; pick
   the transformers batch size ``B = round(pack / mean length)`` so both sides see about the same number of real
   tokens per optimizer step.
2. xtl (own spawned child): ``XTLDataModule`` (``qwen3`` template, best-fit packing into ``--pack`` tokens, one
   micro-batch per step) + ``CausalLM`` loading the saved HF weights, trained by an in-process Lightning
   ``Trainer`` on CPU.
3. transformers (own spawned child): the same weights through ``AutoModelForCausalLM`` (SDPA), the same JSONL
   rendered with the tokenizer's chat template, ``labels = input_ids``, pad-to-longest batches of ``B`` samples
   (``DataCollatorForSeq2Seq``; labels padded with -100), trained by ``transformers.Trainer`` on CPU.

Both sides run ``--steps`` optimizer steps. The clock runs from the end of step 1 (warm-up, excluded) to the end of
the last step; the useful tokens are the non-padding tokens of steps 2..N (``MicroBatch.num_real_tokens`` for xtl,
``attention_mask.sum()`` of each collated batch for transformers). ``fill`` is useful / processed tokens (processed
includes padding: xtl pads each pack to ``--pack``, transformers pads each batch to its longest sample).

Peak RSS is ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` read at the end of each side's own spawned child, so the
two peaks do not mix. On Linux a spawned child's ``ru_maxrss`` starts from its parent's peak (it survives the
``execve``), which is why the parent imports nothing heavy; ``VmHWM`` of ``/proc/self/status`` (the peak of the
child's own address space only) is printed next to it as a cross-check.

The machine may be shared, so ``--rounds`` (default 2) repeats both sides in alternating order (xtl first in even
rounds, transformers first in odd ones), each run in a fresh child; every run is printed, and the summary takes each
side's best (least disturbed) throughput and its largest peak RSS. The 1-minute load average is printed before and
after. Each line also gives useful tokens per CPU second (``time.process_time``, all threads): with ``--threads 1``
it barely moves under other load; with several threads, spin-waiting threads of a disturbed run inflate it too.
On a shared machine prefer ``--threads 1``: with all cores, a run whose threads get descheduled can be several times
slower (every OpenMP barrier waits for the descheduled thread), xtl's many small per-document kernels more so.

The ratio printed is xtl / transformers useful tokens/s (wall clock); the target on an SFT length mix is >= 1.5.
``--hf-sampling group_by_length`` gives transformers its length-grouped sampler (a stronger baseline than the
default random order).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import random
import resource
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

TARGET_RATIO = 1.5
MIN_TOKENS, MAX_TOKENS = 32, 1024
TEMPLATE_OVERHEAD = 20  # tokens the qwen3 template adds around one user/assistant turn (roles, empty think block)
# Words of the tiny tokenizer's training corpus (scripts/make_tiny_assets.py): one token each after a space.
WORDS = (
    "apple river stone cloud tiger lemon pencil garden rocket candle mirror forest window silver planet "
    "orange bridge winter summer dragon castle butter marble rabbit violin coffee desert island jungle "
    "meadow ocean puzzle shadow thunder valley wizard yellow zebra anchor breeze copper dolphin falcon"
).split()


@dataclass
class BenchConfig:
    """Everything a child process needs (picklable)."""

    work_dir: str
    data: str
    hf_dir: str
    tokenizer: str
    cache_dir: str
    steps: int
    pack: int
    hidden: int
    layers: int
    seed: int
    threads: int
    hf_batch: int = 0
    hf_sampling: str = "random"


@dataclass
class SideResult:
    """Throughput and memory of one side, measured in its own child process."""

    name: str
    useful_tokens: int
    processed_tokens: int
    seconds: float
    cpu_seconds: float
    steps_timed: int
    peak_rss_bytes: int
    vm_hwm_bytes: int
    threads: int

    @property
    def useful_tok_s(self) -> float:
        """Non-padding tokens per second over the timed steps."""
        return self.useful_tokens / max(self.seconds, 1e-9)

    @property
    def useful_tok_cpu_s(self) -> float:
        """Non-padding tokens per CPU second of the process (all threads; OpenMP spin-waits count too)."""
        return self.useful_tokens / max(self.cpu_seconds, 1e-9)

    @property
    def processed_tok_s(self) -> float:
        """Tokens per second including padding."""
        return self.processed_tokens / max(self.seconds, 1e-9)

    @property
    def fill(self) -> float:
        """Useful / processed tokens."""
        return self.useful_tokens / max(self.processed_tokens, 1)


# ---- data ------------------------------------------------------------------------------------------------------


def write_sft_mix(path: Path, samples: int, seed: int, median: float, sigma: float) -> None:
    """Write ``samples`` chat records whose rendered lengths follow a clipped log-normal (stdlib only)."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(samples):
            target = int(min(MAX_TOKENS, max(MIN_TOKENS, rng.lognormvariate(math.log(median), sigma))))
            turns = 2 if rng.random() < 0.2 and target >= 4 * TEMPLATE_OVERHEAD else 1
            budget = max(2 * turns, target - TEMPLATE_OVERHEAD * turns)
            messages: list[dict[str, str]] = []
            for turn_budget in _split(budget, turns, rng):
                user = max(1, int(turn_budget * rng.uniform(0.15, 0.5)))
                messages.append({"role": "user", "content": _text(user, rng)})
                messages.append({"role": "assistant", "content": _text(max(1, turn_budget - user), rng)})
            f.write(json.dumps({"messages": messages}) + "\n")


def _split(total: int, parts: int, rng: random.Random) -> list[int]:
    if parts == 1:
        return [total]
    first = int(total * rng.uniform(0.3, 0.7))
    return [first, total - first]


def _text(num_tokens: int, rng: random.Random) -> str:
    """About ``num_tokens`` tokens: words in sentences of 6..14 (each period is one more token)."""
    words: list[str] = []
    while len(words) < num_tokens:
        sentence = [rng.choice(WORDS) for _ in range(rng.randint(6, 14))]
        words.extend(sentence[:-1] + [sentence[-1] + "."])
    words = words[: max(1, num_tokens - num_tokens // 10)]
    return " ".join(words).capitalize()


# ---- children --------------------------------------------------------------------------------------------------


def _peaks() -> tuple[int, int]:
    """``(ru_maxrss, VmHWM)`` of this process in bytes."""
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    hwm = 0
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                hwm = int(line.split()[1]) * 1024
    return maxrss, hwm


def _quiet() -> None:
    """Silence progress bars, info logs and known-harmless warnings of the libraries in a child."""
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    for message in (".*does not have many workers.*", ".*across ranks is zero.*", ".*LeafSpec.*is deprecated.*"):
        warnings.filterwarnings("ignore", message=message)


def _set_threads(threads: int) -> int:
    import torch

    _quiet()
    if threads > 0:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def prepare(cfg: BenchConfig) -> dict[str, Any]:
    """Save the HF model, warm xtl's tokenization cache, measure rendered lengths and choose the HF batch size."""
    import statistics

    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from xtl.data import XTLDataModule, tiny_assets_dir

    _quiet()

    cfg.tokenizer = str(tiny_assets_dir())
    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer)
    heads = max(1, cfg.hidden // 64)
    config = Qwen3Config(
        vocab_size=1600,
        hidden_size=cfg.hidden,
        intermediate_size=3 * cfg.hidden,
        num_hidden_layers=cfg.layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=64,
        max_position_embeddings=max(4096, cfg.pack),
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(cfg.seed)
    model = Qwen3ForCausalLM(config)
    model.save_pretrained(cfg.hf_dir)
    dm = _datamodule(cfg, XTLDataModule)
    dm.prepare_data()
    dm.setup()
    assert dm.train_split is not None
    plan = dm.train_split.plan.report()
    rows = [json.loads(line) for line in Path(cfg.data).read_text().splitlines()]
    lengths = sorted(len(tokenizer.apply_chat_template(r["messages"], tokenize=True, return_dict=False)) for r in rows)
    mean = statistics.fmean(lengths)
    return {
        "samples": len(lengths),
        "median": statistics.median(lengths),
        "mean": mean,
        "p90": lengths[int(0.9 * (len(lengths) - 1))],
        "max": lengths[-1],
        "packs": plan["packs"],
        "plan_fill": plan["fill_ratio"],
        "tokenizer": cfg.tokenizer,
        "hf_batch": cfg.hf_batch or max(1, round(cfg.pack / mean)),
        "params": sum(p.numel() for p in model.parameters()),
    }


def _datamodule(cfg: BenchConfig, cls: Any) -> Any:
    return cls(
        sources=[{"path": cfg.data, "kind": "chat"}],
        tokenizer=cfg.tokenizer,
        template="qwen3",
        pack_max_length=cfg.pack,
        micro_batches_per_step=1,
        seed=cfg.seed,
        cache_dir=cfg.cache_dir,
        progress=False,
    )


def run_xtl(cfg: BenchConfig) -> SideResult:
    """Train with xtl's public API (in-process Lightning) and time steps 2..N."""
    import logging

    threads = _set_threads(cfg.threads)
    import lightning.pytorch as pl

    from xtl.data import XTLDataModule
    from xtl.train import AdamWConfig, CausalLM

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # after import: Lightning sets INFO on import

    class StepClock(pl.Callback):
        """Time and real/processed tokens at the end of every train step."""

        def __init__(self) -> None:
            self.marks: list[tuple[float, float, int, int]] = []

        def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
            batch = args[1]  # (outputs, batch, batch_idx)
            real = sum(mb.num_real_tokens for mb in batch)
            processed = sum(mb.seq_ctx.seq_len for mb in batch)
            self.marks.append((time.perf_counter(), time.process_time(), real, processed))

    dm = _datamodule(cfg, XTLDataModule)
    dm.prepare_data()
    dm.setup()
    module = CausalLM(model=cfg.hf_dir, optimizer=AdamWConfig(lr=1e-4), max_grad_norm=1.0, seed=cfg.seed)
    clock = StepClock()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=cfg.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[clock],
        default_root_dir=cfg.work_dir,
    )
    trainer.fit(module, datamodule=dm)
    return _result("xtl", clock.marks, threads)


def run_transformers(cfg: BenchConfig) -> SideResult:
    """Train with ``transformers.Trainer`` on pad-to-longest batches and time steps 2..N."""
    threads = _set_threads(cfg.threads)
    import torch
    from datasets import Dataset
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        DataCollatorForSeq2Seq,
        PrinterCallback,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer)
    rows = [json.loads(line) for line in Path(cfg.data).read_text().splitlines()]
    ids = [tokenizer.apply_chat_template(r["messages"], tokenize=True, return_dict=False) for r in rows]
    dataset = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids], "labels": ids})
    padder = DataCollatorForSeq2Seq(tokenizer, padding="longest", label_pad_token_id=-100, return_tensors="pt")
    counts: list[tuple[int, int]] = []

    def collate(features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = padder(features)
        mask = batch["attention_mask"]
        counts.append((int(mask.sum()), mask.numel()))
        return batch

    stamps: list[tuple[float, float]] = []

    class StepClock(TrainerCallback):
        """Time at the end of every optimizer step."""

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            stamps.append((time.perf_counter(), time.process_time()))

    model = AutoModelForCausalLM.from_pretrained(cfg.hf_dir, attn_implementation="sdpa", dtype=torch.float32)
    args = TrainingArguments(
        output_dir=str(Path(cfg.work_dir) / "hf_out"),
        per_device_train_batch_size=cfg.hf_batch,
        max_steps=cfg.steps,
        learning_rate=1e-4,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=cfg.seed,
        train_sampling_strategy=cfg.hf_sampling,
    )
    trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=collate, callbacks=[StepClock()])
    trainer.remove_callback(PrinterCallback)  # it prints the final metrics dict even with logging_strategy="no"
    trainer.train()
    # Batch i is consumed by step i (the loader may have collated one batch ahead; those extra counts are ignored).
    if len(counts) < len(stamps):
        raise RuntimeError(f"transformers: {len(stamps)} steps but only {len(counts)} collated batches")
    marks = [(*t, *c) for t, c in zip(stamps, counts)]
    return _result("transformers", marks, threads)


def _result(name: str, marks: list[tuple[float, float, int, int]], threads: int) -> SideResult:
    """Sum steps 2..N of ``(wall time, CPU time, real tokens, processed tokens)`` marks taken at each step end."""
    if len(marks) < 2:
        raise RuntimeError(f"{name}: only {len(marks)} step(s) ran; need at least 2 (step 1 is warm-up)")
    maxrss, hwm = _peaks()
    return SideResult(
        name=name,
        useful_tokens=sum(m[2] for m in marks[1:]),
        processed_tokens=sum(m[3] for m in marks[1:]),
        seconds=marks[-1][0] - marks[0][0],
        cpu_seconds=marks[-1][1] - marks[0][1],
        steps_timed=len(marks) - 1,
        peak_rss_bytes=maxrss,
        vm_hwm_bytes=hwm,
        threads=threads,
    )


def _in_child(fn: Any, cfg: BenchConfig) -> Any:
    """Run ``fn(cfg)`` in a fresh spawned process and return its result."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, cfg).result()


# ---- main ------------------------------------------------------------------------------------------------------


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _line(r: SideResult, label: str | None = None) -> str:
    return (
        f"{label or r.name:12s}: {r.useful_tok_s:6.0f} useful tok/s, fill {r.fill:.3f}, "
        f"peak RSS {_gib(r.peak_rss_bytes)} (VmHWM {_gib(r.vm_hwm_bytes)}) | "
        f"{r.steps_timed} steps in {r.seconds:.2f} s ({r.cpu_seconds:.1f} CPU s), {r.processed_tok_s:.0f} processed "
        f"tok/s, {r.useful_tok_cpu_s:.0f} useful tok/CPU-s, {r.threads} threads"
    )


def main() -> None:
    """Parse arguments, prepare model and data, run both sides in their own processes, print the comparison."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per side (step 1 is warm-up)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size (heads = hidden/64, head_dim 64)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--samples", type=int, default=1000, help="SFT records to generate")
    parser.add_argument("--median", type=float, default=150.0, help="median sample length in tokens")
    parser.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma of sample lengths")
    parser.add_argument("--pack", type=int, default=2048, help="xtl pack length (tokens per step)")
    parser.add_argument("--hf-batch", type=int, default=0, help="transformers batch size (0: pack / mean length)")
    parser.add_argument(
        "--hf-sampling", default="random", choices=["random", "sequential", "group_by_length"], help="HF sampler"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads per side (0: torch default)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating repeats; each side's best run counts")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2 (step 1 is excluded as warm-up)")
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    load_before = os.getloadavg()[0]

    with tempfile.TemporaryDirectory(prefix="xtl-train-bench-") as tmp:
        work = Path(tmp)
        data = work / "sft_mix.jsonl"
        write_sft_mix(data, args.samples, args.seed, args.median, args.sigma)
        cfg = BenchConfig(
            work_dir=str(work),
            data=str(data),
            hf_dir=str(work / "hf_model"),
            tokenizer="",  # set by prepare(): xtl.data.tiny_assets_dir()
            cache_dir=str(work / "cache"),
            steps=args.steps,
            pack=args.pack,
            hidden=args.hidden,
            layers=args.layers,
            seed=args.seed,
            threads=args.threads,
            hf_batch=args.hf_batch,
            hf_sampling=args.hf_sampling,
        )
        start = time.perf_counter()
        info = _in_child(prepare, cfg)
        cfg.hf_batch, cfg.tokenizer = info["hf_batch"], info["tokenizer"]
        print(
            f"model: Qwen3 {args.layers} layers, hidden {args.hidden}, {info['params'] / 1e6:.1f}M params, fp32 | "
            f"data: {info['samples']} chat samples, tokens median {info['median']:.0f} / mean {info['mean']:.0f} / "
            f"p90 {info['p90']} / max {info['max']}, {info['packs']} xtl packs of {args.pack} "
            f"(plan fill {info['plan_fill']:.3f})"
        )
        print(
            f"steps: {args.steps} per side (first excluded) | xtl: 1 pack of {args.pack} tokens/step | transformers: "
            f"batch {cfg.hf_batch}, pad-to-longest, {args.hf_sampling} order"
        )
        sides = {"xtl": run_xtl, "transformers": run_transformers}
        runs: dict[str, list[SideResult]] = {name: [] for name in sides}
        for i in range(args.rounds):
            for name in sides if i % 2 == 0 else reversed(sides):
                runs[name].append(_in_child(sides[name], cfg))
                if args.rounds > 1:
                    print(_line(runs[name][-1], f"{name} #{i + 1}"), flush=True)
        elapsed = time.perf_counter() - start

    xtl, hf = (_best(runs[name]) for name in sides)
    if args.rounds > 1:
        print(f"best of {args.rounds} runs per side (peak RSS: largest):")
    print(_line(xtl))
    print(_line(hf))
    ratio = xtl.useful_tok_s / max(hf.useful_tok_s, 1e-9)
    cpu_ratio = xtl.useful_tok_cpu_s / max(hf.useful_tok_cpu_s, 1e-9)
    print(
        f"ratio xtl/transformers useful tok/s = {ratio:.2f} (target >= {TARGET_RATIO}); per CPU second: "
        f"{cpu_ratio:.2f}"
    )
    mem = xtl.peak_rss_bytes / max(hf.peak_rss_bytes, 1)
    verdict = "PASS" if ratio >= TARGET_RATIO else "FAIL"
    print(
        f"verdict: {verdict}: xtl trains {ratio:.2f}x the useful tokens/s of pad-to-longest transformers.Trainer "
        f"(fill {xtl.fill:.2f} vs {hf.fill:.2f}) at {mem:.2f}x its peak RSS"
    )
    print(
        f"(total {elapsed:.0f} s; load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after; parent "
        f"peak RSS {_gib(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)})"
    )


def _best(runs: list[SideResult]) -> SideResult:
    """The fastest run, carrying the largest peak memory of all runs."""
    best = max(runs, key=lambda r: r.useful_tok_s)
    return replace(
        best,
        peak_rss_bytes=max(r.peak_rss_bytes for r in runs),
        vm_hwm_bytes=max(r.vm_hwm_bytes for r in runs),
    )


if __name__ == "__main__":
    main()
