"""Forward+backward time (and peak memory) of xtl vs transformers on the same Qwen3 weights and tokens.

Usage::

    python benchmarks/model_step.py [--threads 1 --pairs 7 --warmup 1 --layers 4 --hidden 512 --seq 2048
                                     --vocab 32000 --modes fp32,bf16 --autocast --no-memory --no-fused]

Method:

1. A Qwen3 model (``Qwen3Config`` + ``Qwen3ForCausalLM``, random init, seed 0) is saved once; each mode loads it
   on both sides: transformers ``AutoModelForCausalLM`` (``attn_implementation="sdpa"``, the fastest one on CPU)
   and xtl's own model of the same config (``attn_impl: sdpa``; ``fused_projections: true``, one q/k/v and one
   gate/up matmul, unless ``--no-fused``) with ``from_hf``.
2. Modes: ``fp32`` (fp32 weights), ``bf16`` (pure bf16 weights on both sides), ``autocast`` (``--autocast``: fp32
   weights, forward under ``torch.autocast(bfloat16)`` on both sides, backward outside it).
3. One step is ``zero_grad(set_to_none)``, forward with loss, ``backward()`` on the same ``(1, seq)`` random
   tokens (one document): transformers ``model(input_ids, labels=input_ids)``; xtl ``model(seq_ctx,
   labels=shifted, return_logits=False)``. xtl-only advantage, labelled in the output: its loss is the fused,
   chunked LM head + cross-entropy (full logits are never materialized); transformers computes fp32 logits.
4. Timing protocol (``benchmarks/_paired.py``): threads pinned (``--threads``, default 1), ``--warmup`` untimed
   pairs, then ``--pairs`` (>= 5) timed pairs whose order alternates (xtl first, then transformers first, ...).
   Printed per mode: both medians and the median of the per-pair ratios xtl/transformers with its min..max
   (<= 1.0: xtl is not slower), and the same for process CPU seconds (with one thread, less sensitive to
   being descheduled on a shared machine).
5. Peak memory (unless ``--no-memory``): each side runs alone in a fresh subprocess (same weights, tokens,
   threads) with ``MALLOC_MMAP_THRESHOLD_=65536`` so freed tensors leave the resident set; after one warm-up
   step the peak RSS is reset (``/proc/self/clear_refs``) and the peak RSS increase over one more step is
   printed (activations, gradients and temporaries; not the weights).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from _paired import PairedResult, add_protocol_args, load_average, pin_threads, print_configs, run_pairs

MODES = ("fp32", "bf16", "autocast")
SIDES = ("xtl", "transformers")


def main() -> None:
    """Parse arguments, save the model once, time both sides per mode, print the results."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_protocol_args(parser, pairs=7, warmup=1)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512, help="hidden size (heads = hidden/64, head_dim 64)")
    parser.add_argument("--seq", type=int, default=2048, help="tokens per step (one document)")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--modes", default="fp32,bf16", help=f"comma-separated, of {','.join(MODES)}")
    parser.add_argument("--autocast", action="store_true", help="also run fp32 weights under bf16 autocast")
    parser.add_argument("--no-memory", action="store_true", help="skip the per-side peak memory subprocesses")
    parser.add_argument(
        "--no-fused", action="store_true", help="xtl with separate q/k/v and gate/up projections (fused by default)"
    )
    parser.add_argument("--memory-worker", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    pin_threads(args.threads)
    modes = [m for m in args.modes.split(",") if m] + (["autocast"] if args.autocast else [])
    if unknown := sorted(set(modes) - set(MODES)):
        parser.error(f"unknown mode(s) {unknown}; choose from {MODES}")
    if args.memory_worker:
        print(f"PEAK {_peak_step_bytes(args.memory_worker, Path(args.model_dir), modes[0], args)}")
        return
    _quiet()
    print(f"load average before: {load_average()}")
    with tempfile.TemporaryDirectory(prefix="xtl-model-step-") as tmp:
        model_dir = Path(tmp)
        params = _save_model(args, model_dir)
        print(
            f"model: Qwen3, {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, {params / 1e6:.1f}M "
            f"params | tokens: 1 x {args.seq} (one document, random ids) | threads {torch.get_num_threads()} | "
            f"{args.warmup} warm-up + {args.pairs} timed pairs, order alternating"
        )
        for mode in modes:
            _run_mode(args, model_dir, mode)
    print(f"load average after: {load_average()}")


def _run_mode(args: argparse.Namespace, model_dir: Path, mode: str) -> None:
    steps, losses = {}, {}
    for side in SIDES:
        model = _load(side, model_dir, mode, not args.no_fused)
        steps[side] = _step_fn(side, model, _tokens(args), mode)
        losses[side] = steps[side]()
    print(f"\n[{mode}] first-step loss: xtl {losses['xtl']:.5f} | transformers {losses['transformers']:.5f}")
    print_configs(**_configs(args, mode))
    cpu: dict[str, list[float]] = {side: [] for side in SIDES}

    def timed(side: str) -> Callable[[], float]:
        def run() -> float:
            wall, cpu_start = time.perf_counter(), time.process_time()
            steps[side]()
            cpu[side].append(time.process_time() - cpu_start)
            return time.perf_counter() - wall

        return run

    result = run_pairs(timed("xtl"), timed("transformers"), args.pairs, args.warmup, f"[{mode}] fwd+bwd seconds")
    print(result.summary("xtl", "transformers"))
    cpu_result = PairedResult(
        f"[{mode}] fwd+bwd CPU seconds", cpu["xtl"][args.warmup :], cpu["transformers"][args.warmup :]
    )
    print(cpu_result.summary("xtl", "transformers"))
    if not args.no_memory:
        peaks = {side: _memory_in_subprocess(args, side, model_dir, mode) for side in SIDES}
        print(
            f"[{mode}] peak RSS increase over one step (own subprocess each): xtl {peaks['xtl'] / 2**20:.0f} MiB | "
            f"transformers {peaks['transformers'] / 2**20:.0f} MiB | ratio {peaks['xtl'] / peaks['transformers']:.3f}"
        )


def _configs(args: argparse.Namespace, mode: str) -> dict[str, dict[str, object]]:
    precision = {
        "fp32": "fp32 weights",
        "bf16": "bf16 weights (pure)",
        "autocast": "fp32 weights + autocast bf16",
    }[mode]
    common = {
        "precision": precision,
        "batch": f"1x{args.seq}",
        "ordering": "same tokens every step",
        "packing": "none (one document)",
        "truncation": "none",
        "threads": torch.get_num_threads(),
    }
    return {
        "xtl": {
            **common,
            "attention": "sdpa, per document",
            "head+loss": "fused chunked LM head + CE, no logits materialized [xtl-only]",
            "projections": "q/k/v fused, gate/up fused: one matmul each [xtl-only]"
            if not args.no_fused
            else "separate q, k, v, gate, up (as transformers)",
        },
        "transformers": {
            **common,
            "attention": "sdpa",
            "head+loss": "full fp32 logits, ForCausalLMLoss",
            "projections": "separate q, k, v, gate, up",
        },
    }


# ---- sides -----------------------------------------------------------------------------------------------------


def _save_model(args: argparse.Namespace, path: Path) -> int:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    heads = max(1, args.hidden // 64)
    config = Qwen3Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, args.hidden // 256),
        head_dim=64,
        max_position_embeddings=max(4096, args.seq),
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def _load(side: str, path: Path, mode: str, fused: bool) -> torch.nn.Module:
    dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    if side == "transformers":
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").train()
    from xtl.train.model_spec import resolve_model_config

    config, _ = resolve_model_config(str(path), {"attn_impl": "sdpa", "fused_projections": fused})
    model = config.build()
    model.from_hf(path)
    return model.to(dtype).train()


def _tokens(args: argparse.Namespace) -> torch.Tensor:
    return torch.randint(0, args.vocab, (1, args.seq), generator=torch.Generator().manual_seed(0))


def _step_fn(side: str, model: torch.nn.Module, ids: torch.Tensor, mode: str) -> Callable[[], float]:
    """One training step of ``side`` (zero grad, forward with loss, backward); returns the loss."""
    from xtl.model import SequenceContext
    from xtl.ops import shift_labels

    ctx, targets = SequenceContext.from_input_ids(ids), shift_labels(ids)

    def step() -> float:
        model.zero_grad(set_to_none=True)
        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if mode == "autocast" else contextlib.nullcontext()
        with autocast:
            if side == "xtl":
                loss = model(seq_ctx=ctx, labels=targets, return_logits=False).loss
            else:
                loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return float(loss.detach())

    return step


# ---- memory ----------------------------------------------------------------------------------------------------


def _memory_in_subprocess(args: argparse.Namespace, side: str, model_dir: Path, mode: str) -> int:
    cmd = [sys.executable, __file__, "--memory-worker", side, "--model-dir", str(model_dir), "--modes", mode]
    cmd += ["--threads", str(args.threads), "--seq", str(args.seq), "--vocab", str(args.vocab)]
    cmd += ["--no-fused"] if args.no_fused else []
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    peaks = [line for line in proc.stdout.splitlines() if line.startswith("PEAK ")]
    if proc.returncode != 0 or not peaks:
        raise RuntimeError(f"memory worker {side} {mode} failed:\n{proc.stderr[-3000:]}")
    return int(peaks[-1].split()[1])


def _peak_step_bytes(side: str, model_dir: Path, mode: str, args: argparse.Namespace) -> int:
    """Peak RSS increase over one step after a warm-up step (this process runs one side only)."""
    _quiet()
    step = _step_fn(side, _load(side, model_dir, mode, not args.no_fused), _tokens(args), mode)
    step()
    rss_before = _proc_status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    step()
    return _proc_status("VmHWM") - rss_before


def _proc_status(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"/proc/self/status has no {field} (peak memory needs Linux)")
    return int(match.group(1)) * 1024


def _quiet() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


if __name__ == "__main__":
    main()
