"""Training throughput and peak memory of xtl vs a transformers ``Trainer``, each side in its own process.

Usage::

    python benchmarks/train_step.py [--recipe tiny --steps 51 --pairs 5 --warmup 1 --threads 1
                                     --precision auto --hf-sampling group_by_length --hf-accum 1]
    python benchmarks/train_step.py --recipe synthetic [--steps 21 --hidden 256 --layers 4 --samples 1000
                                                        --pack 2048]

Method:

1. Recipes. ``tiny`` (default) is exactly ``configs/tiny_sft.yaml``: its model (Qwen3, vocab 1600, hidden 128,
   4 layers, 4 heads, 2 kv heads, head_dim 32, tied embeddings, from scratch with seed 0), its data
   (``tiny:sft_train.jsonl``, ``qwen3`` template, embedded tokenizer, best-fit packs of 512 tokens, 2 packs per
   step) and its trainer, optimizer and schedule. ``synthetic`` keeps the recipe's trainer and optimizer but
   trains a larger Qwen3 (``--hidden``/``--layers``, loaded from a saved HF directory) on a generated chat SFT
   mix with a long-tailed length distribution (log-normal, median ~``--median`` tokens, clipped to 32..1024, 20%
   two-turn) in packs of ``--pack`` tokens, one pack per step.
2. Setup (one spawned child; nothing in it is timed): the recipe is parsed by xtl's own CLI classes, xtl's
   tokenization cache is built (warm for every xtl run), the model's initial weights are saved as an HF
   directory (both sides start from the same weights), and the same JSONL is tokenized for transformers with
   the tokenizer's chat template in one batched ``datasets.map``, truncated to the pack length as xtl truncates
   overlong samples, and saved to disk (warm for every transformers run). The transformers batch size is
   ``round(xtl useful tokens per step / transformers mean sample length)`` so both sides see about the same
   number of useful tokens per optimizer step. transformers' length-grouped sampler serves megabatches of 50
   batches longest first, so its tokens per step match xtl's only over whole megabatches: the tiny default of
   51 steps times 50 (a note is printed otherwise).
3. xtl (own spawned child per run): the ``xtl fit`` objects (``XTLCLI(..., run=False)`` on the recipe with
   ``--trainer.max_steps``, ``--trainer.precision``, a fresh temporary ``default_root_dir``, the warm cache dir
   and the progress bar off), then ``trainer.fit`` -- what ``xtl fit`` runs, CSV logging every step included.
   Each child imports only what its side uses (the xtl child never imports ``datasets``: it would add ~80 MiB
   to its RSS).
4. transformers (own spawned child per run): ``AutoModelForCausalLM`` (SDPA) from the saved weights,
   ``transformers.Trainer`` on CPU with ``train_sampling_strategy=group_by_length`` (its length-grouped
   sampler), ``bf16=True`` when xtl runs ``bf16-mixed`` (accelerate's CPU autocast), fused AdamW, the recipe's
   learning rate, schedule and clipping, pad-to-longest batches (``DataCollatorForSeq2Seq``, labels padded with
   -100), ``labels = input_ids``, no logging, no saving.
5. Measured in each run: the clock runs from the end of step 1 (warm-up, excluded) to the end of the last step;
   useful tokens are the non-padding tokens of steps 2..N (``MicroBatch.num_real_tokens``; the collated
   ``attention_mask.sum()``), processed tokens include padding (``fill`` = useful / processed). Peak RSS is the
   child's ``VmHWM`` (its own address space; a spawned child's ``ru_maxrss`` would start from its parent's peak).
   Where the time goes, per step: forward (hooks on the model; xtl's fused head + loss computes its gradients
   here), backward (``torch.Tensor.backward``, wrapped), optimizer step (torch's global optimizer step hooks),
   the rest of the step body (train-batch start to end hooks: clipping, zero-grad, scheduler, logging) and the
   time between steps (data loading, loop and callback overhead). Whether forward ran under autocast (and its
   dtype) is recorded from inside the model.
6. Protocol (``benchmarks/_paired.py``): threads pinned in every child (``--threads``, default 1), ``--warmup``
   untimed pairs of runs, then ``--pairs`` (>= 5) timed pairs whose order alternates (xtl first, then
   transformers first, ...). Printed: both configurations, every pair, the median ratio xtl/transformers with
   its min..max for useful tokens/s, for useful tokens per CPU second (process CPU time: with one thread it
   barely moves when a shared machine deschedules a run, where wall-clock tokens/s can halve) and for peak
   RSS, the median breakdown per side, and the acceptance check (tiny, bf16: useful tokens/s >= 1.3x at peak
   RSS <= 0.6x).

The parent process stays stdlib-only (its children do all the work).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import multiprocessing
import random
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _paired import PairedResult, add_protocol_args, load_average, pin_threads, print_configs, run_pairs

ROOT = Path(__file__).resolve().parents[1]
TINY_RECIPE = ROOT / "configs" / "tiny_sft.yaml"
TARGET_SPEED, TARGET_MEMORY = 1.3, 0.6
DEFAULT_STEPS = {"tiny": 51, "synthetic": 21}
HF_MEGABATCH = 50  # transformers' LengthGroupedSampler sorts megabatches of 50 batches, longest batch first
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
    """Everything a child process needs (picklable); ``prepare`` fills the fields after ``xtl_args``."""

    recipe: str
    work_dir: str
    steps: int
    threads: int
    precision: str
    seed: int
    hf_sampling: str
    hf_accum: int
    hf_batch: int
    xtl_args: list[str] = field(default_factory=list)
    hidden: int = 0
    layers: int = 0
    hf_dir: str = ""
    hf_data: str = ""
    tokenizer: str = ""
    hf: dict[str, Any] = field(default_factory=dict)


@dataclass
class SideResult:
    """Throughput, time breakdown and memory of one run of one side, measured in its own child process."""

    name: str
    useful_tokens: int
    processed_tokens: int
    seconds: float
    cpu_seconds: float
    steps_timed: int
    in_step_seconds: float
    parts: dict[str, float]
    peak_rss_bytes: int
    threads: int
    autocast: str

    @property
    def useful_tok_s(self) -> float:
        """Non-padding tokens per second over the timed steps."""
        return self.useful_tokens / max(self.seconds, 1e-9)

    @property
    def useful_tok_cpu_s(self) -> float:
        """Non-padding tokens per CPU second of the process (all threads; less sensitive to descheduling)."""
        return self.useful_tokens / max(self.cpu_seconds, 1e-9)

    @property
    def fill(self) -> float:
        """Useful / processed tokens."""
        return self.useful_tokens / max(self.processed_tokens, 1)

    def per_step_ms(self) -> dict[str, float]:
        """Milliseconds per timed step: total, forward, backward, optimizer, the rest of the step body (clipping,
        zero-grad, scheduler, logging, hooks) and the time between steps (data loading, loop overhead)."""
        n = max(self.steps_timed, 1) / 1e3
        rest = self.in_step_seconds - sum(self.parts.values())
        return {
            "step": self.seconds / n,
            **{k: v / n for k, v in self.parts.items()},
            "rest of body": rest / n,
            "between steps": (self.seconds - self.in_step_seconds) / n,
        }


# ---- synthetic data (stdlib only) --------------------------------------------------------------------------------


def write_sft_mix(path: Path, samples: int, seed: int, median: float, sigma: float) -> None:
    """Write ``samples`` chat records whose rendered lengths follow a clipped log-normal."""
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


def xtl_args(cfg: BenchConfig, data: Path | None, pack: int) -> list[str]:
    """The ``xtl fit`` arguments of a run: the tiny recipe, plus the synthetic overrides."""
    work = Path(cfg.work_dir)
    args = [
        "--config",
        str(TINY_RECIPE),
        f"--trainer.max_steps={cfg.steps}",
        f"--trainer.precision={cfg.precision}",
        f"--trainer.default_root_dir={work / 'xtl_prepare'}",  # each run overrides it with a fresh folder
        "--trainer.enable_progress_bar=false",
        f"--data.cache_dir={work / 'xtl_cache'}",
        "--data.progress=false",
    ]
    if data is not None:
        args += [
            f"--model.init_args.model={work / 'hf_model'}",
            "--data.sources=" + json.dumps([{"path": str(data), "kind": "chat"}]),
            "--data.val_sources=null",
            "--data.test_sources=null",
            f"--data.pack_max_length={pack}",
            "--data.micro_batches_per_step=1",
        ]
    return args


# ---- children ----------------------------------------------------------------------------------------------------


def _child_setup(threads: int, uses_datasets: bool = True) -> None:
    """Pin threads and silence progress bars, info logs and known-harmless warnings in a child.

    ``uses_datasets=False`` leaves the ``datasets`` library unimported (it would add to the xtl child's RSS).
    """
    import logging
    import sys
    import warnings

    sys.argv = sys.argv[:1]  # the parent's arguments are not the child's (LightningCLI would warn about them)
    pin_threads(threads)
    import lightning.pytorch  # noqa: F401 - it sets its loggers to INFO on import: quiet them afterwards
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if uses_datasets:
        import datasets

        datasets.disable_progress_bars()
    for name in ("lightning.pytorch", "lightning.fabric", "xtl"):
        logging.getLogger(name).setLevel(logging.WARNING)
    for message in (".*does not have many workers.*", ".*across ranks is zero.*", ".*LeafSpec.*is deprecated.*"):
        warnings.filterwarnings("ignore", message=message)


def prepare(cfg: BenchConfig) -> dict[str, Any]:
    """Parse the recipe with xtl's CLI, warm xtl's cache, save initial weights and the transformers dataset."""
    _child_setup(cfg.threads)
    import torch
    from datasets import load_dataset
    from transformers import AutoTokenizer

    from xtl.cli import XTLCLI
    from xtl.utils import resolve_path

    work = Path(cfg.work_dir)
    hf_dir = work / "hf_model"
    if cfg.recipe == "synthetic":  # before the CLI: the recipe's model is this directory
        _save_synthetic_model(cfg, hf_dir)
    cli = XTLCLI(args=cfg.xtl_args, run=False)
    dm, module = cli.datamodule, cli.model
    dm.prepare_data()
    dm.setup()
    report = dm.train_split.plan.report()
    if cfg.recipe == "tiny":  # the recipe's from-scratch model, initialized as LanguageModule initializes it
        model = module.model_config.build()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(module.hparams.seed)
            model.init_weights()
        model.save_hf(hf_dir)
    tokenizer_dir = str(Path(dm.load_tokenizer().name_or_path))
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    pack = dm.pack_max_length

    def tokenize(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        full = tokenizer.apply_chat_template(batch["messages"], tokenize=True, return_dict=False)
        ids = [x[:pack] for x in full]
        return {
            "input_ids": ids,
            "attention_mask": [[1] * len(x) for x in ids],
            "labels": ids,
            "length": [len(x) for x in ids],
            "cut": [len(x) - pack if len(x) > pack else 0 for x in full],
        }

    sources = [resolve_path(spec.path) for spec in dm.sources]
    raw = load_dataset("json", data_files=sources, split="train", cache_dir=str(work / "hf_datasets_cache"))
    dataset = raw.map(tokenize, batched=True, remove_columns=raw.column_names)
    lengths, cut = dataset["length"], dataset["cut"]
    dataset.remove_columns(["cut"]).save_to_disk(str(work / "hf_data"))
    xtl_tokens_per_step = report["tokens"] / report["packs"] * dm.micro_batches_per_step
    mean = statistics.fmean(lengths)
    optimizer, schedule = module.optimizer_config, module.schedule
    return {
        "hf_dir": str(hf_dir),
        "hf_data": str(work / "hf_data"),
        "tokenizer": tokenizer_dir,
        "hf": {
            "lr": optimizer.lr,
            "weight_decay": optimizer.weight_decay,
            "betas": list(optimizer.betas),
            "eps": optimizer.eps,
            "warmup_steps": schedule.warmup_steps,
            "schedule": schedule.kind,
            "min_lr_ratio": schedule.min_lr_ratio,
            "max_grad_norm": module.hparams.max_grad_norm,
            "max_length": pack,
        },
        "model": _describe(module.model_config),
        "params": sum(p.numel() for p in module.model_config.build().parameters()),
        "pack": pack,
        "micro_batches": dm.micro_batches_per_step,
        "sampler": dm.sampler_order,
        "template": dm.template,
        "overlong": dm.overlong,
        "sources": sources,
        "xtl_report": report,
        "xtl_tokens_per_step": xtl_tokens_per_step,
        "hf_samples": len(lengths),
        "hf_tokens": sum(lengths),
        "hf_mean": mean,
        "hf_median": statistics.median(lengths),
        "hf_max": max(lengths),
        "hf_cut_samples": sum(1 for c in cut if c),
        "hf_cut_tokens": sum(cut),
        "hf_batch": cfg.hf_batch or max(1, round(xtl_tokens_per_step / mean / cfg.hf_accum)),
    }


def _save_synthetic_model(cfg: BenchConfig, hf_dir: Path) -> None:
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from xtl.data import tiny_assets_dir

    tokenizer = AutoTokenizer.from_pretrained(tiny_assets_dir())

    heads = max(1, cfg.hidden // 64)
    config = Qwen3Config(
        vocab_size=1600,
        hidden_size=cfg.hidden,
        intermediate_size=3 * cfg.hidden,
        num_hidden_layers=cfg.layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(cfg.seed)
    Qwen3ForCausalLM(config).save_pretrained(hf_dir)


def _describe(config: Any) -> str:
    return (
        f"{config.model_type}: vocab {config.vocab_size}, hidden {config.hidden_size}, intermediate "
        f"{config.intermediate_size}, {config.num_hidden_layers} layers, heads {config.num_attention_heads}/kv "
        f"{config.num_key_value_heads}, head_dim {config.resolved_head_dim}, tied {config.tie_word_embeddings}, "
        f"attn_impl {config.attn_impl}"
    )


class StepTimer:
    """Step marks and the time spent in forward (model hooks), backward and the optimizer step.

    Backward is timed by wrapping ``torch.Tensor.backward`` (Lightning's ``manual_backward`` and accelerate's
    ``backward`` both end there), the optimizer step by torch's global optimizer step hooks.
    """

    PARTS = ("forward", "backward", "optimizer")

    def __init__(self) -> None:
        import torch
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self.marks: list[tuple[float, float, float, dict[str, float], int, int]] = []
        self.spent = dict.fromkeys(self.PARTS, 0.0)
        self.autocast = "not seen"
        self._start = 0.0
        self._started: dict[str, float] = {}
        register_optimizer_step_pre_hook(lambda *_: self._begin("optimizer"))
        register_optimizer_step_post_hook(lambda *_: self._end("optimizer"))
        backward = torch.Tensor.backward

        def timed_backward(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            self._begin("backward")
            backward(tensor, *args, **kwargs)
            self._end("backward")

        torch.Tensor.backward = timed_backward

    def watch(self, model: Any) -> None:
        """Time every forward of ``model``; record whether its first linear layer runs under CPU autocast.

        The autocast check sits inside the model: accelerate enters autocast inside a wrapped ``forward``, after
        the model's own forward hooks have run.
        """
        import torch

        model.register_forward_pre_hook(lambda *_: self._begin("forward"))
        model.register_forward_hook(lambda *_: self._end("forward"))
        linear = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
        linear.register_forward_pre_hook(self._autocast_state)

    def step_start(self) -> None:
        """Mark the start of an optimizer step's body."""
        self._start = time.perf_counter()

    def step_end(self, useful: int, processed: int) -> None:
        """Mark the end of an optimizer step with its useful and processed tokens."""
        now = time.perf_counter()
        self.marks.append((self._start, now, time.process_time(), dict(self.spent), useful, processed))

    def result(self, name: str) -> SideResult:
        """Sum steps 2..N (step 1 is warm-up) and read this process's peak RSS."""
        import torch

        if len(self.marks) < 2:
            raise RuntimeError(f"{name}: only {len(self.marks)} step(s) ran; need at least 2 (step 1 is warm-up)")
        first, last, timed = self.marks[0], self.marks[-1], self.marks[1:]
        return SideResult(
            name=name,
            useful_tokens=sum(m[4] for m in timed),
            processed_tokens=sum(m[5] for m in timed),
            seconds=last[1] - first[1],
            cpu_seconds=last[2] - first[2],
            steps_timed=len(timed),
            in_step_seconds=sum(m[1] - m[0] for m in timed),
            parts={part: last[3][part] - first[3][part] for part in self.PARTS},
            peak_rss_bytes=_vm_hwm(),
            threads=torch.get_num_threads(),
            autocast=self.autocast,
        )

    def _begin(self, part: str) -> None:
        self._started[part] = time.perf_counter()

    def _end(self, part: str) -> None:
        self.spent[part] += time.perf_counter() - self._started.pop(part)

    def _autocast_state(self, *args: Any) -> None:
        import torch

        on = torch.is_autocast_enabled("cpu")
        self.autocast = str(torch.get_autocast_dtype("cpu")).removeprefix("torch.") if on else "off"


def _vm_hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmHWM (peak memory needs Linux)")


def run_xtl(cfg: BenchConfig) -> SideResult:
    """Build the ``xtl fit`` objects of the recipe, add a step clock, train ``cfg.steps`` steps."""
    _child_setup(cfg.threads, uses_datasets=False)
    import lightning.pytorch as pl

    from xtl.cli import XTLCLI

    timer = StepTimer()

    class Clock(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            timer.watch(module.model)

        def on_train_batch_start(self, *args: Any) -> None:
            timer.step_start()

        def on_train_batch_end(
            self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any, *_
        ) -> None:
            timer.step_end(sum(mb.num_real_tokens for mb in batch), sum(mb.seq_ctx.seq_len for mb in batch))

    root = tempfile.mkdtemp(prefix="xtl_run_", dir=cfg.work_dir)  # a fresh run folder (logs, checkpoints) per run
    with contextlib.redirect_stdout(io.StringIO()):  # the data summary line every run prints
        cli = XTLCLI(args=[*cfg.xtl_args, f"--trainer.default_root_dir={root}"], run=False)
        cli.trainer.callbacks.append(Clock())
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return timer.result("xtl")


def run_transformers(cfg: BenchConfig) -> SideResult:
    """Train with ``transformers.Trainer`` on pad-to-longest batches of the saved dataset."""
    _child_setup(cfg.threads)
    import torch
    from datasets import load_from_disk
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
    padder = DataCollatorForSeq2Seq(tokenizer, padding="longest", label_pad_token_id=-100, return_tensors="pt")
    counts: list[tuple[int, int]] = []

    def collate(features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = padder(features)
        mask = batch["attention_mask"]
        counts.append((int(mask.sum()), mask.numel()))
        return batch

    timer = StepTimer()

    class Clock(TrainerCallback):
        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            timer.step_start()

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            done = counts[len(timer.marks) * cfg.hf_accum : (len(timer.marks) + 1) * cfg.hf_accum]
            timer.step_end(sum(c[0] for c in done), sum(c[1] for c in done))

    hf = cfg.hf
    model = AutoModelForCausalLM.from_pretrained(cfg.hf_dir, attn_implementation="sdpa", dtype=torch.float32)
    timer.watch(model)
    schedule = {"cosine": "cosine_with_min_lr", "linear": "linear", "constant": "constant_with_warmup"}
    args = TrainingArguments(
        output_dir=str(Path(cfg.work_dir) / "hf_out"),
        per_device_train_batch_size=cfg.hf_batch,
        gradient_accumulation_steps=cfg.hf_accum,
        max_steps=cfg.steps,
        learning_rate=hf["lr"],
        weight_decay=hf["weight_decay"],
        adam_beta1=hf["betas"][0],
        adam_beta2=hf["betas"][1],
        adam_epsilon=hf["eps"],
        optim="adamw_torch_fused",
        lr_scheduler_type=schedule.get(hf["schedule"], "linear"),
        lr_scheduler_kwargs={"min_lr_rate": hf["min_lr_ratio"]} if hf["schedule"] == "cosine" else {},
        warmup_steps=hf["warmup_steps"],
        max_grad_norm=hf["max_grad_norm"],
        bf16=cfg.precision == "bf16-mixed",
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=cfg.seed,
        train_sampling_strategy=cfg.hf_sampling,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=load_from_disk(cfg.hf_data),
        data_collator=collate,
        processing_class=tokenizer,
        callbacks=[Clock()],
    )
    trainer.remove_callback(PrinterCallback)  # it prints the final metrics dict even with logging_strategy="no"
    trainer.train()
    return timer.result("transformers")


def _in_child(fn: Any, cfg: BenchConfig) -> Any:
    """Run ``fn(cfg)`` in a fresh spawned process and return its result."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, cfg).result()


# ---- main --------------------------------------------------------------------------------------------------------


def _cpu_has_bf16() -> bool:
    """Whether the CPU has native bf16 matmul instructions (``avx512_bf16`` or ``amx_bf16``), read from cpuinfo."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"


def _run_line(label: str, r: SideResult) -> str:
    return (
        f"  {label:13s} {r.useful_tok_s:7.0f} useful tok/s, fill {r.fill:.3f}, peak RSS {_mib(r.peak_rss_bytes)}, "
        f"{r.steps_timed} steps in {r.seconds:.2f} s ({r.cpu_seconds:.1f} CPU s), {r.threads} thread(s), "
        f"autocast {r.autocast}"
    )


def _breakdown(name: str, runs: list[SideResult]) -> str:
    parts = {key: statistics.median(r.per_step_ms()[key] for r in runs) for key in runs[0].per_step_ms()}
    useful = statistics.median(r.useful_tokens / r.steps_timed for r in runs)
    processed = statistics.median(r.processed_tokens / r.steps_timed for r in runs)
    step = parts["step"]
    shares = ", ".join(f"{k} {v:.1f} ms ({v / step:.0%})" for k, v in parts.items() if k != "step")
    return (
        f"{name:12s}: {step:.1f} ms/step = {shares} | tokens/step: {useful:.0f} useful of {processed:.0f} processed "
        f"(fill {useful / processed:.3f})"
    )


def main() -> None:
    """Parse arguments, prepare data and weights, run the pairs of child processes, print the comparison."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_protocol_args(parser, pairs=5, warmup=1)
    parser.add_argument("--recipe", default="tiny", choices=["tiny", "synthetic"])
    parser.add_argument(
        "--steps", type=int, default=0, help="optimizer steps per run, the first excluded (0: per recipe)"
    )
    parser.add_argument("--precision", default="auto", choices=["auto", "bf16-mixed", "32-true"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--hf-sampling", default="group_by_length", choices=["group_by_length", "random", "sequential"]
    )
    parser.add_argument("--hf-accum", type=int, default=1, help="transformers gradient accumulation steps")
    parser.add_argument("--hf-batch", type=int, default=0, help="transformers batch size (0: matched useful tokens)")
    synthetic = parser.add_argument_group("synthetic recipe")
    synthetic.add_argument("--hidden", type=int, default=256, help="hidden size (heads = hidden/64, head_dim 64)")
    synthetic.add_argument("--layers", type=int, default=4)
    synthetic.add_argument("--samples", type=int, default=1000, help="SFT records to generate")
    synthetic.add_argument("--median", type=float, default=150.0, help="median sample length in tokens")
    synthetic.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma of sample lengths")
    synthetic.add_argument("--pack", type=int, default=2048, help="xtl pack length (tokens per step)")
    args = parser.parse_args()
    steps = args.steps or DEFAULT_STEPS[args.recipe]
    if steps < 2:
        parser.error("--steps must be >= 2 (step 1 is excluded as warm-up)")
    precision = args.precision if args.precision != "auto" else ("bf16-mixed" if _cpu_has_bf16() else "32-true")
    print(f"load average before: {load_average()}")
    start = time.perf_counter()

    with tempfile.TemporaryDirectory(prefix="xtl-train-bench-") as tmp:
        work = Path(tmp)
        cfg = BenchConfig(
            recipe=args.recipe,
            work_dir=str(work),
            steps=steps,
            threads=args.threads,
            precision=precision,
            seed=args.seed,
            hf_sampling=args.hf_sampling,
            hf_accum=args.hf_accum,
            hf_batch=args.hf_batch,
            hidden=args.hidden,
            layers=args.layers,
        )
        data = None
        if args.recipe == "synthetic":
            data = work / "sft_mix.jsonl"
            write_sft_mix(data, args.samples, args.seed, args.median, args.sigma)
        cfg.xtl_args = xtl_args(cfg, data, args.pack)
        info = _in_child(prepare, cfg)
        for key in ("hf_dir", "hf_data", "tokenizer", "hf", "hf_batch"):
            setattr(cfg, key, info[key])
        _print_setup(cfg, info)

        runs: dict[str, list[SideResult]] = {"xtl": [], "transformers": []}

        def side(name: str, fn: Any) -> Any:
            def run() -> float:
                runs[name].append(_in_child(fn, cfg))
                return runs[name][-1].useful_tok_s

            return run

        def on_pair(i: int, a: float, b: float) -> None:
            x, h = runs["xtl"][-1], runs["transformers"][-1]
            print(f"pair {i + 1} ({'xtl' if (args.warmup + i) % 2 == 0 else 'transformers'} first):", flush=True)
            print(_run_line("xtl", x))
            print(_run_line("transformers", h), flush=True)

        speed = run_pairs(
            side("xtl", run_xtl),
            side("transformers", run_transformers),
            args.pairs,
            args.warmup,
            metric="useful tokens/s",
            higher_is_better=True,
            on_pair=on_pair,
        )
    timed = {name: results[args.warmup :] for name, results in runs.items()}
    cpu = PairedResult(
        "useful tokens per CPU second",
        a=[r.useful_tok_cpu_s for r in timed["xtl"]],
        b=[r.useful_tok_cpu_s for r in timed["transformers"]],
        higher_is_better=True,
    )
    memory = PairedResult(
        "peak RSS MiB",
        a=[r.peak_rss_bytes / 2**20 for r in timed["xtl"]],
        b=[r.peak_rss_bytes / 2**20 for r in timed["transformers"]],
    )
    print(f"\nresults ({args.pairs} timed pairs after {args.warmup} warm-up pair(s), order alternating):")
    print(speed.summary("xtl", "transformers"))
    print(cpu.summary("xtl", "transformers"))
    print(memory.summary("xtl", "transformers"))
    print("where the time goes (median per timed step):")
    for name, results in timed.items():
        print(_breakdown(name, results))
    ratio, mem = statistics.median(speed.ratios), statistics.median(memory.ratios)
    if args.recipe == "tiny" and precision == "bf16-mixed":
        reached = ratio >= TARGET_SPEED and mem <= TARGET_MEMORY
        print(
            f"acceptance (tiny, bf16): useful tok/s {ratio:.2f}x (>= {TARGET_SPEED}) at peak RSS {mem:.2f}x "
            f"(<= {TARGET_MEMORY}): {'reached' if reached else 'NOT reached'}"
        )
    print(f"total {time.perf_counter() - start:.0f} s; load average after: {load_average()}")


def _print_setup(cfg: BenchConfig, info: dict[str, Any]) -> None:
    report, hf = info["xtl_report"], cfg.hf
    xtl_cut = f"{report['truncated_overlong']} samples truncated ({report['truncated_tokens']} tokens cut)"
    if report["dropped_overlong"]:
        xtl_cut += f", {report['dropped_overlong']} dropped"
    precision = "bf16-mixed (fp32 weights, CPU autocast bf16)" if cfg.precision == "bf16-mixed" else "fp32"
    hf_tokens_per_step = cfg.hf_batch * cfg.hf_accum * info["hf_mean"]
    print(f"recipe {cfg.recipe}: model {info['model']}, {info['params'] / 1e6:.2f}M params")
    print(
        f"data: {', '.join(info['sources'])} | xtl: {report['documents']} documents, {report['tokens']} tokens | "
        f"transformers: {info['hf_samples']} samples, {info['hf_tokens']} tokens (mean {info['hf_mean']:.1f}, "
        f"median {info['hf_median']:.0f}, max {info['hf_max']})"
    )
    print(f"{cfg.steps} steps per run (step 1 excluded), threads {cfg.threads} per child")
    if cfg.hf_sampling == "group_by_length" and (cfg.steps - 1) % HF_MEGABATCH:
        print(
            f"note: transformers' length-grouped sampler serves each megabatch of {HF_MEGABATCH} batches longest "
            f"first; {cfg.steps - 1} timed steps are not whole megabatches, so its tokens/step are biased (use "
            f"--steps {HF_MEGABATCH * max(1, round((cfg.steps - 1) / HF_MEGABATCH)) + 1})"
        )
    print_configs(
        xtl={
            "runs": f"xtl fit --config {TINY_RECIPE.relative_to(ROOT)} " + " ".join(cfg.xtl_args[2:]),
            "precision": precision,
            "batch": f"{info['micro_batches']} packs x {info['pack']} tokens per step "
            f"(~{info['xtl_tokens_per_step']:.0f} useful tokens)",
            "ordering": f"{info['sampler']} pack order",
            "packing": f"best-fit, plan fill {report['fill_ratio']:.3f}, packs padded to {info['pack']} [xtl-only]",
            "truncation": f"overlong {info['overlong']} at {info['pack']}: {xtl_cut}",
            "template": info["template"],
            "attention": "sdpa per document",
            "head+loss": "fused chunked LM head + CE, no logits materialized [xtl-only]",
            "loss tokens": "assistant turns",
            "optimizer": f"fused AdamW lr {hf['lr']}, wd {hf['weight_decay']}, clip {hf['max_grad_norm']}",
            "logging": "CSVLogger every step (recipe)",
        },
        transformers={
            "runs": "transformers.Trainer (use_cpu=True)",
            "precision": "bf16=True (accelerate CPU autocast bf16, fp32 weights)"
            if cfg.precision == "bf16-mixed"
            else "fp32",
            "batch": f"{cfg.hf_batch} samples x {cfg.hf_accum} accumulation per step "
            f"(~{hf_tokens_per_step:.0f} useful tokens)",
            "ordering": f"train_sampling_strategy={cfg.hf_sampling}",
            "packing": "none: pad to longest in batch (DataCollatorForSeq2Seq)",
            "truncation": f"{hf['max_length']} tokens: {info['hf_cut_samples']} samples truncated "
            f"({info['hf_cut_tokens']} tokens cut)",
            "template": "tokenizer chat template, batched datasets.map",
            "attention": "sdpa",
            "head+loss": "full logits, ForCausalLMLoss",
            "loss tokens": "all tokens (labels = input_ids)",
            "optimizer": f"adamw_torch_fused lr {hf['lr']}, wd {hf['weight_decay']}, clip {hf['max_grad_norm']}",
            "logging": "none",
        },
    )


if __name__ == "__main__":
    main()
