"""``xtl eval``: lm-evaluation-harness on an HF model directory or a checkpoint of an xtl run, with xtl's model.

The model loads as in ``xtl generate`` (an HF directory with its tokenizer, or a Lightning checkpoint file with
``--tokenizer``, default the embedded tiny one) and answers lm-eval's requests with packed log-likelihoods and
cached greedy generation (:class:`xtl.callbacks.lm_eval_model.XTLLM`); the options are those of the ``LMEval``
callback. lm-eval's table is printed, and its results written as JSON with ``--output``; ``--log-samples`` also
writes lm-eval's per-sample logs next to it, as ``lm_eval --log_samples --output_path`` does. The metrics equal
``lm_eval --model hf`` on the same weights and dtype.

Example:
    xtl eval --model runs/tiny_sft/hf/final --tasks tiny_choice,tiny_exact --apply-chat-template
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from xtl.tools._cli import EXIT_CODES_HELP, EXIT_OK, ToolInputError, make_parser, run_cli

EXAMPLES = f"""examples:
  xtl eval --model runs/tiny_sft/hf/final --tasks tiny_choice,tiny_exact --apply-chat-template
  xtl eval --model runs/tiny_sft/checkpoints/last.ckpt --tasks tiny_choice --apply-chat-template --template qwen3
  xtl eval --model /models/Qwen3-0.6B --tasks hellaswag,gsm8k --limit 100 --batch-size 32 --output results.json
  xtl eval --model /models/Qwen3-0.6B --tasks my_tasks/qa.yaml --num-fewshot 3
  xtl eval --model runs/tiny_sft/hf/final --tasks tiny_choice --apply-chat-template --output out/results.json \
    --log-samples

{EXIT_CODES_HELP}"""

DTYPES = ("auto", "float32", "bfloat16", "float16")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``xtl eval``.

    Args:
        argv: Arguments without the program name.

    Returns:
        0 on success, 2 on a usage or input error (bad path, unknown task, bad option).
    """
    parser = make_parser("xtl eval", __doc__.split("\n\n")[0], EXAMPLES)
    parser.add_argument("--model", required=True, help="HF model directory, or a Lightning .ckpt file of an xtl run")
    parser.add_argument(
        "--tasks",
        required=True,
        help="comma-separated lm-eval tasks or groups, task YAML files, or shipped tasks (tiny_choice, tiny_exact)",
    )
    parser.add_argument(
        "--tokenizer", default=None, help="tokenizer folder (default: the model directory; 'tiny:' for a checkpoint)"
    )
    parser.add_argument(
        "--template",
        default=None,
        help="built-in chat template for --apply-chat-template (qwen3, chatml, qwen2.5, llama3); default: the "
        "tokenizer's",
    )
    parser.add_argument("--limit", type=float, default=None, help="documents per task (or a fraction < 1)")
    parser.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples (default: the task's)")
    parser.add_argument("--batch-size", type=int, default=16, help="requests per packed forward / decoding batch")
    parser.add_argument("--max-gen-toks", type=int, default=256, help="decoding budget of tasks that set none")
    parser.add_argument("--apply-chat-template", action="store_true", help="render prompts with the chat template")
    parser.add_argument("--fewshot-as-multiturn", action="store_true", help="few-shot examples as chat turns")
    parser.add_argument("--include-path", action="append", default=[], help="a folder of task YAML (repeatable)")
    parser.add_argument("--seed", type=int, default=1234, help="seed of the few-shot sampling")
    parser.add_argument("--max-length", type=int, default=None, help="context length (default: the model's)")
    parser.add_argument(
        "--dtype", default="auto", choices=DTYPES, help="weights and compute (auto: the HF config's; float32 else)"
    )
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--output", default=None, help="write lm-eval's results to this JSON file")
    parser.add_argument(
        "--log-samples",
        action="store_true",
        help="also write lm-eval's per-sample logs, samples_<task>_<date>.jsonl next to --output (needs --output)",
    )
    return run_cli(parser, argv, _run)


# ---- private ---------------------------------------------------------------------------------------------------


def _run(args: argparse.Namespace) -> int:
    import torch

    from xtl.callbacks.lm_eval_run import (
        EvalSettings,
        load_tasks,
        require_lm_eval,
        resolve_tasks,
        run_lm_eval,
        write_samples,
    )
    from xtl.errors import ConfigError
    from xtl.tools.generate import load_model_and_tokenizer
    from xtl.utils import atomic_write_bytes

    if args.log_samples and not args.output:
        raise ToolInputError("--log-samples writes the per-sample logs next to the results JSON; pass --output FILE")
    limit = None if args.limit is None else (int(args.limit) if args.limit >= 1 else args.limit)
    try:
        require_lm_eval()
        settings = EvalSettings(
            tasks=[t.strip() for t in args.tasks.split(",") if t.strip()],
            limit=limit,
            num_fewshot=args.num_fewshot,
            batch_size=args.batch_size,
            max_gen_toks=args.max_gen_toks,
            apply_chat_template=args.apply_chat_template,
            fewshot_as_multiturn=args.fewshot_as_multiturn,
            include_path=args.include_path,
            seed=args.seed,
        )
        tasks, manager = resolve_tasks(settings)
        tasks = load_tasks(tasks, manager)  # loads every task's dataset, before the model
    except ConfigError as err:
        raise ToolInputError(re.sub(r"^(\w+)", lambda m: "--" + m.group(1).replace("_", "-"), str(err))) from None
    model, tokenizer, hf_dir = load_model_and_tokenizer(args.model, args.tokenizer, args.template, args.device)
    dtype = _dtype(args.dtype, hf_dir)
    if dtype != torch.float32:
        model = model.to(dtype)
    from xtl.callbacks.lm_eval_model import XTLLM

    lm = XTLLM(model, tokenizer, args.batch_size, args.max_length, args.max_gen_toks, template=args.template)
    results = run_lm_eval(lm, settings, tasks, manager, log_samples=args.log_samples)
    from lm_eval.utils import make_table

    samples = results.pop("samples", None) if args.log_samples else None
    print(make_table(results))
    if results.get("groups"):
        print(make_table(results, "groups"))
    if samples is not None:
        for path in write_samples(results, samples, Path(args.output)):
            print(f"samples: {path}")
    if args.output:
        atomic_write_bytes(Path(args.output), json.dumps(results, indent=2, default=str).encode())
    return EXIT_OK


def _dtype(name: str, hf_dir: Path | None):  # noqa: ANN202 - torch is imported lazily
    """The torch dtype of ``--dtype`` (``auto``: the HF config's ``dtype`` / ``torch_dtype``, else float32)."""
    import torch

    if name == "auto":
        config = json.loads((hf_dir / "config.json").read_text()) if hf_dir else {}
        name = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ToolInputError(f"the model's config names an unknown dtype {name!r}; pass --dtype float32")
    return dtype
