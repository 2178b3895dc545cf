"""``xtl generate``: answer one chat prompt with an HF model directory or a checkpoint of an xtl run.

The model is an HF directory (config and safetensors; its tokenizer unless ``--tokenizer``) or a Lightning
checkpoint file of an xtl run (the model config comes from the checkpoint's hyperparameters, the tokenizer from
``--tokenizer``, default the embedded tiny one). The prompt is rendered with the tokenizer's chat template (or a
built-in one with ``--template``) and a generation prompt, decoded with the KV cache of
:mod:`xtl.train.generation` (greedy unless ``--temperature`` > 0) until a stop token or ``--max-new-tokens``, and
the answer is printed (a leading thinking block only with ``--show-thinking``).

Example:
    xtl generate --model runs/tiny_sft/checkpoints/last.ckpt --prompt "What is 2+3?"
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from xtl.tools._cli import EXIT_CODES_HELP, EXIT_OK, ToolInputError, make_parser, run_cli

if TYPE_CHECKING:
    from xtl.model import BaseModel

EXAMPLES = f"""examples:
  xtl generate --model runs/tiny_sft/checkpoints/last.ckpt --prompt "What is 2+3?"
  xtl generate --model runs/tiny_sft/hf/final --tokenizer tiny: --prompt "Uppercase: stone bridge"
  xtl generate --model /models/Qwen3-0.6B --prompt "Write a haiku" --temperature 0.7 --top-p 0.9 --seed 1

{EXIT_CODES_HELP}"""


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``xtl generate``.

    Args:
        argv: Arguments without the program name.

    Returns:
        0 on success, 2 on a usage or input error (bad path, bad option).
    """
    parser = make_parser("xtl generate", __doc__.split("\n\n")[0], EXAMPLES)
    parser.add_argument("--model", required=True, help="HF model directory, or a Lightning .ckpt file of an xtl run")
    parser.add_argument("--prompt", required=True, help="the user message")
    parser.add_argument("--system", default=None, help="a system message before the prompt")
    parser.add_argument(
        "--tokenizer", default=None, help="tokenizer folder (default: the model directory; 'tiny:' for a checkpoint)"
    )
    parser.add_argument(
        "--template",
        default=None,
        help="built-in chat template (qwen3, chatml, qwen2.5, llama3); default: the tokenizer's",
    )
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sample")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: off)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (1: off)")
    parser.add_argument("--seed", type=int, default=0, help="seed of sampling")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--show-thinking", action="store_true", help="print the thinking block too")
    return run_cli(parser, argv, _run)


def load_model(path: Path, device: str = "cpu") -> tuple[BaseModel, Path | None]:
    """Load an xtl model from an HF directory or an xtl run's Lightning checkpoint file.

    Args:
        path: The directory or the ``.ckpt`` file.
        device: Where to put the weights.

    Returns:
        The model (eval mode) and the HF directory it came from (``None`` for a checkpoint file).

    Raises:
        ToolInputError: For a path that is neither.
    """
    import torch

    from xtl.model import get_model_config_from_hf

    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ToolInputError(
                f"{path} is neither an HF model directory (no config.json) nor a checkpoint file (for an FSDP run's "
                "checkpoint directory, use its HF export)"
            )
        with torch.device("meta"):
            model = _config(get_model_config_from_hf, path).build()
        model.from_hf(path, device=device)
        return model.eval(), path
    if not path.is_file():
        raise ToolInputError(f"{path} does not exist")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)  # a local file of one's own run
    except Exception as err:  # noqa: BLE001 - any unreadable file is an input error here
        raise ToolInputError(f"{path} is not a readable checkpoint file ({type(err).__name__})") from None
    hparams = checkpoint.get("hyper_parameters", {}) if isinstance(checkpoint, dict) else {}
    if "model" not in hparams or "state_dict" not in checkpoint:
        raise ToolInputError(f"{path} is not a Lightning checkpoint of an xtl run (no model hyperparameters)")
    from xtl.train.model_spec import resolve_model_config

    config, _ = _config(resolve_model_config, hparams["model"], hparams.get("model_overrides"))
    with torch.device("meta"):
        model = config.build()
    model.materialize(device)
    state = {k.removeprefix("model."): v for k, v in checkpoint["state_dict"].items() if k.startswith("model.")}
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise ToolInputError(f"{path}: the weights do not fit the model config ({str(err).splitlines()[0]})") from None
    return model.eval(), None


def load_model_and_tokenizer(
    model: str, tokenizer: str | None, template: str | None, device: str = "cpu"
) -> tuple[BaseModel, Any, Path | None]:
    """The options ``--model``, ``--tokenizer`` and ``--template`` of a decoding tool, checked and loaded.

    Args:
        model: HF directory or Lightning checkpoint file (:func:`load_model`).
        tokenizer: Tokenizer folder (``None``: the HF directory, or ``tiny:`` for a checkpoint).
        template: A built-in chat template name, or ``None``.
        device: Where to put the weights.

    Returns:
        The model (eval mode), its transformers tokenizer, and the HF directory (``None`` for a checkpoint file).

    Raises:
        ToolInputError: An unknown template, a bad model path, or a folder without a tokenizer.
    """
    from transformers import AutoTokenizer

    from xtl.data.templates import TEMPLATES
    from xtl.utils import resolve_path

    if template is not None and template not in TEMPLATES:
        raise ToolInputError(f"--template {template!r} is not a built-in template; use one of {sorted(TEMPLATES)}")
    loaded, hf_dir = load_model(Path(resolve_path(model)), device)
    tokenizer_path = Path(resolve_path(tokenizer or (str(hf_dir) if hf_dir else "tiny:")))
    if not (tokenizer_path / "tokenizer_config.json").is_file() and not (tokenizer_path / "tokenizer.json").is_file():
        raise ToolInputError(f"no tokenizer in {tokenizer_path}; pass --tokenizer DIR")
    return loaded, AutoTokenizer.from_pretrained(tokenizer_path), hf_dir


# ---- private ---------------------------------------------------------------------------------------------------


def _run(args: argparse.Namespace) -> int:

    from xtl.train.generation import GenerationConfig, chat_prompt_ids, generate, split_thinking

    try:
        config = GenerationConfig(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
        )
    except ValueError as err:
        raise ToolInputError(str(err)) from None
    model, tokenizer, _ = load_model_and_tokenizer(args.model, args.tokenizer, args.template, args.device)
    if args.template is None and not tokenizer.chat_template:
        raise ToolInputError(
            f"the tokenizer in {tokenizer.name_or_path} has no chat template; pass --template qwen3 (or another)"
        )
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.prompt}
    ]
    prompt = chat_prompt_ids(tokenizer, messages, args.template)
    config = config.with_tokenizer(tokenizer, args.template)
    out = generate(model, [prompt], config).sequences[0]
    text = tokenizer.decode([t for t in out if t not in config.stop_token_ids], skip_special_tokens=False)
    reasoning, answer = split_thinking(text)
    if args.show_thinking and reasoning:
        print(f"<think>\n{reasoning}\n</think>\n")
    print(answer)
    return EXIT_OK


def _config(load: Any, *args: Any) -> Any:
    """Call a config loader, turning its ValueError (unknown model type or field) into an input error."""
    try:
        return load(*args)
    except ValueError as err:
        raise ToolInputError(str(err)) from None
