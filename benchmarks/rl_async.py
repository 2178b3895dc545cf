"""Asynchronous against synchronous GRPO on the tiny recipe: samples per second, and the held-out accuracy and wall
time each reaches (``python benchmarks/rl_step.py --async``; this module holds that mode).

Usage::

    python benchmarks/rl_step.py --async [--policy runs/tiny_sft_export/hf/final --steps 24 --pairs 5 --warmup 1
                                          --full-steps 400 --val-every 100 --no-full]

Method:

1. Recipe: ``configs/tiny_grpo.yaml`` as it is (16 prompts x 8 completions, dynamic sampling, 2 updates per rollout
   batch, the math judger) from the tiny SFT model's HF export (``--policy``; make it with ``xtl fit --config
   configs/tiny_sft.yaml --config callbacks/hf_export.yaml --trainer.default_root_dir runs/tiny_sft_export``).
2. Sides, on the same two cores:
   - *sync*: the default run: the local engine samples with the policy in the trainer's process, with
     ``--sync-threads`` threads (default 2: both cores, its fastest setting here);
   - *async*: ``rollout.asynchronous: true``, ``max_staleness: 1``, ``engine.name: ray`` with ``--actors`` actors
     (``--actor-threads`` threads each, default 1; their own copy of the weights) and the trainer with 1 thread: the
     next rollout batch is sampled while the current one trains.
3. Throughput: each run trains ``--steps`` optimizer steps without validation; samples/s is the samples generated for
   the rollout batches after the first (warm-up: start-up, the actor's first weights) over their wall time, from the
   end of the first batch to the end of the run. Protocol (``benchmarks/_paired.py``): each run in a fresh spawned
   child, threads pinned, ``--warmup`` untimed pairs, ``--pairs`` timed pairs in alternating order; printed: the
   median ratio async/sync with min..max.
4. Accuracy (unless ``--no-full``): one run per side of ``--full-steps`` steps with the recipe's held-out validation
   every ``--val-every`` steps (greedy exact match on the 72 arithmetic questions); printed: each validation's exact
   match and wall time, the final ones, and the wall time to the first validation at or above the synchronous run's
   final exact match.

The parent process stays stdlib-only (its children do all the work).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _paired import load_average, pin_threads, print_configs, run_pairs
from _peers import child_setup, cpu_has_bf16, in_child

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "configs" / "tiny_grpo.yaml"
DEFAULT_POLICY = ROOT / "runs" / "tiny_sft_export" / "hf" / "final"
TARGET = 1.5


def side_configs(actors: int, sync_threads: int, actor_threads: int = 1) -> dict[str, dict[str, Any]]:
    """What each side runs (printed with the results)."""
    return {
        "sync": {"engine": "local", "asynchronous": False, "trainer threads": sync_threads},
        "async": {"engine": f"ray ({actors} actor(s), {actor_threads} thread(s) each)", "asynchronous": True,
                  "max_staleness": 1, "trainer threads": 1, "actors": actors, "actor threads": actor_threads},
    }  # fmt: skip


@dataclass
class RunConfig:
    """What a child runs (picklable)."""

    side: str
    policy: str
    work_dir: str
    steps: int
    precision: str
    val_every: int | None = None
    actors: int = 1
    sync_threads: int = 2
    actor_threads: int = 1
    overrides: list[str] = field(default_factory=list)  # more ``xtl fit`` arguments (tests shrink the recipe)


@dataclass
class RunResult:
    """What a child measured.

    Attributes:
        samples_per_s: Samples generated after the first rollout batch over their wall time.
        samples: Samples generated per rollout batch.
        batch_ends: Wall time (since training started) at the end of each rollout batch.
        validations: ``(step, wall seconds since training started, held-out exact match)`` of each validation.
        staleness: The logged ``rollout/staleness_max`` of each batch.
    """

    samples_per_s: float = 0.0
    samples: list[float] = field(default_factory=list)
    batch_ends: list[float] = field(default_factory=list)
    validations: list[tuple[int, float, float]] = field(default_factory=list)
    staleness: list[float] = field(default_factory=list)


def run_side(cfg: RunConfig) -> RunResult:
    """``xtl fit`` of the recipe on one side, timed per rollout batch."""
    side = side_configs(cfg.actors, cfg.sync_threads, cfg.actor_threads)[cfg.side]
    threads = side["trainer threads"]
    child_setup(threads, uses_datasets=False)
    import lightning.pytorch as pl

    from xtl.cli import XTLCLI

    result = RunResult()
    began: list[float] = []

    class Clock(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, module: Any) -> None:
            began.append(time.perf_counter())

        def on_train_batch_end(self, trainer: pl.Trainer, module: Any, *args: Any) -> None:
            if trainer.global_step % module.updates.steps_per_batch == 0:  # the batch's last update
                metrics = trainer.callback_metrics
                result.batch_ends.append(time.perf_counter() - began[0])
                result.samples.append(float(metrics["rollout/samples"]))
                result.staleness.append(float(metrics["rollout/staleness_max"]))

        def on_validation_end(self, trainer: pl.Trainer, module: Any) -> None:
            if began and "val/exact_match" in trainer.callback_metrics:
                exact = float(trainer.callback_metrics["val/exact_match"])
                result.validations.append((trainer.global_step, time.perf_counter() - began[0], exact))

    root = tempfile.mkdtemp(prefix=f"xtl_{cfg.side}_", dir=cfg.work_dir)
    args = [
        "--config", str(RECIPE), f"--model.init_args.model={cfg.policy}", f"--trainer.max_steps={cfg.steps}",
        f"--trainer.precision={cfg.precision}", f"--trainer.default_root_dir={root}", "--trainer.logger=false",
        "--trainer.enable_progress_bar=false", "--trainer.enable_checkpointing=false", "--trainer.callbacks=[]",
        f"--data.cache_dir={Path(cfg.work_dir) / 'cache'}", "--data.progress=false",
    ]  # fmt: skip
    if cfg.val_every:
        args.append(f"--trainer.val_check_interval={cfg.val_every}")
    else:
        args.append("--trainer.limit_val_batches=0")
    if side["asynchronous"]:
        args += [
            "--model.init_args.rollout.asynchronous=true", "--model.init_args.rollout.max_staleness=1",
            "--model.init_args.engine.name=ray",
            f'--model.init_args.engine.ray={{"num_actors": {cfg.actors}, "num_threads": {cfg.actor_threads}, '
            '"actor_options": {"num_cpus": 0}}',
        ]  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()):
        cli = XTLCLI(args=[*args, *cfg.overrides], run=False)
        cli.trainer.callbacks.append(Clock())
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    if len(result.batch_ends) > 1:
        timed = result.batch_ends[-1] - result.batch_ends[0]
        result.samples_per_s = sum(result.samples[1:]) / timed
    if side["asynchronous"]:
        import ray

        ray.shutdown()
    return result


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, run the paired throughput runs and the two accuracy runs, print the comparison."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=5, help="paired repetitions after warm-up (>= 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed pairs before the timed ones")
    parser.add_argument("--policy", default=str(DEFAULT_POLICY), help="the tiny SFT model's HF export")
    parser.add_argument("--steps", type=int, default=24, help="optimizer steps of each throughput run")
    parser.add_argument("--full-steps", type=int, default=400, help="optimizer steps of each accuracy run")
    parser.add_argument("--val-every", type=int, default=100, help="held-out validation interval (accuracy runs)")
    parser.add_argument("--no-full", action="store_true", help="skip the accuracy runs")
    parser.add_argument("--precision", default="auto", choices=["auto", "bf16-mixed", "32-true"])
    parser.add_argument("--actors", type=int, default=1, help="Ray actors sampling for the async side")
    parser.add_argument("--actor-threads", type=int, default=1, help="threads of each Ray actor (async side)")
    parser.add_argument("--sync-threads", type=int, default=2, help="threads of the sync side (default: both cores)")
    args = parser.parse_args(argv)
    if not (Path(args.policy) / "config.json").is_file():
        raise SystemExit(
            f"--policy {args.policy}: no HF model there; make the tiny SFT export first: xtl fit --config "
            "configs/tiny_sft.yaml --config callbacks/hf_export.yaml --trainer.default_root_dir runs/tiny_sft_export"
        )
    pin_threads(1)
    precision = args.precision if args.precision != "auto" else ("bf16-mixed" if cpu_has_bf16() else "32-true")
    print(f"load average before: {load_average()}")
    sides = side_configs(args.actors, args.sync_threads, args.actor_threads)
    print_configs(**{name: {**side, "recipe": RECIPE.name, "precision": precision} for name, side in sides.items()})
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="xtl-rl-async-") as tmp:

        def side(name: str, steps: int, val_every: int | None = None) -> RunResult:
            config = RunConfig(
                name, args.policy, tmp, steps, precision, val_every, args.actors, args.sync_threads, args.actor_threads
            )
            return in_child(run_side, config)

        def on_pair(i: int, a: float, b: float) -> None:
            print(f"pair {i + 1}: async {a:.1f} samples/s, sync {b:.1f} samples/s, ratio {a / b:.3f}", flush=True)

        throughput = run_pairs(
            lambda: side("async", args.steps).samples_per_s, lambda: side("sync", args.steps).samples_per_s,
            args.pairs, args.warmup, "samples/s (rollout batches after the first)", True, on_pair,
        )  # fmt: skip
        print(f"\nresults ({args.pairs} timed pairs after {args.warmup} warm-up pair(s), order alternating):")
        print(throughput.summary("async", "sync"))
        speedup = statistics.median(throughput.ratios)
        verdict = "reached" if speedup >= TARGET else "NOT reached"
        print(f"async speed-up: {speedup:.2f}x samples/s (target >= {TARGET}x: {verdict})")
        if not args.no_full:
            full = {name: side(name, args.full_steps, args.val_every) for name in ("sync", "async")}
            _print_accuracy(full)
    print(f"total {time.perf_counter() - start:.0f} s; load average after: {load_average()}")


def _print_accuracy(full: dict[str, RunResult]) -> None:
    print("\nheld-out exact match (greedy, 72 arithmetic questions) per validation: step, wall s, exact match")
    for name, result in full.items():
        points = ", ".join(f"{step}: {seconds:.0f} s {exact:.3f}" for step, seconds, exact in result.validations)
        staleness = max(result.staleness, default=0.0)
        print(f"  {name:5s} {points}  (max staleness {staleness:g}; {result.samples_per_s:.1f} samples/s)")
    target = full["sync"].validations[-1][2] if full["sync"].validations else None
    if target is None:
        return
    for name, result in full.items():
        reached = next(((step, seconds) for step, seconds, exact in result.validations if exact >= target), None)
        where = f"step {reached[0]}, {reached[1]:.0f} s" if reached else "not reached"
        print(f"  {name:5s} first validation >= the sync run's final {target:.3f}: {where}")
    final = {name: r.validations[-1][2] for name, r in full.items() if r.validations}
    print(
        f"final exact match: sync {final.get('sync', float('nan')):.3f}, async {final.get('async', float('nan')):.3f}"
    )


if __name__ == "__main__":
    main()
