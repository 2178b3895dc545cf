"""MoE training step with expert parallelism EP=1 vs EP=2 on the same CPU processes (gloo), side by side.

Usage::

    python benchmarks/moe_step.py [--family qwen3_moe --hidden 256 --layers 4 --experts 16 --top-k 2
                                   --moe-intermediate 256 --vocab 4096 --seq 1024 --micro-batches 2
                                   --threads 1 --warmup 2 --pairs 7]

With the defaults it takes about 2 minutes on 2 CPU cores (3 spawns of 2 processes).

Layouts (both on the same ``--procs`` processes, default 2, gloo, ``torch.multiprocessing.spawn``):

- EP=1: FSDP2 over all ranks (``fully_shard_model(model, mesh=init_device_mesh("cpu", (procs,)))``); every rank
  computes every expert, and each decoder layer's parameters (its experts included) are all-gathered for forward and
  again for backward.
- EP=``--ep`` (default: ``--procs``): the routed experts of every MoE layer are split over the ranks
  (``split_experts``), tokens reach them by all-to-all (``AllToAllDispatcher``), experts are FSDP-sharded over the
  (here size-1) ``efsdp`` mesh (``shard_experts``) and the dense parameters over all ranks -- the sequence
  ``FSDPStrategy(expert_parallel_size=ep)`` runs.

Both start from the same seeded weights (``init_weights`` gives the unsharded model's values in either layout) and
see the same data: each rank owns ``--micro-batches`` packs of ``--seq`` random tokens cut into random-length
documents (``SequenceContext.from_lengths``). One step is what ``LanguageModule.training_step`` does without the MoE
router losses: ``forward_backward`` over the rank's micro-batches (gradient sync on the last one), gradient-norm clip
(``grad_norm_and_clip``), AdamW step (``AdamWConfig(...).build``), ``zero_grad``.

Method:

1. Timing spawn: both models and optimizers live in the same processes. ``--warmup`` steps of each layout, then
   ``--pairs`` paired repetitions, EP=1 first in even pairs and EP=ep first in odd ones. Each step is timed with
   ``time.perf_counter`` from a ``dist.barrier()`` to its end; a side's step time is the maximum over ranks
   (all-reduce MAX). The first-step loss of both layouts is printed as a check that they compute the same thing.
2. Memory spawns, one per layout (nothing else built in them): ``--mem-steps`` steps, then per-rank bytes of
   parameters, gradients (read before ``zero_grad`` of the last step) and AdamW state, exact from the local shards
   of the tensors (split into routed experts and the rest), and the peak RSS
   (``resource.getrusage(RUSAGE_SELF).ru_maxrss``; ``VmHWM`` as a cross-check, and the RSS before the model was
   built).

Prints both configurations (model config, tokens per step, layouts, dtype, threads), every warm-up and pair time, the
median ratio EP/EP1 of step time and of tokens/s with its min..max spread over pairs, the memory table as ratios
EP/EP1, and the command that measures the real figure on 8 GPUs. The CPU ratio is informational only (few cores,
gloo collectives through shared memory): it is not a prediction for GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from xtl.model import SequenceContext
from xtl.module.experts import GroupedExperts
from xtl.ops import shift_labels
from xtl.strategies.expert_parallel import shard_experts, split_experts
from xtl.strategies.layout import ParallelLayout
from xtl.strategies.parallelize import fully_shard_model
from xtl.train import resolve_model_config
from xtl.train.optim import AdamWConfig
from xtl.train.step import StepResult, forward_backward, grad_norm_and_clip

MiB = 2**20
FAMILIES = ("qwen3_moe", "deepseek_v3", "gpt_oss")
GPU_RECIPE = "configs/qwen3_30b_a3b_sft.yaml"

Batch = tuple[SequenceContext, torch.Tensor]


# ---- configuration ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags (``--help`` lists them with their defaults)."""
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=lambda prog: argparse.RawDescriptionHelpFormatter(prog, max_help_position=32),
    )
    model = parser.add_argument_group("model (tiny settings of the chosen family)")
    model.add_argument("--family", choices=FAMILIES, default="qwen3_moe", help="MoE family (default: %(default)s)")
    model.add_argument("--hidden", type=int, default=256, help="hidden size (default: %(default)s)")
    model.add_argument("--layers", type=int, default=4, help="decoder layers (default: %(default)s)")
    model.add_argument("--experts", type=int, default=16, help="routed experts per MoE layer (default: %(default)s)")
    model.add_argument("--top-k", type=int, default=2, help="experts per token (default: %(default)s)")
    model.add_argument(
        "--moe-intermediate", type=int, default=256, help="width of one routed expert (default: %(default)s)"
    )
    model.add_argument(
        "--dense-intermediate",
        type=int,
        default=768,
        help="width of dense MLPs: deepseek_v3's first (dense) layer, unused by the other families "
        "(default: %(default)s)",
    )
    model.add_argument(
        "--head-dim",
        type=int,
        default=64,
        help="attention head width; heads = hidden / head-dim (default: %(default)s)",
    )
    model.add_argument("--vocab", type=int, default=4096, help="vocabulary size (default: %(default)s)")
    data = parser.add_argument_group("data and step")
    data.add_argument("--seq", type=int, default=1024, help="tokens per micro-batch (pack) (default: %(default)s)")
    data.add_argument(
        "--micro-batches", type=int, default=2, help="micro-batches per rank per step (default: %(default)s)"
    )
    data.add_argument(
        "--min-doc", type=int, default=64, help="shortest random document in a pack (default: %(default)s)"
    )
    data.add_argument(
        "--max-doc", type=int, default=512, help="longest random document in a pack (default: %(default)s)"
    )
    data.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (default: %(default)s)")
    data.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clip norm (default: %(default)s)")
    data.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="FSDP compute dtype (MixedPrecisionPolicy.param_dtype; fp32 master weights, fp32 reduce) "
        "(default: %(default)s)",
    )
    data.add_argument("--seed", type=int, default=0, help="seed of the weights and the data (default: %(default)s)")
    run = parser.add_argument_group("run")
    run.add_argument("--procs", type=int, default=2, help="processes (ranks), gloo (default: %(default)s)")
    run.add_argument("--ep", type=int, default=None, help="expert-parallel size of the EP side (default: --procs)")
    run.add_argument("--threads", type=int, default=1, help="torch threads per process (default: %(default)s)")
    run.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="warm-up steps per layout, printed, not in the ratio (default: %(default)s)",
    )
    run.add_argument("--pairs", type=int, default=7, help="paired timed repetitions, >= 5 (default: %(default)s)")
    run.add_argument(
        "--mem-steps", type=int, default=3, help="steps of each memory spawn before reading (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    args.ep = args.procs if args.ep is None else args.ep
    if args.pairs < 5:
        parser.error("--pairs must be >= 5")
    if args.ep < 2 or args.procs % args.ep or args.experts % args.ep:
        parser.error(f"--ep ({args.ep}) must be >= 2 and divide --procs ({args.procs}) and --experts ({args.experts})")
    if args.hidden % args.head_dim:
        parser.error("--hidden must be a multiple of --head-dim")
    if not 0 < args.min_doc <= args.max_doc:
        parser.error("need 0 < --min-doc <= --max-doc")
    return args


def model_spec(args: argparse.Namespace) -> dict[str, Any]:
    """The ``resolve_model_config`` dict of the chosen family with the benchmark's tiny dimensions."""
    heads = args.hidden // args.head_dim
    spec: dict[str, Any] = {
        "model_type": args.family,
        "vocab_size": args.vocab,
        "hidden_size": args.hidden,
        "num_hidden_layers": args.layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 2),
        "head_dim": args.head_dim,
        "max_position_embeddings": max(args.seq, 128),
        "num_experts_per_tok": args.top_k,
        "tie_word_embeddings": False,
        "attn_impl": "sdpa",
    }
    if args.family == "qwen3_moe":
        spec.update(
            num_experts=args.experts,
            moe_intermediate_size=args.moe_intermediate,
            intermediate_size=args.dense_intermediate,
            norm_topk_prob=True,
        )
    elif args.family == "deepseek_v3":
        n_group = 4 if args.experts % 4 == 0 else 1
        spec.update(
            n_routed_experts=args.experts,
            moe_intermediate_size=args.moe_intermediate,
            intermediate_size=args.dense_intermediate,
            n_group=n_group,
            topk_group=max(1, n_group // 2),
            first_k_dense_replace=1,
            n_shared_experts=1,
            num_key_value_heads=heads,
            kv_lora_rank=args.hidden // 2,
            q_lora_rank=args.hidden * 3 // 4,
            qk_rope_head_dim=args.head_dim // 2,
            qk_nope_head_dim=args.head_dim // 2,
            v_head_dim=args.head_dim,
        )
    else:  # gpt_oss: intermediate_size is the width of one expert; YaRN x32 over its 4096-token original context
        spec.update(
            num_local_experts=args.experts,
            intermediate_size=args.moe_intermediate,
            sliding_window=128,
            max_position_embeddings=max(args.seq, 32 * 4096),
        )
    return spec


# ---- model, data and step (run inside the spawned ranks) -------------------------------------------------------


def build_model(args: argparse.Namespace, ep: int) -> nn.Module:
    """The model on ``meta``, distributed for layout ``ep`` (1: FSDP over all ranks), materialized, seeded."""
    config, _ = resolve_model_config(model_spec(args))
    with torch.device("meta"):
        model = config.build()
    param_dtype = getattr(torch, args.dtype)
    fsdp_kwargs = {
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=None if param_dtype == torch.float32 else param_dtype, reduce_dtype=torch.float32
        ),
        "reshard_after_forward": True,
    }
    meshes = ParallelLayout(dp_shard=dist.get_world_size(), ep=ep).build("cpu")
    if ep > 1:
        shard_experts(split_experts(model, meshes.ep), meshes, fsdp_kwargs)
    fully_shard_model(model, mesh=meshes.fsdp, **fsdp_kwargs)
    model.materialize("cpu")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(args.seed)
        model.init_weights()
    return model.train()


