"""Optimizer-step time and optimizer-state memory of Muon (``xtl.train.MuonConfig``) vs fused AdamW (``AdamWConfig``).

Usage::

    python benchmarks/optimizer_step.py [--threads 1 --pairs 7 --warmup 1 --layers 4 --hidden 512 --vocab 32000
                                         --adjust-lr match_rms_adamw]

Method:

1. Two copies of one xtl Qwen3 model (``--layers`` x ``--hidden``, intermediate 3 x hidden, head_dim 64, untied
   embedding and LM head, random init seed 0, fp32 weights), each with its optimizer built by its config over
   xtl's parameter groups: Muon on the linear weights of the decoder layers (Newton-Schulz, 5 steps, in bf16),
   AdamW on the embedding, head and norms; or fused AdamW (torch's one kernel per device and dtype) on all of them.
2. Every parameter gets the same fixed random gradient on both sides; the timed work is ``optimizer.step()`` alone
   (forward and backward are the same for both and left out).
3. Timing protocol (``benchmarks/_paired.py``): threads pinned (``--threads``, default 1), ``--warmup`` untimed
   pairs (the first step allocates the state), then ``--pairs`` (>= 5) timed pairs whose order alternates.
   Printed: both medians and the median of the per-pair ratios Muon/AdamW with its min..max, for wall and process
   CPU seconds.
4. Optimizer-state memory: the bytes of every tensor in ``optimizer.state`` after the warm-up (exact, not sampled):
   Muon keeps one momentum buffer per matrix, AdamW two moments (and a step count) per parameter.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from _paired import PairedResult, add_protocol_args, load_average, pin_threads, print_configs, run_pairs

SIDES = ("muon", "adamw")


def main() -> None:
    """Parse arguments, build both sides, time their steps and print the results."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_protocol_args(parser, pairs=7, warmup=1)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512, help="hidden size (heads = hidden/64, head_dim 64)")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--adjust-lr", default="match_rms_adamw", choices=("original", "match_rms_adamw"))
    args = parser.parse_args()
    pin_threads(args.threads)
    print(f"load average before: {load_average()}")
    configs = _configs(args)
    optimizers, states, params = {}, {}, 0
    for side in SIDES:
        model = _model(args)
        params = sum(p.numel() for p in model.parameters())
        optimizers[side] = configs[side].build(model, torch.device("cpu"))
        optimizers[side].step()  # allocates the state
        states[side] = _state_bytes(optimizers[side])
    muon_groups = [g for g in optimizers["muon"].param_groups if g["use_muon"]]
    muon_matrices = sum(p.numel() for g in muon_groups for p in g["params"])
    print(
        f"model: xtl Qwen3, {args.layers} layers, hidden {args.hidden}, vocab {args.vocab} (untied head), "
        f"{params / 1e6:.1f}M params of which {muon_matrices / 1e6:.1f}M in Muon matrices | threads "
        f"{torch.get_num_threads()} | {args.warmup} warm-up + {args.pairs} timed pairs, order alternating"
    )
    print_configs(
        muon=_describe(configs["muon"], "Muon on linear weights, AdamW (fused) on embedding, head, norms"),
        adamw=_describe(configs["adamw"], "fused AdamW on every parameter"),
    )
    cpu: dict[str, list[float]] = {side: [] for side in SIDES}

    def timed(side: str) -> Callable[[], float]:
        def run() -> float:
            wall, cpu_start = time.perf_counter(), time.process_time()
            optimizers[side].step()
            cpu[side].append(time.process_time() - cpu_start)
            return time.perf_counter() - wall

        return run

    result = run_pairs(timed("muon"), timed("adamw"), args.pairs, args.warmup, "optimizer step seconds")
    print(result.summary("muon", "adamw"))
    cpu_result = PairedResult("optimizer step CPU seconds", cpu["muon"][args.warmup :], cpu["adamw"][args.warmup :])
    print(cpu_result.summary("muon", "adamw"))
    print(
        f"optimizer state: muon {states['muon'] / 2**20:.1f} MiB | adamw {states['adamw'] / 2**20:.1f} MiB | "
        f"ratio {states['muon'] / states['adamw']:.3f}"
    )
    print(f"load average after: {load_average()}")


def _configs(args: argparse.Namespace) -> dict[str, object]:
    from xtl.train import AdamWConfig, MuonConfig

    lr = 3e-4 if args.adjust_lr == "match_rms_adamw" else 0.02
    return {
        "muon": MuonConfig(lr=lr, weight_decay=0.1, adjust_lr=args.adjust_lr, adamw_lr=3e-4),
        "adamw": AdamWConfig(lr=3e-4, weight_decay=0.1),
    }


def _describe(config: object, what: str) -> dict[str, object]:
    from dataclasses import asdict

    settings = {k: v for k, v in asdict(config).items() if k not in ("lr_scales", "muon_params", "adamw_params")}
    return {"what": what, **settings, "weights": "fp32", "threads": torch.get_num_threads()}


def _model(args: argparse.Namespace) -> torch.nn.Module:
    from xtl.train import resolve_model_config

    heads = max(1, args.hidden // 64)
    spec = {
        "model_type": "qwen3",
        "vocab_size": args.vocab,
        "hidden_size": args.hidden,
        "intermediate_size": 3 * args.hidden,
        "num_hidden_layers": args.layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, args.hidden // 256),
        "head_dim": 64,
        "tie_word_embeddings": False,
    }
    config, _ = resolve_model_config(spec)
    model = config.build()
    torch.manual_seed(0)
    model.init_weights()
    generator = torch.Generator().manual_seed(1)
    for param in model.parameters():
        param.grad = torch.randn(param.shape, generator=generator) * 1e-3
    return model


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    tensors = [t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
    return sum(t.numel() * t.element_size() for t in tensors)


if __name__ == "__main__":
    main()
