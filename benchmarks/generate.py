"""Generation benchmark: xtl's KV-cached decoding vs transformers' ``generate`` on the same tiny model.

    python benchmarks/generate.py [--threads 1 --pairs 5 --warmup 1 --batch 8 --group 1 --new-tokens 64
                                   --temperature 0 --top-p 1 --top-k 0 --prefill packed --attn sdpa
                                   --peer-grad-mode inference_mode]

GRPO-like shape (a group of samples per prompt, longer answers)::

    python benchmarks/generate.py --batch 32 --group 8 --new-tokens 128 --temperature 1.0

The model is the tiny Qwen3 of ``configs/tiny_sft.yaml`` (4 layers, width 128, vocab 1600) with random weights
(seed ``--seed``), saved with ``save_pretrained`` and loaded by both sides in fp32: transformers
(``AutoModelForCausalLM``, ``--attn`` attention) and xtl (``get_model_config_from_hf(dir).build()`` +
``from_hf``, the same attention, separate projections as the recipe; ``--fused``: xtl-only fused q/k/v and
gate/up projections, labelled). The prompts are the first
``--batch / --group`` questions of the embedded tiny eval set rendered with the qwen3 chat template, each repeated
``--group`` times (transformers gets them left-padded). No stop token: both sides decode exactly ``--new-tokens``
tokens per prompt, greedily (``--temperature 0``) or sampled with the same temperature / top-k / top-p on both
sides. Both decoding configurations are spelled out in full (transformers gets an explicit ``GenerationConfig``,
none of its defaults). Setup asserts that greedy decoding gives the same tokens on both sides (sampled tokens
come from different random streams and are not compared); the same check runs in
``tests/benchmarks/test_generate.py``.

Protocol (``benchmarks/_paired.py``): threads pinned, ``--warmup`` untimed pairs, then ``--pairs`` pairs with the
order alternating; each run is one ``generate`` call on the whole batch (prefill included), timed on the wall
clock (``--clock cpu``: the process's CPU time, which a shared machine's other work disturbs less). Prints both
configurations, tokens/s per side and the speed ratio xtl / transformers per pair (median, min..max).
transformers runs under ``torch.inference_mode`` by default (``--peer-grad-mode no_grad``: under its own
``no_grad`` only); xtl's ``generate`` uses ``inference_mode`` by itself.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from _paired import add_protocol_args, load_average, pin_threads, print_configs, run_pairs

RECIPE = Path(__file__).resolve().parents[1] / "configs" / "tiny_sft.yaml"


@dataclass
class Sampling:
    """Decoding settings shared by both sides (``temperature`` 0: greedy)."""

    new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0


@dataclass
class Sides:
    """The two models on the same weights and the same prompts.

    Attributes:
        prompts: Token ids of each prompt.
        hf: The transformers model.
        xtl: The xtl model.
        input_ids: The prompts left-padded with 0 (transformers' input).
        attention_mask: 1 on prompt tokens, 0 on padding.
        spec: The recipe's model section.
    """

    prompts: list[list[int]]
    hf: Any
    xtl: Any
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    spec: dict[str, Any]


def build_sides(batch: int, group: int = 1, attn: str = "sdpa", seed: int = 0, fused: bool = False) -> Sides:
    """Both models from the same random weights of the recipe's model, and ``batch`` prompts (``batch / group``
    questions of the tiny eval set, each ``group`` times); ``fused``: xtl's q/k/v and gate/up projections are one
    matmul each (``fused_projections``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from xtl.model import get_model_config_from_hf
    from xtl.train.generation import chat_prompt_ids
    from xtl.train.model_spec import resolve_model_config
    from xtl.utils import resolve_path

    if batch < 1 or group < 1 or batch % group:
        raise ValueError(f"--batch ({batch}) must be a positive multiple of --group ({group})")
    tokenizer = AutoTokenizer.from_pretrained(resolve_path("tiny:"))
    rows = Path(resolve_path("tiny:sft_eval.jsonl")).read_text().splitlines()[: batch // group]
    questions = [chat_prompt_ids(tokenizer, json.loads(row)["messages"][:1], "qwen3") for row in rows]
    prompts = [list(q) for q in questions for _ in range(group)]
    spec = yaml.safe_load(RECIPE.read_text())["model"]["init_args"]["model"]
    hf_config = resolve_model_config(spec)[0].hf_config
    hf_config.bos_token_id = hf_config.eos_token_id = None  # no stop token: every run decodes --new-tokens
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(hf_config).save_pretrained(tmp)
        hf = AutoModelForCausalLM.from_pretrained(tmp, attn_implementation=attn, dtype=torch.float32).eval()
        xtl_config = get_model_config_from_hf(tmp)
        xtl_config.attn_impl = attn
        xtl_config.fused_projections = fused
        model = xtl_config.build()
        model.from_hf(tmp)
        model.eval()
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return Sides(prompts, hf, model, input_ids, attention_mask, spec)


def hf_generation_kwargs(sampling: Sampling) -> dict[str, Any]:
    """transformers' decoding settings, every one that changes the tokens or the speed set explicitly."""
    sample = sampling.temperature > 0
    return dict(
        max_new_tokens=sampling.new_tokens,
        min_new_tokens=0,
        do_sample=sample,
        temperature=sampling.temperature if sample else 1.0,
        top_k=sampling.top_k if sample else None,
        top_p=sampling.top_p if sample else 1.0,
        num_beams=1,
        use_cache=True,
        cache_implementation=None,  # DynamicCache
        pad_token_id=0,
        eos_token_id=None,
        bos_token_id=None,
    )


def hf_generation_config(sampling: Sampling) -> Any:
    """:func:`hf_generation_kwargs` as a transformers ``GenerationConfig``."""
    from transformers import GenerationConfig

    return GenerationConfig(**hf_generation_kwargs(sampling))


def xtl_generation_config(sampling: Sampling, prefill: str = "packed") -> Any:
    """xtl's decoding settings (the same sampling as :func:`hf_generation_config`)."""
    from xtl.train.generation import GenerationConfig

    return GenerationConfig(
        max_new_tokens=sampling.new_tokens,
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        seed=sampling.seed,
        prefill=prefill,
    )


def run_hf(sides: Sides, sampling: Sampling, grad_mode: str = "inference_mode") -> list[list[int]]:
    """transformers' ``generate`` on the left-padded batch; the new tokens of each prompt."""
    config = hf_generation_config(sampling)
    torch.manual_seed(sampling.seed)
    with torch.inference_mode() if grad_mode == "inference_mode" else contextlib.nullcontext():
        out = sides.hf.generate(
            input_ids=sides.input_ids, attention_mask=sides.attention_mask, generation_config=config
        )
    return out[:, sides.input_ids.shape[1] :].tolist()


def run_xtl(sides: Sides, sampling: Sampling, prefill: str = "packed") -> list[list[int]]:
    """xtl's ``generate`` on the prompts; the new tokens of each prompt."""
    from xtl.train.generation import generate

    return generate(sides.xtl, sides.prompts, xtl_generation_config(sampling, prefill)).sequences


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def _timed(fn: Callable[[], list[list[int]]], tokens: int, clock: str) -> Callable[[], float]:
    now = CLOCKS[clock]

    def run() -> float:
        start = now()
        fn()
        return tokens / (now() - start)

    return run


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_protocol_args(parser)
    parser.add_argument("--batch", type=int, default=8, help="sequences decoded together")
    parser.add_argument("--group", type=int, default=1, help="samples per prompt (GRPO's group size)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per sequence")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above 0: sampled, both sides")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (1: off)")
    parser.add_argument("--top-k", type=int, default=0, help="top-k sampling (0: off)")
    parser.add_argument("--prefill", choices=("packed", "padded"), default="packed", help="xtl's prefill")
    parser.add_argument("--attn", choices=("sdpa", "eager"), default="sdpa", help="attention of both sides")
    parser.add_argument(
        "--peer-grad-mode",
        choices=("inference_mode", "no_grad"),
        default="inference_mode",
        help="transformers' generate inside torch.inference_mode, or under its own no_grad only",
    )
    parser.add_argument(
        "--fused", action="store_true", help="xtl-only: fused q/k/v and gate/up projections (fused_projections)"
    )
    parser.add_argument(
        "--clock",
        choices=tuple(CLOCKS),
        default="wall",
        help="time each run on the wall clock, or as the process's CPU time (steadier on a shared machine)",
    )
    parser.add_argument("--seed", type=int, default=0, help="weights and sampling seed")
    args = parser.parse_args(argv)
    pin_threads(args.threads)

    sampling = Sampling(args.new_tokens, args.temperature, args.top_p, args.top_k, args.seed)
    sides = build_sides(args.batch, args.group, args.attn, args.seed, args.fused)
    xtl_config = xtl_generation_config(sampling, args.prefill)
    greedy = Sampling(args.new_tokens, seed=args.seed)
    same = run_xtl(sides, greedy, args.prefill) == run_hf(sides, greedy, args.peer_grad_mode)
    if not same:
        raise SystemExit("setup check failed: greedy decoding gives different tokens on the two sides")

    tokens = args.batch * args.new_tokens
    lengths = sorted(len(p) for p in sides.prompts)
    mode = "greedy" if args.temperature == 0 else "sampled"
    print(f"model: {RECIPE.name} {json.dumps(sides.spec)}, fp32, random weights (seed {args.seed})")
    print(
        f"workload: {args.batch} sequences ({args.batch // args.group} prompts x {args.group}, {lengths[0]}.."
        f"{lengths[-1]} tokens) x {args.new_tokens} new tokens, {mode}, no stop token; threads={args.threads}; "
        f"{args.pairs} pairs after {args.warmup} warm-up, order alternating; {args.clock} clock; "
        f"load {load_average()}"
    )
    print_configs(
        transformers={
            "model": f"AutoModelForCausalLM(attn_implementation={args.attn}, dtype=float32)",
            "generate": hf_generation_kwargs(sampling),
            "input": "left-padded batch + attention_mask",
            "grad_mode": args.peer_grad_mode,
        },
        xtl={
            "model": f"get_model_config_from_hf(dir).build() + from_hf, attn_impl={args.attn}, "
            + ("fused q/k/v and gate/up projections (xtl-only)" if args.fused else "separate projections"),
            "generate": {
                k: getattr(xtl_config, k) for k in ("max_new_tokens", "temperature", "top_k", "top_p", "prefill")
            },
            "cache": "KVCache preallocated (prompt + new tokens)",
            "grad_mode": "inference_mode (generate's own)",
        },
    )
    print("setup check: same greedy tokens on both sides: True")
    result = run_pairs(
        _timed(lambda: run_xtl(sides, sampling, args.prefill), tokens, args.clock),
        _timed(lambda: run_hf(sides, sampling, args.peer_grad_mode), tokens, args.clock),
        args.pairs,
        args.warmup,
        metric="tokens/s",
        higher_is_better=True,
    )
    print(result.summary("xtl", "transformers"))
    print(f"load after: {load_average()}")


if __name__ == "__main__":
    main()
