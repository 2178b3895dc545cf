"""fp8 training vs high precision on the tiny SFT recipe: step-time ratio, per-layer errors, 200-step loss curves.

Usage::

    python benchmarks/fp8_step.py [--recipes tensorwise rowwise blockwise --threads 1 --warmup 2 --pairs 5]
    python benchmarks/fp8_step.py --errors
    python benchmarks/fp8_step.py --curve [--steps 200]

Modes:

- step time (default): the model of ``configs/tiny_sft.yaml`` (or ``--hidden`` ... overrides) is built twice from
  the same seed, once as is and once through ``FP8Training(recipe)``, each with its own AdamW. One step is what
  ``LanguageModule.training_step`` does: forward/backward of ``--micro-batches`` packs of ``--seq`` random tokens
  cut into random-length documents, gradient clipping to 1.0, ``optimizer.step()``, ``zero_grad``. After
  ``--warmup`` steps of each side, ``--pairs`` paired repetitions alternate the order (high precision first in even
  pairs, fp8 first in odd ones); each step is timed with ``time.perf_counter`` (after ``cuda.synchronize`` on GPU).
  Printed: both configurations, every pair, and the median ratio fp8 / high precision with its min..max. On CPU the
  ratio is informational (``_scaled_mm`` on CPU is no faster than a float matmul, and the blockwise reference path
  quantizes and dequantizes in torch); on an H100/H200 it is the speedup to expect -- the command is printed.
- ``--errors``: per recipe, ``xtl.callbacks.fp8.layer_errors`` on one batch: the relative error of each converted
  layer's output, input gradient and weight gradient against the unconverted layer on the same inputs and output
  gradients; printed as the median and the max over layers.
- ``--curve``: ``xtl fit --config configs/tiny_sft.yaml [--config <fp8 fragment>] --trainer.max_steps <steps>`` in
  subprocesses (``OMP_NUM_THREADS=--threads``), the high-precision run and one per recipe (``--seed-spread``: and a
  high-precision run from another initialization seed, to show how far two high-precision runs drift apart); prints
  the loss every ``steps / 10`` steps and the final loss -- the mean over the last quarter of the steps, since the
  loss of a single step depends on its packs -- with its difference from the high-precision run (target: within
  3%), and the last step's loss.

The high-precision side is the recipe's own precision (``--dtype``, default float32: ``configs/tiny_sft.yaml`` trains
with ``precision: 32-true``; ``--dtype bfloat16`` gives bf16 parameters on both sides).
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "configs" / "tiny_sft.yaml"
FRAGMENT = ROOT / "callbacks" / "fp8.yaml"
RECIPES = ("tensorwise", "rowwise", "blockwise")
GPU_COMMAND = (
    "python benchmarks/fp8_step.py --device cuda --dtype bfloat16 --compile --threads 16 --hidden 4096 "
    "--intermediate 14336 --layers 4 --heads 32 --kv-heads 8 --head-dim 128 --vocab 32768 --seq 8192 "
    "--micro-batches 1 --warmup 3 --pairs 10"
)


def main() -> None:
    """Parse the arguments and run the chosen mode."""
    args = _parser().parse_args()
    torch.set_num_threads(args.threads)
    if args.curve:
        curve(args)
    elif args.errors:
        errors(args)
    else:
        step_time(args)


def step_time(args: argparse.Namespace) -> None:
    """Paired step times, high precision vs each fp8 recipe."""
    from xtl.callbacks import FP8Training

    spec = model_spec(args)
    print(f"model: {spec}")
    print(
        f"device {args.device}, dtype {args.dtype}, threads {args.threads}, compile {args.compile}, "
        f"{args.micro_batches} x {args.seq} tokens per step, warmup {args.warmup}, pairs {args.pairs}"
    )
    batches = make_batches(spec["vocab_size"], args.seq, args.micro_batches, args.device)
    for recipe in args.recipes:
        callback = FP8Training(recipe)
        sides = {"high": Side(spec, [], args), "fp8": Side(spec, [callback], args)}
        print(
            f"\n{recipe}: FP8Training(recipe={recipe!r}) converted {len(callback.converted)} linear layers, "
            f"kept {len(callback.skipped)}"
        )
        for name, side in sides.items():
            times = [side.step(batches) for _ in range(args.warmup)]
            print(f"  warmup {name:4s}: " + " ".join(f"{t * 1e3:.0f}ms" for t in times))
        ratios = []
        for pair in range(args.pairs):
            order = ("high", "fp8") if pair % 2 == 0 else ("fp8", "high")
            times = {name: sides[name].step(batches) for name in order}
            ratios.append(times["fp8"] / times["high"])
            print(
                f"  pair {pair}: high {times['high'] * 1e3:.0f}ms, fp8 {times['fp8'] * 1e3:.0f}ms, "
                f"ratio {ratios[-1]:.3f} (first: {order[0]})"
            )
        print(
            f"  {recipe}: step time fp8 / high precision = {statistics.median(ratios):.3f} "
            f"(min {min(ratios):.3f} .. max {max(ratios):.3f} over {args.pairs} pairs)"
        )
    print(f"\nOn an H100/H200 (the figure to expect there):\n  {GPU_COMMAND}")


def errors(args: argparse.Namespace) -> None:
    """Per-layer relative errors of each recipe against the unconverted layers."""
    from xtl.callbacks import FP8Training
    from xtl.callbacks.fp8 import layer_errors

    spec = model_spec(args)
    print(f"model: {spec}\ndevice {args.device}, dtype {args.dtype}, one pack of {args.seq} tokens")
    (seq_ctx, labels), *_ = make_batches(spec["vocab_size"], args.seq, 1, args.device)

    def loss_fn(model: torch.nn.Module) -> torch.Tensor:
        return model(seq_ctx=seq_ctx, labels=labels, return_logits=False).loss

    print(
        f"{'recipe':11s} {'layers':>6s}  {'output med/max':>16s}  {'grad_input med/max':>19s}  "
        f"{'grad_weight med/max':>20s}"
    )
    for recipe in args.recipes:
        callback = FP8Training(recipe)
        fp8, reference = build_model(spec, [callback], args), build_model(spec, [], args)
        result = layer_errors(fp8, reference, callback.converted, loss_fn)
        cells = []
        for key in ("output", "grad_input", "grad_weight"):
            values = [e[key] for e in result.values()]
            cells.append(f"{statistics.median(values):.4f}/{max(values):.4f}")
        print(f"{recipe:11s} {len(result):6d}  {cells[0]:>16s}  {cells[1]:>19s}  {cells[2]:>20s}")


def curve(args: argparse.Namespace) -> None:
    """Loss curves of ``xtl fit`` on the tiny SFT recipe, high precision vs each recipe."""
    runs: dict[str, list[float]] = {}
    names = ["high", *(["high_seed1"] if args.seed_spread else []), *args.recipes]
    with tempfile.TemporaryDirectory(prefix="fp8_curve_") as tmp:
        for name in names:
            run_dir = Path(tmp) / name
            run_dir.mkdir()
            command = [sys.executable, "-m", "xtl", "fit", "--config", str(RECIPE)]
            if name in RECIPES:
                fragment = run_dir / "fp8.yaml"
                fragment.write_text(FRAGMENT.read_text().replace("recipe: tensorwise", f"recipe: {name}"))
                command += ["--config", str(fragment)]
            if name == "high_seed1":
                command += ["--model.init_args.seed", "1"]
            command += ["--trainer.max_steps", str(args.steps), "--trainer.enable_progress_bar", "false"]
            print("$ " + " ".join(command), flush=True)
            start = time.perf_counter()
            env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
            subprocess.run(command, cwd=run_dir, env=env, check=True, capture_output=True)
            metrics = next(run_dir.glob("runs/*/logs/version_*/metrics.csv"))
            runs[name] = [float(row["train/loss"]) for row in csv.DictReader(metrics.open()) if row["train/loss"]]
            print(f"  {len(runs[name])} steps in {time.perf_counter() - start:.0f}s", flush=True)
    every = max(1, args.steps // 10)
    print("\nstep  " + "  ".join(f"{name:>10s}" for name in runs))
    for step in [1, *range(every, args.steps + 1, every)]:
        print(f"{step:4d}  " + "  ".join(f"{losses[step - 1]:10.4f}" for losses in runs.values()))
    window = max(1, args.steps // 4)
    high, high_tail = runs["high"][-1], statistics.mean(runs["high"][-window:])
    print(f"\nfinal loss = mean of the last {window} steps (every run sees the same packs in the same order)")
    for name in names[1:]:
        tail = statistics.mean(runs[name][-window:])
        print(
            f"{name:11s} final {tail:.4f} vs high {high_tail:.4f} ({tail / high_tail - 1:+.2%}, within 3%: "
            f"{abs(tail / high_tail - 1) <= 0.03}); step {args.steps}: {runs[name][-1]:.4f} vs {high:.4f} "
            f"({runs[name][-1] / high - 1:+.2%})"
        )


class Side:
    """One model and its optimizer; :meth:`step` runs and times one optimizer step."""

    def __init__(self, spec: dict[str, Any], transforms: list, args: argparse.Namespace) -> None:
        from xtl.train.optim import AdamWConfig

        self.model = build_model(spec, transforms, args)
        if args.compile:
            for layer in self.model.layers:
                layer.compile()
        self.device = torch.device(args.device)
        self.optimizer = AdamWConfig(lr=1e-3).create([{"params": list(self.model.parameters())}], self.device)

    def step(self, batches: list) -> float:
        """One optimizer step over ``batches``; returns its wall time in seconds."""
        self._sync()
        start = time.perf_counter()
        for seq_ctx, labels in batches:
            loss = self.model(seq_ctx=seq_ctx, labels=labels, return_logits=False).loss
            (loss / len(batches)).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._sync()
        return time.perf_counter() - start

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def model_spec(args: argparse.Namespace) -> dict[str, Any]:
    """The recipe's model fields with the command-line overrides."""
    spec = dict(yaml.safe_load(RECIPE.read_text())["model"]["init_args"]["model"])
    overrides = {
        "hidden_size": args.hidden, "intermediate_size": args.intermediate, "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads, "head_dim": args.head_dim,
        "vocab_size": args.vocab,
    }  # fmt: skip
    spec.update({key: value for key, value in overrides.items() if value is not None})
    return spec


