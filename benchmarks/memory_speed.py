"""Activation memory and step time of the memory/speed callbacks against no callback, for a dense and an MoE model.

Usage: ``python benchmarks/memory_speed.py [--threads 1 --repeats 5 --seq 1024 --compile-backend inductor]``.

Every configuration runs in a subprocess of its own (CPU, fp32, ``--threads`` threads):

- memory (first, so ``rss`` is the configuration's alone): after warm-up steps, one forward on a packed batch,
  then, before backward,
  - ``act``: bytes of the storages created during forward that are still alive (what autograd holds for
    backward: saved tensors, checkpoint inputs, selective-checkpoint caches, compiled graphs' saved tensors),
    parameters excluded; for offload the host copies are excluded too (on CPU they share the memory, on a GPU
    they would not be on the device);
  - ``hooks``: bytes of the distinct storages an outermost ``saved_tensors_hooks`` sees (what autograd saves
    outside the callbacks' own hooks: checkpoint inputs, offload leaves nothing inside its layers);
  - ``rss``: peak resident memory of the process minus its resident memory before the first step (fwd+bwd,
    no optimizer; on CPU, offload copies stay in the same memory so this does not drop).
- time (then, in the same process): the baseline and the configuration, ``--repeats`` paired forward+backward
  steps after warm-up, the order alternating (baseline first, then configuration first); the ratio of each
  pair, median [min..max].

Targets: full checkpointing cuts ``act`` by >= 60% at <= 1.4x step time; offload cuts it by >= 50%.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

ROOT = Path(__file__).resolve().parents[1]
CONFIGS: dict[str, list[tuple[str, dict[str, Any]]]] = {
    "baseline": [],
    "ckpt full": [("ActivationCheckpointing", {})],
    "ckpt every 2": [("ActivationCheckpointing", {"every_n_layers": 2})],
    "ckpt selective": [("ActivationCheckpointing", {"mode": "selective"})],
    "offload": [("ActivationOffload", {})],
    "offload + ckpt full": [("ActivationOffload", {}), ("ActivationCheckpointing", {})],
    "compile": [("Compile", {})],
}


def main() -> None:
    """Run every model and configuration in subprocesses and print one table per model."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--models", default="dense,moe")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--compile-backend", default="inductor")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        torch.set_num_threads(args.threads)
        print("RESULT " + json.dumps(_measure(args)))
        return
    for model in args.models.split(","):
        spec = _spec(args, model)
        print(f"\n{model}: {json.dumps(spec)}, packed seq {args.seq}, fp32, {args.threads} thread(s), CPU")
        print(f"{'configuration':22s} {'act MiB':>8s} {'act':>6s} {'hooks MiB':>9s} {'rss MiB':>8s} {'step':>18s}")
        base = None
        rows = {}
        for config in args.configs.split(","):
            memory = _run_worker(args, model, config)
            timing = memory.pop("timing")
            base = memory if config == "baseline" else base
            rows[config] = (memory, timing)
            act = memory["act"] / base["act"] if base else float("nan")
            step = "1.00" if timing is None else _ratio_text(timing["ratios"])
            print(
                f"{config:22s} {memory['act'] / 2**20:8.1f} {act:6.2f} {memory['hooks'] / 2**20:9.1f} "
                f"{memory['rss'] / 2**20:8.1f} {step:>18s}"
            )
        _targets(rows)


# ---- private ---------------------------------------------------------------------------------------------------