def micro_batches(args: argparse.Namespace, rank: int) -> list[Batch]:
    """This rank's packs: ``--seq`` random tokens cut into documents of ``--min-doc..--max-doc`` tokens."""
    g = torch.Generator().manual_seed(args.seed * 1000 + rank + 1)
    batches = []
    for _ in range(args.micro_batches):
        lengths: list[int] = []
        while sum(lengths) < args.seq:
            n = int(torch.randint(args.min_doc, args.max_doc + 1, (), generator=g))
            lengths.append(min(n, args.seq - sum(lengths)))
        ids = torch.randint(0, args.vocab, (args.seq,), generator=g)
        labels = torch.cat([shift_labels(doc[None])[0] for doc in ids.split(lengths)])
        batches.append((SequenceContext.from_lengths(ids[None], lengths), labels[None]))
    return batches


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: list[Batch],
    max_grad_norm: float,
    before_zero_grad: Callable[[], None] | None = None,
) -> StepResult:
    """One optimizer step: forward/backward over ``batches``, clip, AdamW step, ``zero_grad``."""
    result = forward_backward(
        forward=lambda mb: model(seq_ctx=mb[0], labels=mb[1], return_logits=False),
        micro_batches=batches,
        num_tokens=lambda mb: int((mb[1] != -100).sum()),
        dp_world_size=dist.get_world_size(),
        backward=lambda loss: loss.backward(),
        device=torch.device("cpu"),
        group=dist.group.WORLD,  # every rank is a data rank of the benchmark's layout
        gradient_sync=model.set_requires_gradient_sync,
    )
    grad_norm_and_clip(list(model.parameters()), max_grad_norm)
    optimizer.step()
    if before_zero_grad is not None:
        before_zero_grad()
    optimizer.zero_grad(set_to_none=True)
    return result


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Seconds of ``fn()`` from a barrier to its end on the slowest rank (all-reduce MAX), and its result."""
    dist.barrier()
    start = time.perf_counter()
    out = fn()
    elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed), out


def global_loss(result: StepResult) -> float:
    """Mean token loss of the step over all ranks."""
    loss_sum = result.loss_sum.clone()
    dist.all_reduce(loss_sum)
    return float(loss_sum / result.global_tokens.clamp(min=1))


def _init_rank(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=args.procs)


def _timing_worker(rank: int, args: argparse.Namespace, port: int, out: str) -> None:
    _init_rank(rank, args, port)
    batches = micro_batches(args, rank)
    sides = {}
    for ep in (1, args.ep):
        model = build_model(args, ep)
        sides[ep] = (model, AdamWConfig(lr=args.lr).build(model, torch.device("cpu")))

    def step(ep: int) -> StepResult:
        return train_step(*sides[ep], batches, args.max_grad_norm)

    warmup: dict[int, list[float]] = {1: [], args.ep: []}
    first_loss = {}
    for ep in (1, args.ep):
        for i in range(args.warmup):
            seconds, result = timed(lambda ep=ep: step(ep))
            warmup[ep].append(seconds)
            if i == 0:
                first_loss[ep] = global_loss(result)
    pairs = []
    for i in range(args.pairs):
        order = (1, args.ep) if i % 2 == 0 else (args.ep, 1)
        times = {ep: timed(lambda ep=ep: step(ep))[0] for ep in order}
        pairs.append({"first": order[0], "ep1": times[1], "ep": times[args.ep]})
    last_loss = {ep: global_loss(step(ep)) for ep in (1, args.ep)}
    if rank == 0:
        Path(out).write_text(
            json.dumps(
                {
                    "threads": torch.get_num_threads(),
                    "torch": torch.__version__,
                    "warmup": {str(k): v for k, v in warmup.items()},
                    "first_loss": {str(k): v for k, v in first_loss.items()},
                    "last_loss": {str(k): v for k, v in last_loss.items()},
                    "pairs": pairs,
                    "params": _param_counts(sides[1][0]),
                }
            )
        )
    dist.barrier()
    dist.destroy_process_group()


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def _expert_param_ids(model: nn.Module) -> set[int]:
    return {id(p) for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()}


def _param_counts(model: nn.Module) -> dict[str, int]:
    """Global parameter counts: all, routed experts, and one MoE layer's routed experts."""
    expert_modules = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    experts = sum(p.numel() for m in expert_modules for p in m.parameters())
    total = sum(p.numel() for p in model.parameters())
    per_layer = sum(p.numel() for p in expert_modules[0].parameters()) if expert_modules else 0
    return {"total": total, "experts": experts, "experts_per_layer": per_layer, "moe_layers": len(expert_modules)}


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's bytes of parameters, gradients and optimizer state (local shards), experts vs the rest."""
    expert_ids = _expert_param_ids(model)
    out = {f"{kind}_{part}": 0 for kind in ("params", "grads", "optim") for part in ("experts", "dense")}
    for p in model.parameters():
        part = "experts" if id(p) in expert_ids else "dense"
        out[f"params_{part}"] += _local_bytes(p)
        if p.grad is not None:
            out[f"grads_{part}"] += _local_bytes(p.grad)
        for value in optimizer.state.get(p, {}).values():
            if torch.is_tensor(value):
                out[f"optim_{part}"] += _local_bytes(value)
    return out