def build_model(spec: dict[str, Any], transforms: list, args: argparse.Namespace) -> torch.nn.Module:
    """Build on meta, run the transforms, initialize from seed 0 on the device, cast to ``--dtype``."""
    from xtl.train.model_spec import resolve_model_config

    config, _ = resolve_model_config(spec, None)
    with torch.device("meta"):
        model = config.build()
    for transform in transforms:
        model = transform.transform_model(model)
    model.materialize(args.device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model.init_weights()
    return model.to(getattr(torch, args.dtype))


def make_batches(vocab: int, seq: int, micro_batches: int, device: str) -> list:
    """``micro_batches`` packs of ``seq`` random tokens in random-length documents, with random labels."""
    from xtl.batch import SequenceContext

    generator = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(micro_batches):
        lengths, left = [], seq
        while left > 0:
            lengths.append(min(left, int(torch.randint(16, max(17, seq // 2), (1,), generator=generator))))
            left -= lengths[-1]
        ids = torch.randint(0, vocab, (1, seq), generator=generator)
        labels = torch.randint(0, vocab, (1, seq), generator=generator)
        batches.append((SequenceContext.from_lengths(ids, lengths).to(device), labels.to(device)))
    return batches


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--curve", action="store_true", help="loss curves of xtl fit runs on the tiny SFT recipe")
    mode.add_argument("--errors", action="store_true", help="per-layer relative errors of each recipe")
    parser.add_argument("--recipes", nargs="+", choices=RECIPES, default=list(RECIPES))
    parser.add_argument("--steps", type=int, default=200, help="--curve: optimizer steps per run")
    parser.add_argument(
        "--seed-spread", action="store_true", help="--curve: also a high-precision run from init seed 1 (noise scale)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (OMP_NUM_THREADS for --curve)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--compile", action="store_true", help="torch.compile every decoder layer (both sides)")
    parser.add_argument("--seq", type=int, default=512, help="tokens per pack (the recipe's pack_max_length)")
    parser.add_argument("--micro-batches", type=int, default=2)
    for name in ("hidden", "intermediate", "layers", "heads", "kv-heads", "head-dim", "vocab"):
        parser.add_argument(f"--{name}", type=int, default=None, help="override the recipe's model")
    return parser


if __name__ == "__main__":
    main()