def _spec(args: argparse.Namespace, model: str) -> dict[str, Any]:
    spec = {
        "model_type": "qwen3",
        "vocab_size": args.vocab,
        "hidden_size": args.hidden,
        "intermediate_size": 3 * args.hidden,
        "num_hidden_layers": args.layers,
        "num_attention_heads": max(1, args.hidden // 64),
        "num_key_value_heads": max(1, args.hidden // 128),
        "head_dim": 64,
        "attn_impl": "sdpa",
    }
    if model == "moe":
        spec.update(model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=args.hidden)
    return spec


def _run_worker(args: argparse.Namespace, model: str, config: str) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", "--model", model, "--config", config]
    for key in ("threads", "repeats", "warmup", "seq", "hidden", "layers", "vocab", "compile_backend"):
        cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{model} {config} failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def _build(args: argparse.Namespace, model: str, config: str) -> tuple[Any, list[Any]]:
    import xtl.callbacks
    from xtl.train.model_spec import resolve_model_config

    callbacks = []
    for name, options in CONFIGS[config]:
        if name == "Compile":
            options = {"backend": args.compile_backend, **options}
        callbacks.append(getattr(xtl.callbacks, name)(**options))
    model_config, _ = resolve_model_config(_spec(args, model), None)
    with torch.device("meta"):
        built = model_config.build()
    for callback in sorted(callbacks, key=lambda c: c.transform_stage):
        built = callback.transform_model(built)
    built.materialize("cpu")
    torch.manual_seed(0)
    built.init_weights()
    return built.train(), callbacks


def _batch(args: argparse.Namespace) -> tuple[Any, torch.Tensor]:
    from xtl.batch import SequenceContext

    generator = torch.Generator().manual_seed(0)
    lengths = [args.seq // 2, args.seq // 4, args.seq - args.seq // 2 - args.seq // 4]
    ids = torch.randint(0, args.vocab, (1, args.seq), generator=generator)
    labels = torch.randint(0, args.vocab, (1, args.seq), generator=generator)
    return SequenceContext.from_lengths(ids, lengths), labels


def _step(model: Any, batch: tuple[Any, torch.Tensor]) -> None:
    model(seq_ctx=batch[0], labels=batch[1], return_logits=False).loss.backward()
    model.zero_grad(set_to_none=True)


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    """Memory of the configuration first (RSS of this process), then its step time against the baseline's."""
    model, callbacks = _build(args, args.model, args.config)
    result = _memory(args, model, callbacks)
    result["timing"] = None if args.config == "baseline" else _time(args, model)
    return result


def _memory(args: argparse.Namespace, model: Any, callbacks: list[Any]) -> dict[str, Any]:
    batch = _batch(args)
    rss_before = _rss()
    for _ in range(args.warmup):
        _step(model, batch)
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    hooked: dict[int, tuple[StorageWeakRef, int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        hooked.setdefault(storage._cdata, (StorageWeakRef(storage), storage.nbytes()))
        return t

    from xtl.tools._memory_measure import CreatedStorages

    created = CreatedStorages()
    compiled = any(type(c).__name__ == "Compile" for c in callbacks)  # a dispatch mode would bypass compiled code
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if compiled:
            loss = model(seq_ctx=batch[0], labels=batch[1], return_logits=False).loss
        else:
            with created:
                loss = model(seq_ctx=batch[0], labels=batch[1], return_logits=False).loss

    def alive(storages: dict[int, tuple[StorageWeakRef, int]]) -> dict[int, int]:
        return {key: size for key, (ref, size) in storages.items() if not ref.expired() and key not in params}

    held = sum(getattr(getattr(c, "stats", None), "held_bytes", 0) for c in callbacks)
    act = sum({**alive(created.storages), **alive(hooked)}.values()) - held
    hooks = sum(alive(hooked).values())
    loss.backward()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before
    return {"act": act, "hooks": hooks, "rss": rss}


def _time(args: argparse.Namespace, other: Any) -> dict[str, Any]:
    base, _ = _build(args, args.model, "baseline")
    batch = _batch(args)
    for _ in range(args.warmup):
        _step(base, batch)
        _step(other, batch)
    ratios, times = [], {"baseline": [], args.config: []}
    for repeat in range(args.repeats):
        order = [("baseline", base), (args.config, other)]
        for name, model in order if repeat % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            _step(model, batch)
            times[name].append(time.perf_counter() - start)
        ratios.append(times[args.config][-1] / times["baseline"][-1])
    return {"ratios": ratios, "seconds": {k: statistics.median(v) for k, v in times.items()}}


def _rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _ratio_text(ratios: list[float]) -> str:
    return f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}..{max(ratios):.2f}]"


def _targets(rows: dict[str, tuple[dict[str, Any], dict[str, Any] | None]]) -> None:
    base = rows.get("baseline", (None, None))[0]
    if base is None:
        return
    if "ckpt full" in rows:
        memory, timing = rows["ckpt full"]
        cut, ratio = 1 - memory["act"] / base["act"], statistics.median(timing["ratios"])
        reached = cut >= 0.6 and ratio <= 1.4
        print(f"target full checkpointing: act -{cut:.0%} (>= 60%), step {ratio:.2f}x (<= 1.4x): {_yes(reached)}")
    if "offload" in rows:
        cut = 1 - rows["offload"][0]["act"] / base["act"]
        print(f"target offload: act -{cut:.0%} (>= 50%): {_yes(cut >= 0.5)}")


def _yes(reached: bool) -> str:
    return "reached" if reached else "NOT reached"


if __name__ == "__main__":
    main()