def _vm_hwm_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return -1


def _memory_worker(rank: int, args: argparse.Namespace, port: int, ep: int, out: str) -> None:
    _init_rank(rank, args, port)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    batches = micro_batches(args, rank)
    model = build_model(args, ep)
    optimizer = AdamWConfig(lr=args.lr).build(model, torch.device("cpu"))
    captured: dict[str, int] = {}

    def capture() -> None:
        captured.update(state_bytes(model, optimizer))

    for i in range(args.mem_steps):
        train_step(model, optimizer, batches, args.max_grad_norm, capture if i == args.mem_steps - 1 else None)
    mine = {
        **captured,
        "rss_before_kib": rss_before,
        "ru_maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "vm_hwm_kib": _vm_hwm_kib(),
    }
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.barrier()
    dist.destroy_process_group()


# ---- parent: spawn, collect, print -----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} (min..max {min(values):.3f}..{max(values):.3f})"


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def print_configuration(args: argparse.Namespace) -> None:
    """Both layouts, the model, the data and the run settings."""
    tokens = args.procs * args.micro_batches * args.seq
    print(f"== MoE training step: EP=1 vs EP={args.ep} (CPU, gloo; informational) ==")
    print(f"model ({args.family}), resolve_model_config({json.dumps(model_spec(args))})")
    print(
        f"step: {args.procs} ranks x {args.micro_batches} micro-batches x {args.seq} tokens = {tokens} tokens/step "
        f"(random tokens, documents of {args.min_doc}..{args.max_doc} tokens packed with SequenceContext.from_lengths)"
        f"; forward_backward + grad_norm_and_clip({args.max_grad_norm}) + AdamW(lr={args.lr}) step + zero_grad"
    )
    print(
        f"dtype: compute {args.dtype} (FSDP MixedPrecisionPolicy), fp32 master weights and gradient reduce; "
        f"threads: {args.threads} per process (torch.set_num_threads, OMP_NUM_THREADS), {args.procs} processes, "
        f"os.cpu_count()={os.cpu_count()}"
    )
    print(
        f"layout EP=1: FSDP2 over {args.procs} ranks (mesh ({args.procs},)); every rank computes all {args.experts} "
        "experts of each layer, a layer's experts are all-gathered with the layer (forward and backward)"
    )
    print(
        f"layout EP={args.ep}: mesh (efsdp={args.procs // args.ep}, ep={args.ep}); {args.experts // args.ep} experts "
        f"per rank per layer, tokens exchanged by all-to-all; dense parameters FSDP2 over all {args.procs} ranks"
    )
    print(
        f"timing: {args.warmup} warm-up steps per layout, then {args.pairs} pairs alternating which layout goes "
        "first; step time = max over ranks of perf_counter from a barrier to the step's end"
    )


