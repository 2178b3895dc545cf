"""Context parallelism on CPU: activation memory per rank and step time, CP=1 (one process, the whole pack) against
CP=2 (two gloo processes, half the pack each, Ulysses attention).

Usage: ``python benchmarks/long_context.py [--seqs 8192,16384 --pairs 5 --warmup 1 --threads 1]``.

Two processes start once (``--threads`` threads each). For every sequence length both sides run in them:

- CP=1: rank 0 trains the whole pack alone (rank 1 waits);
- CP=2: both ranks train their half of the same pack (:func:`xtl.data.collate.split_for_context_parallel`), the
  attention modules going through :class:`xtl.ops.ulysses.UlyssesAttention`.

Memory (rank 0, one forward after warm-up, before backward): ``act``, the bytes of the storages created during the
forward that are still alive (what autograd keeps for backward, the all-to-all buffers included), parameters
excluded. Time: forward + backward of one step, ``--pairs`` pairs after ``--warmup``, the order alternating; the
median CP=2 / CP=1 ratio with its min..max. Target (issue 24): ``act`` at CP=2 <= 0.55x CP=1 at 16k tokens.

On GPUs the comparison is two training runs with the same tokens per GPU (printed at the end): the recipe
``configs/qwen3_8b_long_context.yaml`` (64k-token sequences over cp 4) against 16k-token sequences without cp.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._paired import add_protocol_args, load_average, pin_threads, print_configs, run_pairs  # noqa: E402

CP = 2
GPU_COMMAND = (
    "xtl fit --config configs/qwen3_8b_long_context.yaml   # 64k-token sequences, cp 4: 16k tokens per GPU\n"
    "xtl fit --config configs/qwen3_8b_long_context.yaml --trainer.strategy.init_args.context_parallel_size 1 \\\n"
    "    --data.pack_max_length 16384   # the same 16k tokens per GPU without cp: train/tokens_per_sec compares"
)


def main() -> None:
    """Start the two processes, print the configurations and one line per sequence length."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_protocol_args(parser)
    parser.add_argument("--seqs", default="8192,16384", help="packed sequence lengths (comma-separated)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=4096)
    args = parser.parse_args()
    pin_threads(args.threads)
    protocol = {"threads_per_process": args.threads, "pairs": args.pairs, "warmup": args.warmup, "dtype": "fp32"}
    print_configs(
        model=_spec(args),
        cp1={"processes": 1, "tokens_per_process": "the whole pack", "attention": "sdpa", **protocol},
        cp2={"processes": CP, "tokens_per_process": f"1/{CP} of the pack", "attention": "Ulysses + sdpa", **protocol},
    )
    print(f"load average before: {load_average()}")
    port = _free_port()
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"xtl_long_context_{os.getpid()}.json"
    mp.spawn(_worker, args=(args, port, str(out)), nprocs=CP, join=True)
    results = json.loads(out.read_text())
    out.unlink()
    print(f"{'tokens':>7s} {'act CP=1 MiB':>13s} {'act CP=2 MiB':>13s} {'act ratio':>9s}  step time CP=2 / CP=1")
    for seq, row in results.items():
        ratios = row["time_ratios"]
        print(
            f"{int(seq):7d} {row['act'][0] / 2**20:13.1f} {row['act'][1] / 2**20:13.1f} "
            f"{row['act'][1] / row['act'][0]:9.3f}  median {statistics.median(ratios):.3f} "
            f"(min {min(ratios):.3f} .. max {max(ratios):.3f}, {len(ratios)} pairs; CP=1 median "
            f"{statistics.median(row['time'][0]):.2f} s, CP=2 median {statistics.median(row['time'][1]):.2f} s)"
        )
    print(f"load average after: {load_average()}")
    print("\nOn GPUs:\n" + GPU_COMMAND)


# ---- private ---------------------------------------------------------------------------------------------------


def _spec(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "model_type": "qwen3",
        "vocab_size": args.vocab,
        "hidden_size": args.hidden,
        "intermediate_size": 3 * args.hidden,
        "num_hidden_layers": args.layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "attn_impl": "sdpa",
        "max_position_embeddings": 1 << 17,
    }


def _worker(rank: int, args: argparse.Namespace, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    pin_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=CP)
    whole, split = _model(args), _model(args)
    for module in split.attention_modules():
        module.use_context_parallel(dist.group.WORLD)
    results = {}
    for seq in (int(s) for s in args.seqs.split(",")):
        batch = _micro_batch(args, seq)
        share = _split(batch, rank)
        sides = {
            1: (lambda b=batch: _step(whole, b)) if rank == 0 else (lambda: 0.0),
            2: lambda s=share: _step(split, s),
        }

        def side(cp: int, sides: dict = sides) -> float:
            dist.barrier()  # rank 1 waits while rank 0 runs CP=1 alone
            seconds = sides[cp]()
            dist.barrier()
            return seconds

        if rank == 0:  # one untimed step of each side first
            _step(whole, batch)
        _step(split, share)
        act = [_activation_bytes(whole, batch) if rank == 0 else 0, _activation_bytes(split, share)]
        timed = run_pairs(lambda: side(1), lambda: side(2), args.pairs, args.warmup)
        results[seq] = {
            "act": act,
            "time": [timed.a, timed.b],
            "time_ratios": [b / a for a, b in zip(timed.a, timed.b)] if rank == 0 else [],
        }
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def _model(args: argparse.Namespace) -> torch.nn.Module:
    from xtl.train.model_spec import resolve_model_config

    config, _ = resolve_model_config(_spec(args), None)
    model = config.build()
    torch.manual_seed(0)
    model.init_weights()
    return model.train()


def _micro_batch(args: argparse.Namespace, seq: int) -> Any:
    from xtl.data import Pack, collate_pack

    generator = torch.Generator().manual_seed(seq)
    ids = torch.randint(1, args.vocab, (seq,), generator=generator).numpy()
    lengths = [seq // 2, seq // 4, seq // 8, seq - seq // 2 - seq // 4 - seq // 8]  # documents cross the cut
    return collate_pack(Pack(0, ids, ids.copy(), lengths))


def _split(batch: Any, rank: int) -> Any:
    from xtl.data.collate import split_for_context_parallel

    return split_for_context_parallel(batch, rank, CP)


def _step(model: torch.nn.Module, batch: Any) -> float:
    start = time.perf_counter()
    out = model(seq_ctx=batch.seq_ctx, labels=batch.labels, return_logits=False)
    out.loss_sum.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def _activation_bytes(model: torch.nn.Module, batch: Any) -> int:
    from xtl.tools._memory_measure import CreatedStorages

    params = {p.untyped_storage()._cdata for p in model.parameters()}
    created = CreatedStorages()
    with created:
        out = model(seq_ctx=batch.seq_ctx, labels=batch.labels, return_logits=False)
    held = created.alive_bytes(params)
    out.loss_sum.backward()
    model.zero_grad(set_to_none=True)
    return held


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


if __name__ == "__main__":
    main()
