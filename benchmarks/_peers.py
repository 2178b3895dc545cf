"""Plumbing the side-by-side training benchmarks share: child processes, the step clock, the peers' optimizer.

Each benchmark side runs in its own spawned process (:func:`in_child`, :func:`child_setup`); :class:`StepTimer`
marks its steps and times forward, backward and the optimizer step inside it, giving a :class:`SideResult`. The
peers (transformers / TRL trainers) get xtl's optimizer and schedule (:func:`peer_optimizers`, copies of xtl's
parameter groups and learning-rate factor that the benchmarks' setup asserts equal to xtl's) and the
``TrainingArguments`` every peer shares with each speed setting explicit (:func:`peer_args`).
"""

from __future__ import annotations

import math
import multiprocessing
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _paired import pin_threads

WORDS = (
    "apple river stone cloud tiger lemon pencil garden rocket candle mirror forest window silver planet "
    "orange bridge winter summer dragon castle butter marble rabbit violin coffee desert island jungle "
    "meadow ocean puzzle shadow thunder valley wizard yellow zebra anchor breeze copper dolphin falcon"
).split()


@dataclass
class SideResult:
    """Throughput, time breakdown and memory of one run of one side, measured in its own child process."""

    name: str
    useful_tokens: int
    processed_tokens: int
    scored_tokens: int
    seconds: float
    cpu_seconds: float
    steps_timed: int
    in_step_seconds: float
    parts: dict[str, float]
    peak_rss_bytes: int
    threads: int
    autocast: str
    first_step_seconds: float = 0.0
    recompiles: int | None = None

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


def child_setup(threads: int, uses_datasets: bool = True, uses_lightning: bool = True) -> None:
    """Pin threads and silence progress bars, info logs and known-harmless warnings in a child.

    ``uses_datasets=False`` leaves the ``datasets`` library unimported (it would add to the xtl child's RSS),
    ``uses_lightning=False`` leaves Lightning unimported (the peers' RSS).
    """
    import logging
    import sys
    import warnings

    sys.argv = sys.argv[:1]  # the parent's arguments are not the child's (LightningCLI would warn about them)
    pin_threads(threads)
    if uses_lightning:
        import lightning.pytorch  # noqa: F401 - it sets its loggers to INFO on import: quiet them afterwards
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if uses_datasets:
        import datasets

        datasets.disable_progress_bars()
    for name in ("lightning.pytorch", "lightning.fabric", "xtl", "trl"):
        logging.getLogger(name).setLevel(logging.ERROR if name == "trl" else logging.WARNING)
    for message in (".*does not have many workers.*", ".*across ranks is zero.*", ".*LeafSpec.*is deprecated.*"):
        warnings.filterwarnings("ignore", message=message)


def describe(config: Any) -> str:
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

        self.marks: list[tuple[float, float, float, dict[str, float], int, int, int]] = []
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

    def step_end(self, useful: int, processed: int, scored: int) -> None:
        """Mark the end of an optimizer step with its useful, processed and scored (supervised) tokens."""
        now = time.perf_counter()
        self.marks.append((self._start, now, time.process_time(), dict(self.spent), useful, processed, scored))

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
            scored_tokens=sum(m[6] for m in timed),
            seconds=last[1] - first[1],
            cpu_seconds=last[2] - first[2],
            steps_timed=len(timed),
            in_step_seconds=sum(m[1] - m[0] for m in timed),
            parts={part: last[3][part] - first[3][part] for part in self.PARTS},
            peak_rss_bytes=vm_hwm(),
            threads=torch.get_num_threads(),
            autocast=self.autocast,
            first_step_seconds=first[1] - first[0],
        )

    def _begin(self, part: str) -> None:
        self._started[part] = time.perf_counter()

    def _end(self, part: str) -> None:
        self.spent[part] += time.perf_counter() - self._started.pop(part)

    def _autocast_state(self, *args: Any) -> None:
        import torch

        on = torch.is_autocast_enabled("cpu")
        self.autocast = str(torch.get_autocast_dtype("cpu")).removeprefix("torch.") if on else "off"


def vm_hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmHWM (peak memory needs Linux)")


def lr_factor(kind: str, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> Any:
    """A copy of ``xtl.train.optim.lr_lambda`` (the peers never import xtl; setup asserts the two are equal)."""

    def factor(step: int) -> float:
        if warmup_steps > 0 and step < warmup_steps:
            return (step + 1) / warmup_steps
        if kind == "constant":
            return 1.0
        decay_steps = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / decay_steps)
        shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if kind == "cosine" else 1.0 - progress
        return min_lr_ratio + (1.0 - min_lr_ratio) * shape

    return factor


def peer_param_groups(model: Any, weight_decay: float, no_decay_norm_bias_embed: bool) -> list[dict[str, Any]]:
    """A copy of ``xtl.train.optim.param_groups``: no decay on norms, biases and embeddings (setup asserts it)."""
    import torch

    no_decay = set()
    if no_decay_norm_bias_embed:
        for module in model.modules():
            for name, param in module.named_parameters(recurse=False):
                embedding = isinstance(module, torch.nn.Embedding)
                if embedding or "norm" in type(module).__name__.lower() or name.endswith("bias"):
                    no_decay.add(id(param))
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if id(p) not in no_decay], "weight_decay": weight_decay}]
    if any(id(p) in no_decay for p in params):
        groups.append({"params": [p for p in params if id(p) in no_decay], "weight_decay": 0.0})
    return groups