def print_timing(args: argparse.Namespace, res: dict[str, Any]) -> None:
    """Per-pair times and the median ratios."""
    tokens = args.procs * args.micro_batches * args.seq
    e = str(args.ep)
    params = res["params"]
    print(
        f"parameters (global): {params['total'] / 1e6:.2f} M, routed experts {params['experts'] / 1e6:.2f} M "
        f"({params['moe_layers']} MoE layers x {params['experts_per_layer'] / 1e6:.3f} M); torch {res['torch']}, "
        f"threads reported by the ranks: {res['threads']}"
    )
    print(
        f"loss check (same weights, same data): step-1 loss EP=1 {res['first_loss']['1']:.6f} | "
        f"EP={e} {res['first_loss'][e]:.6f}; after all steps EP=1 {res['last_loss']['1']:.6f} | "
        f"EP={e} {res['last_loss'][e]:.6f}"
    )
    warm = " | ".join(f"EP={k}: " + ", ".join(f"{t * 1e3:.0f}" for t in v) + " ms" for k, v in res["warmup"].items())
    print(f"warm-up steps (not in the ratio): {warm}")
    print(f"{'pair':>4} {'first':>6} {'EP=1 ms':>9} {f'EP={e} ms':>9} {f'EP{e}/EP1':>8}")
    for i, pair in enumerate(res["pairs"]):
        print(
            f"{i:>4} {'EP=' + str(pair['first']):>6} {pair['ep1'] * 1e3:9.1f} {pair['ep'] * 1e3:9.1f} "
            f"{pair['ep'] / pair['ep1']:8.3f}"
        )
    ep1 = [p["ep1"] for p in res["pairs"]]
    epn = [p["ep"] for p in res["pairs"]]
    print(
        f"median step time: EP=1 {statistics.median(ep1) * 1e3:.1f} ms ({tokens / statistics.median(ep1):.0f} tok/s)"
        f" | EP={e} {statistics.median(epn) * 1e3:.1f} ms ({tokens / statistics.median(epn):.0f} tok/s)"
    )
    print(f"ratio step time EP{e}/EP1, median over pairs: {_spread([b / a for a, b in zip(ep1, epn, strict=True)])}")
    print(f"ratio tokens/s  EP{e}/EP1, median over pairs: {_spread([a / b for a, b in zip(ep1, epn, strict=True)])}")


