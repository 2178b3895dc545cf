"""Forward+backward time of xtl vs transformers on the same Qwen3 weights, side by side in one process.

Usage: ``python benchmarks/model_step.py [--layers 4 --hidden 512 --seq 2048 --repeats 5]``.
Each model runs its own training call on the same tokens: transformers ``model(input_ids, labels)`` with SDPA;
xtl ``model(seq_ctx, labels, return_logits=False)`` (SDPA, fused chunked head + loss). Timings interleave the
two models and report medians; the ratio is xtl / transformers (<= 1.0 means xtl is not slower).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

from xtl.model import SequenceContext, get_model_config_from_hf
from xtl.ops import shift_labels


def main() -> None:
    """Parse arguments, run the benchmark, print one line per dtype."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    args = parser.parse_args()
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256),
        head_dim=64,
    )
    print(
        f"Qwen3-style model: {args.layers} layers, hidden {args.hidden}, seq {args.seq}, vocab {args.vocab}, "
        f"threads {torch.get_num_threads()}"
    )
    with tempfile.TemporaryDirectory() as path:
        Qwen3ForCausalLM(config).save_pretrained(path)
        for dtype_name in args.dtypes.split(","):
            dtype = getattr(torch, dtype_name)
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").train()
            xtl = get_model_config_from_hf(path).build()
            xtl.from_hf(path)
            xtl = xtl.to(dtype).train()
            ids = torch.randint(0, args.vocab, (1, args.seq))
            times = _time_pair(xtl, hf, ids, args.repeats)
            x, h = statistics.median(times["xtl"]), statistics.median(times["transformers"])
            print(
                f"{dtype_name:9s} fwd+bwd median: xtl {x * 1e3:8.1f} ms | transformers {h * 1e3:8.1f} ms | "
                f"ratio xtl/transformers = {x / h:.3f}"
            )


def _time_pair(xtl: torch.nn.Module, hf: torch.nn.Module, ids: torch.Tensor, repeats: int) -> dict[str, list[float]]:
    ctx, targets = SequenceContext.from_input_ids(ids), shift_labels(ids)
    steps = {
        "xtl": lambda: xtl(seq_ctx=ctx, labels=targets, return_logits=False).loss,
        "transformers": lambda: hf(input_ids=ids, labels=ids).loss,
    }
    times: dict[str, list[float]] = {"xtl": [], "transformers": []}
    for i in range(repeats + 1):  # first round is warm-up
        for name, model in (("xtl", xtl), ("transformers", hf)):
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            steps[name]().backward()
            if i:
                times[name].append(time.perf_counter() - start)
    return times


if __name__ == "__main__":
    main()