def optimizer_hparams(module: Any, steps: int) -> dict[str, Any]:
    """The optimizer, schedule and clipping settings of xtl's parsed recipe that :func:`peer_optimizers` and
    :func:`peer_args` read (``steps``: the schedule's length when the recipe sets no ``decay_steps``, as
    ``LanguageModule`` does for its run)."""
    optimizer, schedule = module.optimizer_config, module.schedule
    return {
        "lr": optimizer.lr,
        "weight_decay": optimizer.weight_decay,
        "no_decay_norm_bias_embed": optimizer.no_decay_norm_bias_embed,
        "betas": list(optimizer.betas),
        "eps": optimizer.eps,
        "warmup_steps": schedule.warmup_steps,
        "schedule": schedule.kind,
        "min_lr_ratio": schedule.min_lr_ratio,
        "total_steps": int(schedule.decay_steps or steps),
        "max_grad_norm": module.hparams.max_grad_norm,
    }


def peer_optimizers(model: Any, hf: dict[str, Any]) -> tuple[Any, Any]:
    """xtl's optimizer and schedule for a peer: fused AdamW over xtl's groups, xtl's warmup + decay as LambdaLR."""
    import torch

    groups = peer_param_groups(model, hf["weight_decay"], hf["no_decay_norm_bias_embed"])
    optimizer = torch.optim.AdamW(groups, lr=hf["lr"], betas=tuple(hf["betas"]), eps=hf["eps"], fused=True)
    factor = lr_factor(hf["schedule"], hf["warmup_steps"], hf["total_steps"], hf["min_lr_ratio"])
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def peer_args(cfg: Any, name: str) -> dict[str, Any]:
    """``TrainingArguments`` both peers share, every setting that changes speed set explicitly (the optimizer and
    schedule are passed as objects; batch size, accumulation and sampler are per peer)."""
    hf = cfg.hf
    return {
        "output_dir": str(Path(cfg.work_dir) / f"{name}_out"),
        "max_steps": cfg.steps,
        "learning_rate": hf["lr"],
        "weight_decay": hf["weight_decay"],
        "adam_beta1": hf["betas"][0],
        "adam_beta2": hf["betas"][1],
        "adam_epsilon": hf["eps"],
        "warmup_steps": hf["warmup_steps"],
        "max_grad_norm": hf["max_grad_norm"],
        "bf16": cfg.precision == "bf16-mixed",
        "fp16": False,
        "use_cpu": True,
        # transformers 5 names gradient_checkpointing activation_checkpointing (the old name mirrors it); TRL's
        # SFTConfig defaults gradient_checkpointing to True, which recomputes every layer's forward in backward
        "activation_checkpointing": False,
        "torch_compile": False,
        "use_liger_kernel": False,  # Liger's kernels are Triton (CUDA/XPU): not on CPU
        "report_to": [],
        "save_strategy": "no",
        "eval_strategy": "no",
        "logging_strategy": "no",
        "dataloader_num_workers": 0,
        "dataloader_pin_memory": False,
        "disable_tqdm": True,
        "seed": cfg.seed,
    }


def peer_clock(timer: StepTimer, counts: list[tuple[int, int, int]], accum: int) -> Any:
    """A ``TrainerCallback`` marking steps with the token counts of their ``accum`` collated micro-batches."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            timer.step_start()

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            done = counts[len(timer.marks) * accum : (len(timer.marks) + 1) * accum]
            timer.step_end(*(sum(c[k] for c in done) for k in range(3)))

    return Clock()


def in_child(fn: Any, cfg: Any) -> Any:
    """Run ``fn(cfg)`` in a fresh spawned process and return its result."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, cfg).result()


def cpu_has_bf16() -> bool:
    """Whether the CPU has native bf16 matmul instructions (``avx512_bf16`` or ``amx_bf16``), read from cpuinfo."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"


def run_line(label: str, r: SideResult) -> str:
    compiled = r.recompiles is not None
    return (
        f"  {label:13s} {r.useful_tok_s:7.0f} useful tok/s, fill {r.fill:.3f}, peak RSS {mib(r.peak_rss_bytes)}, "
        f"{r.steps_timed} steps in {r.seconds:.2f} s ({r.cpu_seconds:.1f} CPU s), {r.threads} thread(s), "
        f"autocast {r.autocast}; step 1 (warm-up{', compiles' if compiled else ''}) {r.first_step_seconds:.2f} s"
        + (f", recompiles after step 1: {r.recompiles}" if compiled else "")
    )


def breakdown(name: str, runs: list[SideResult]) -> str:
    parts = {key: statistics.median(r.per_step_ms()[key] for r in runs) for key in runs[0].per_step_ms()}
    useful = statistics.median(r.useful_tokens / r.steps_timed for r in runs)
    processed = statistics.median(r.processed_tokens / r.steps_timed for r in runs)
    scored = statistics.median(r.scored_tokens / r.steps_timed for r in runs)
    step = parts["step"]
    shares = ", ".join(f"{k} {v:.1f} ms ({v / step:.0%})" for k, v in parts.items() if k != "step")
    return (
        f"{name:12s}: {step:.1f} ms/step = {shares} | tokens/step: {useful:.0f} useful of {processed:.0f} processed "
        f"(fill {useful / processed:.3f}), {scored:.0f} scored"
    )
