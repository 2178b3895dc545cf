"""Generation benchmark: xtl's KV-cached greedy decoding vs transformers' ``generate`` on the same tiny model.

    python benchmarks/generate.py [--threads 1] [--batch 8] [--new-tokens 64] [--repeats 5] [--prefill packed]

The model is the tiny Qwen3 of ``configs/tiny_sft.yaml`` (4 layers, width 128, vocab 1600) with random weights,
saved with ``save_pretrained`` and loaded by both sides: transformers (``AutoModelForCausalLM``, ``--attn``
attention) and xtl (``get_model_config_from_hf(dir).build()`` + ``from_hf``). The prompts are the first
``--batch`` questions of the embedded tiny eval set rendered with the qwen3 chat template (transformers gets them
left-padded). No stop token: both sides decode exactly ``--new-tokens`` tokens per prompt, greedily, with
``use_cache=True`` on the transformers side. Threads are pinned (``--threads``); after one warm-up run per side,
``--repeats`` paired runs alternate which side goes first. Prints both configurations, tokens/s per side (median)
and the ratio xtl / transformers per pair: median with min..max.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import yaml

RECIPE = Path(__file__).resolve().parents[1] / "configs" / "tiny_sft.yaml"


def main() -> None:
    """Run the benchmark and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (pinned)")
    parser.add_argument("--batch", type=int, default=8, help="prompts decoded together")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per prompt")
    parser.add_argument("--repeats", type=int, default=5, help="paired timed runs after warm-up")
    parser.add_argument("--prefill", choices=("packed", "padded"), default="packed", help="xtl's prefill")
    parser.add_argument("--attn", choices=("sdpa", "eager"), default="sdpa", help="attention of both sides")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from xtl.model import get_model_config_from_hf
    from xtl.train.generation import GenerationConfig, chat_prompt_ids, generate
    from xtl.train.model_spec import resolve_model_config
    from xtl.utils import resolve_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_path("tiny:"))
    rows = Path(resolve_path("tiny:sft_eval.jsonl")).read_text().splitlines()[: args.batch]
    prompts = [chat_prompt_ids(tokenizer, json.loads(row)["messages"][:1], "qwen3") for row in rows]
    spec = yaml.safe_load(RECIPE.read_text())["model"]["init_args"]["model"]
    hf_config = resolve_model_config(spec)[0].hf_config
    hf_config.bos_token_id = hf_config.eos_token_id = None  # no stop token: every run decodes --new-tokens
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(args.seed)
        AutoModelForCausalLM.from_config(hf_config).save_pretrained(tmp)
        hf = AutoModelForCausalLM.from_pretrained(tmp, attn_implementation=args.attn).eval()
        xtl_config = get_model_config_from_hf(tmp)
        xtl_config.attn_impl = args.attn
        model = xtl_config.build()
        model.from_hf(tmp)
        model.eval()

    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    config = GenerationConfig(max_new_tokens=args.new_tokens, prefill=args.prefill)

    def run_hf() -> list[list[int]]:
        with torch.no_grad():
            out = hf.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=args.new_tokens,
                do_sample=False,
                use_cache=True,
                pad_token_id=0,
            )
        return out[:, width:].tolist()

    def run_xtl() -> list[list[int]]:
        return generate(model, prompts, config).sequences

    sides = {"transformers": run_hf, "xtl": run_xtl}
    outputs = {name: fn() for name, fn in sides.items()}  # warm-up
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    for rep in range(args.repeats):
        order = list(sides) if rep % 2 == 0 else list(reversed(sides))
        for name in order:
            start = time.perf_counter()
            sides[name]()
            seconds[name].append(time.perf_counter() - start)

    tokens = args.batch * args.new_tokens
    lengths = sorted(len(p) for p in prompts)
    print(f"model: {RECIPE.name} {json.dumps(spec)}, fp32, random weights")
    print(
        f"workload: {args.batch} prompts ({lengths[0]}..{lengths[-1]} tokens) x {args.new_tokens} new tokens, greedy, "
        f"no stop token; threads={args.threads}; {args.repeats} paired runs after 1 warm-up, sides alternated"
    )
    print(
        f"transformers: AutoModelForCausalLM attn_implementation={args.attn}, generate(do_sample=False, "
        f"use_cache=True), left padding, DynamicCache"
    )
    print(f"xtl: generate(prefill={args.prefill!r}), attn_impl={args.attn}, KVCache preallocated")
    for name in sides:
        print(f"{name:>12}: {tokens / statistics.median(seconds[name]):8.1f} tokens/s (median of {args.repeats})")
    ratios = [hf_s / xtl_s for hf_s, xtl_s in zip(seconds["transformers"], seconds["xtl"])]
    print(
        f"generation ratio xtl / transformers: {statistics.median(ratios):.2f}x "
        f"(min {min(ratios):.2f}x .. max {max(ratios):.2f}x)"
    )
    same = outputs["xtl"] == outputs["transformers"]
    print(f"same greedy tokens on both sides: {same}")


if __name__ == "__main__":
    main()