def print_memory(args: argparse.Namespace, mem: dict[int, list[dict[str, int]]], params: dict[str, int]) -> None:
    """Per-rank training-state bytes and peak RSS of each layout's own spawn, as ratios EP/EP1."""
    e = args.ep
    print(
        f"memory (separate spawn per layout, {args.mem_steps} steps each; state read before the last zero_grad; "
        "exact bytes of the local shards; max over ranks, MiB):"
    )
    print(f"  {'':24} {'EP=1':>10} {f'EP={e}':>10} {f'EP{e}/EP1':>9}")

    def row(label: str, key: Callable[[dict[str, int]], float]) -> None:
        a, b = max(key(r) for r in mem[1]), max(key(r) for r in mem[e])
        print(f"  {label:24} {a / MiB:10.3f} {b / MiB:10.3f} {b / a if a else float('nan'):9.3f}")

    for kind, name in (("params", "parameters"), ("grads", "gradients"), ("optim", "AdamW state")):
        row(f"{name} (experts)", lambda r, k=kind: r[f"{k}_experts"])
        row(f"{name} (rest)", lambda r, k=kind: r[f"{k}_dense"])
    parts = [f"{k}_{p}" for k in ("params", "grads", "optim") for p in ("experts", "dense")]
    row("params+grads+AdamW", lambda r: sum(r[k] for k in parts))
    row("peak RSS (ru_maxrss)", lambda r: r["ru_maxrss_kib"] * 1024)
    row("peak RSS (VmHWM)", lambda r: r["vm_hwm_kib"] * 1024)
    row("RSS before model build", lambda r: r["rss_before_kib"] * 1024)
    for ep in (1, e):
        per_rank = ", ".join(
            f"rank {i}: state {sum(r[k] for k in parts)} B, ru_maxrss {r['ru_maxrss_kib'] / 1024:.1f} MiB"
            for i, r in enumerate(mem[ep])
        )
        print(f"  EP={ep} per rank: {per_rank}")
    width = 2 if args.dtype == "bfloat16" else 4
    layer = params["experts_per_layer"] * width
    print(
        f"  routed-expert weights materialized per MoE layer in forward/backward (computed): EP=1 all {args.experts} "
        f"experts {layer / MiB:.2f} MiB (all-gathered), EP={e} {args.experts // e} experts {layer / e / MiB:.2f} MiB"
    )


