"""Training tokens/s/GPU, MFU and peak memory of a ~1.7B dense Qwen3 and a small Qwen3-MoE, speed features on/off.

Usage::

    python benchmarks/gpu_throughput.py [--models dense,moe --seqs 4096,16384
                                         --configs baseline,flash,fused,ckpt,compile,fp8,flash+fused+compile+fp8
                                         --doc-tokens 2048 --warmup 3 --steps 6 --peak-tflops 989 --threads 8]
    python benchmarks/gpu_throughput.py --dry-run      # print the plan: each configuration, FLOPs per token

Method:

1. Models, from scratch (no download): ``dense`` is the ``qwen3-1.7b`` config (hidden 2048, 28 layers, 16/8
   heads, head_dim 128, vocab 151936, tied embeddings); ``moe`` is ``qwen3-30b-a3b``'s dims cut to 24 layers
   and 16 experts (top-4, expert width 768).
2. Configurations: ``baseline`` is ``attn_impl: sdpa`` (SDPA within documents) without callbacks; a
   configuration names the features it turns on, joined by ``+``: ``flash`` (``attn_impl: flash``, the
   flash-attn varlen kernel), ``fused`` (``fused_projections: true``: one q/k/v and one gate/up matmul),
   ``ckpt`` (``ActivationCheckpointing``, full), ``compile`` (``Compile``, inductor), ``fp8`` (``FP8Training``,
   tensorwise). Every configuration runs the CUDA kernels the op selectors pick there: the triton RoPE and residual
   add + RMSNorm kernels (``xtl.ops.get_rope_fn``, ``xtl.ops.get_add_rms_norm_fn``) where triton is installed.
   The callbacks are xtl's model transforms, applied in stage order on the meta-built model as
   ``ParallelizingStrategy.parallelize`` applies them; the model is then materialized on the
   GPU with a fast on-device random init (``init_weights``' seeded CPU init is far slower and the values do not
   change the speed), then each transform's ``after_weights`` runs where it has one.
3. One step is what ``LanguageModule.training_step`` runs on one packed micro-batch: forward under
   ``torch.autocast(bfloat16)`` with fp32 master weights (``trainer.precision: bf16-mixed``) and the fused
   chunked LM head + loss, backward, ``grad_norm_and_clip`` (1.0), a finite-norm check, fused AdamW
   (``AdamWConfig``), ``zero_grad``. The batch is ``(1, seq)`` random tokens in documents of ``--doc-tokens``
   on average (seeded lengths of 0.5x..1.5x; 0: one document per pack). MoE router losses are not added
   (negligible compute).
4. Timing: ``--warmup`` untimed steps (compilation happens there), then ``--steps`` (>= 5) timed steps, each
   between two ``torch.cuda.synchronize()``. Printed per configuration: median tokens/s/GPU with the min..max
   over the steps, MFU and achieved TFLOP/s at the median, and ``torch.cuda.max_memory_allocated`` over the
   timed steps (reset after warm-up).
5. FLOPs: :meth:`xtl.model.dims.ModelDims.flops_per_token` (the count the ``Throughput`` callback logs), per
   document: ``sum over documents of length * flops_per_token(length)``; MFU = achieved FLOP/s /
   ``--peak-tflops`` (default 989: H100/H200 dense bf16). With ``ckpt``, the recomputed forward is not counted
   (MFU counts model FLOPs only).

Without CUDA it exits with status 2 before building anything (``--dry-run`` works anywhere).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from _paired import MIN_PAIRS, load_average, pin_threads

FEATURES = ("flash", "fused", "ckpt", "compile", "fp8")
FEATURE_SETTINGS = {
    "flash": "attn_impl: flash (flash-attn varlen)",
    "fused": "fused_projections: true (one q/k/v and one gate/up matmul)",
    "ckpt": "ActivationCheckpointing(mode=full)",
    "compile": "Compile() (inductor, per layer, head + loss)",
    "fp8": "FP8Training(recipe=tensorwise)",
}
DEFAULT_CONFIGS = "baseline,flash,fused,ckpt,compile,fp8,flash+fused+compile+fp8"
H100_BF16_DENSE_TFLOPS = 989.0
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "dense": ("qwen3-1.7b", {}),
    "moe": ("qwen3-30b-a3b", {"num_hidden_layers": 24, "num_experts": 16, "num_experts_per_tok": 4}),
}


@dataclass(frozen=True)
class RunConfig:
    """One cell of the matrix: a model, a pack length and the features turned on."""

    model: str
    seq: int
    features: frozenset[str]

    @property
    def name(self) -> str:
        """``baseline`` or the features joined by ``+`` (in :data:`FEATURES` order)."""
        return "+".join(f for f in FEATURES if f in self.features) or "baseline"

    @property
    def attn_impl(self) -> str:
        """The model's ``attn_impl``."""
        return "flash" if "flash" in self.features else "sdpa"