def print_gpu_command(args: argparse.Namespace) -> None:
    """The 8-GPU command and what the CPU figure does and does not show."""
    print("== what this CPU figure is ==")
    print(
        f"INFORMATIONAL ONLY: {args.procs} processes x {args.threads} thread(s) on a {os.cpu_count()}-core CPU, gloo "
        "collectives. With FSDP over all ranks, EP=1 already shards the experts' parameters, gradients and AdamW "
        "state, so their persistent bytes per rank match EP; EP removes the all-gather of each layer's experts "
        "(less transient memory and gather traffic) and pays two all-to-alls of the routed tokens per MoE layer in "
        "forward and two in backward. On CPU that trade is timed against slow gloo and tiny experts; on GPUs the "
        "memory it frees is what lets larger MoE models and longer packs fit. The speed figure that counts is the "
        "GPU one below."
    )
    print(
        "== the 8-GPU figure (Qwen3-30B-A3B, EP=8, bf16): logs train/tokens_per_sec, train/tflops_per_device, "
        "train/mfu =="
    )
    print(
        "  QWEN3_30B_A3B_PATH=/path/to/Qwen3-30B-A3B SFT_DATA=/path/to/sft.jsonl \\\n"
        f"    xtl fit --config {GPU_RECIPE} --config callbacks/throughput.yaml \\\n"
        "      --trainer.callbacks.init_args.peak_tflops 989"
    )
    print(
        "  peak_tflops (null in callbacks/throughput.yaml, so no train/mfu without it) is the GPU's dense bf16 peak: "
        "989 for H100/H200 SXM; the override sets the last callback, the one the fragment appends."
    )
    print(
        "  EP=1 baseline on the same node (FSDP only; ~57 GiB/GPU of fp32 params+grads+AdamW for 30.5B parameters, "
        "may not fit): add --trainer.strategy.init_args.expert_parallel_size 1"
    )


def main(argv: list[str] | None = None) -> None:
    """Parse flags, run the timing spawn and one memory spawn per layout, print the report."""
    args = parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by the spawned ranks
    print_configuration(args)
    print(f"load average (1, 5, 15 min) before: {_load()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        timing_out = f"{tmp}/timing.json"
        start = time.perf_counter()
        mp.spawn(_timing_worker, args=(args, _free_port(), timing_out), nprocs=args.procs, join=True)
        timing = json.loads(Path(timing_out).read_text())
        print(f"== timing (one spawn, both layouts; {time.perf_counter() - start:.0f} s) ==")
        print_timing(args, timing)
        memory = {}
        for ep in (1, args.ep):
            mem_out = f"{tmp}/memory_{ep}.json"
            mp.spawn(_memory_worker, args=(args, _free_port(), ep, mem_out), nprocs=args.procs, join=True)
            memory[ep] = json.loads(Path(mem_out).read_text())
    print("== memory ==")
    print_memory(args, memory, timing["params"])
    print(f"load average (1, 5, 15 min) after: {_load()}")
    print_gpu_command(args)


if __name__ == "__main__":
    main()