def parse_features(name: str) -> frozenset[str]:
    """``baseline`` or ``+``-joined feature names -> the feature set.

    Raises:
        ValueError: For an unknown feature.
    """
    if name == "baseline":
        return frozenset()
    features = frozenset(name.split("+"))
    if unknown := sorted(features - set(FEATURES)):
        raise ValueError(f"unknown feature(s) {unknown} in {name!r}; use baseline or {'+'.join(FEATURES)} parts")
    return features


def matrix(models: Sequence[str], seqs: Sequence[int], configs: Sequence[str]) -> list[RunConfig]:
    """Every (model, pack length, configuration), in that nesting order, duplicates removed."""
    for model in models:
        if model not in MODELS:
            raise ValueError(f"unknown model {model!r}; choose from {sorted(MODELS)}")
    features = list(dict.fromkeys(parse_features(c) for c in configs))
    return [RunConfig(m, s, f) for m in models for s in seqs for f in features]


def describe(run: RunConfig) -> str:
    """What configuration ``run`` turns on, in words (the plan's line for it)."""
    if not run.features:
        return "attn_impl: sdpa, separate projections, no callbacks"
    return "; ".join(FEATURE_SETTINGS[f] for f in FEATURES if f in run.features)


def model_config(model: str, attn_impl: str = "sdpa", fused: bool = False) -> Any:
    """The xtl model config of ``model`` (``dense`` or ``moe``) with the given ``attn_impl`` and
    ``fused_projections``."""
    from xtl.model import get_model_config

    alias, overrides = MODELS[model]
    config = get_model_config(alias)
    fields = {f.name for f in dataclasses.fields(config)}
    if "num_hidden_layers" in overrides and "layer_types" in fields:  # per-layer types follow the layer count
        overrides = {"layer_types": None, **overrides}
    return dataclasses.replace(config, **overrides, attn_impl=attn_impl, fused_projections=fused)


def document_lengths(seq: int, doc_tokens: int, seed: int = 0) -> list[int]:
    """Documents of ``doc_tokens`` on average filling a pack of ``seq`` tokens; 0: one document.

    Lengths are drawn uniformly from ``doc_tokens / 2 .. 3 * doc_tokens / 2`` (seeded), the last one cut to fit,
    so documents of a pack differ in length as in packed SFT data (xtl's SDPA path batches equal lengths).
    """
    if doc_tokens <= 0 or doc_tokens >= seq:
        return [seq]
    rng = random.Random(seed)
    lengths: list[int] = []
    while (left := seq - sum(lengths)) > 0:
        lengths.append(min(left, rng.randint(max(1, doc_tokens // 2), doc_tokens * 3 // 2)))
    return lengths


def flops_per_step(dims: Any, lengths: Sequence[int]) -> float:
    """Training FLOPs of one pack: ``sum(length * dims.flops_per_token(length))`` over its documents."""
    return sum(n * dims.flops_per_token(n) for n in lengths)


def mfu(tokens_per_s: float, flops_per_token: float, peak_tflops: float) -> float:
    """Model-FLOPs utilization: achieved FLOP/s over the peak."""
    return tokens_per_s * flops_per_token / (peak_tflops * 1e12)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="dense,moe", help=f"comma-separated, of {','.join(MODELS)}")
    parser.add_argument("--seqs", default="4096,16384", help="packed tokens per step, comma-separated")
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help="comma-separated baseline or a+b feature sets")
    parser.add_argument("--doc-tokens", type=int, default=2048, help="mean document length (0: one per pack)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens there)")
    parser.add_argument("--steps", type=int, default=6, help=f"timed steps (>= {MIN_PAIRS})")
    parser.add_argument("--peak-tflops", type=float, default=H100_BF16_DENSE_TFLOPS, help="device peak (bf16)")
    parser.add_argument("--threads", type=int, default=8, help="host intra-op threads")
    parser.add_argument("--dry-run", action="store_true", help="print the matrix and FLOPs, run nothing")
    args = parser.parse_args(argv)
    if args.steps < MIN_PAIRS:
        parser.error(f"--steps must be >= {MIN_PAIRS}: a median of fewer steps is not a result")
    args.seq_list = [int(s) for s in args.seqs.split(",") if s]
    try:
        args.matrix = matrix(args.models.split(","), args.seq_list, args.configs.split(","))
    except ValueError as err:
        parser.error(str(err))
    return args


# ---- measurement (CUDA) ------------------------------------------------------------------------------------------


def build(run: RunConfig, device: Any) -> Any:
    """The model of ``run``: meta build, the features' transforms in stage order, on-device random init."""
    import torch

    from xtl.callbacks import ActivationCheckpointing, Compile, FP8Training

    config = model_config(run.model, run.attn_impl, "fused" in run.features)
    with torch.device("meta"):
        model = config.build()
    transforms = []
    if "fp8" in run.features:
        transforms.append(FP8Training(recipe="tensorwise"))
    if "ckpt" in run.features:
        transforms.append(ActivationCheckpointing(mode="full"))
    if "compile" in run.features:
        transforms.append(Compile())
    transforms.sort(key=lambda t: t.transform_stage)
    for transform in transforms:
        model = transform.transform_model(model)
    model.materialize(device)
    with torch.no_grad():  # parameters and persistent buffers: norms 1, other vectors 0, matrices normal
        for name, tensor in model.checkpoint_tensors().items():
            if "norm" in name:
                tensor.fill_(1.0)
            elif tensor.dim() < 2:
                tensor.zero_()
            else:
                tensor.normal_(0.0, config.initializer_range)
    for transform in transforms:  # the sequence's last stage, where a transform has it
        after_weights = getattr(transform, "after_weights", None)
        model = after_weights(model) if after_weights is not None else model
    return model.train()


def measure(run: RunConfig, args: argparse.Namespace, device: Any) -> dict[str, Any]:
    """Warm up, time ``args.steps`` training steps of ``run``, return tokens/s per step and peak memory."""
    import torch

    from xtl.batch import SequenceContext
    from xtl.train.optim import AdamWConfig
    from xtl.train.step import grad_norm_and_clip

    model = build(run, device)
    optimizer = AdamWConfig().build(model, device)
    lengths = document_lengths(run.seq, args.doc_tokens)
    vocab = model.config.vocab_size
    generator = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, vocab, (1, run.seq), generator=generator)
    labels = torch.randint(0, vocab, (1, run.seq), generator=generator)
    ctx, labels = SequenceContext.from_lengths(ids, lengths).to(device), labels.to(device)
    params = list(model.parameters())

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(seq_ctx=ctx, labels=labels, return_logits=False).loss
        loss.backward()
        if torch.isfinite(grad_norm_and_clip(params, 1.0)):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(args.warmup):
        step()
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    tokens_per_s = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        sync()
        tokens_per_s.append(run.seq / (time.perf_counter() - start))
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return {"tokens_per_s": tokens_per_s, "peak_bytes": peak, "lengths": lengths}


def _release() -> None:
    import torch

    gc.collect()
    torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _flash_available() -> bool:
    from xtl.ops.attention import flash_attn_available

    return flash_attn_available()


def _fp8_available() -> bool:
    import importlib.util

    import torch

    return importlib.util.find_spec("torchao") is not None and torch.cuda.get_device_capability() >= (8, 9)


# ---- main --------------------------------------------------------------------------------------------------------


def _dims(model: str) -> Any:
    from xtl.model.dims import ModelDims

    return ModelDims.from_config(model_config(model), name=model)


def _print_plan(args: argparse.Namespace) -> None:
    for model in dict.fromkeys(run.model for run in args.matrix):
        dims = _dims(model)
        counts = dims.parameter_counts()
        alias, overrides = MODELS[model]
        lengths = sorted({*args.seq_list, args.doc_tokens} - {0})
        per_length = ", ".join(f"{n}: {dims.flops_per_token(n) / 1e9:.2f} G" for n in lengths)
        print(
            f"{model}: {alias} {overrides or ''} -> {counts['total'] / 1e9:.2f}B params "
            f"({counts['activated'] / 1e9:.2f}B activated); FLOPs/token per document length: {per_length}"
        )
    documents = f"~{args.doc_tokens} (0.5x..1.5x)" if args.doc_tokens else "pack"
    print(
        f"{len(args.matrix)} runs: models {args.models}, packs {args.seqs} tokens in documents of {documents} "
        f"tokens, configurations {args.configs}; bf16 autocast, fp32 master weights, fused AdamW; {args.warmup} "
        f"warm-up + {args.steps} timed steps each; peak {args.peak_tflops} TFLOP/s"
    )
    for name, run in {run.name: run for run in args.matrix}.items():
        print(f"  {name}: {describe(run)}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the matrix (or print it with ``--dry-run``); exit 2 without CUDA."""
    args = parse_args(argv)
    import torch

    if args.dry_run:
        _print_plan(args)
        return 0
    if not torch.cuda.is_available():
        print("gpu_throughput.py needs a CUDA GPU: torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    pin_threads(args.threads)
    device = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name(device)} | torch {torch.__version__} | load {load_average()}")
    _print_plan(args)
    print(
        f"{'model':6s} {'seq':>6s} {'configuration':18s} {'tok/s/GPU (min..max)':>28s} {'TFLOP/s':>8s} {'MFU':>6s} "
        f"{'peak GiB':>9s}"
    )
    dims = {model: _dims(model) for model in dict.fromkeys(run.model for run in args.matrix)}
    for run in args.matrix:
        skip = None
        if "flash" in run.features and not _flash_available():
            skip = "flash-attn not installed"
        elif "fp8" in run.features and not _fp8_available():
            skip = "fp8 needs torchao and compute capability >= 8.9"
        row = f"{run.model:6s} {run.seq:6d} {run.name:18s}"
        if skip:
            print(f"{row} skipped: {skip}", flush=True)
            continue
        try:
            result = measure(run, args, device)
        except torch.OutOfMemoryError:
            result = None
        _release()  # after the except block: the exception no longer holds the model's frames
        if result is None:
            print(f"{row} out of memory", flush=True)
            continue
        rates = result["tokens_per_s"]
        median = statistics.median(rates)
        flops_per_token = flops_per_step(dims[run.model], result["lengths"]) / run.seq
        spread = f"{median:,.0f} ({min(rates):,.0f}..{max(rates):,.0f})"
        print(
            f"{row} {spread:>28s} {median * flops_per_token / 1e12:8.1f} "
            f"{mfu(median, flops_per_token, args.peak_tflops):6.1%} {result['peak_bytes'] / 2**30:9.1f}",
            flush=True,
        )
    print(f"load average after: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
