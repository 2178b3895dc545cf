"""``xtl check-parity``: prove on a given model that xtl computes what transformers computes, without training.

The xtl model is loaded from an HF directory with ``from_hf`` (xtl's key map and layout hooks) and the reference
with transformers' own ``from_pretrained`` (eager attention, eager experts) from the same directory; with
``--random`` (an alias, or a directory's config) the xtl model is initialized from a seed and the reference is
filled with its weights through the HF key map. Both run on generated token ids or on the documents of a text file
(``--text``), and the comparison of :mod:`xtl.model.parity` (hidden states after every decoder layer, logits,
loss, gradients) is printed as a per-layer table or JSON.

A vision-language directory (Qwen3-VL, Qwen3-VL-MoE) is checked against transformers' image-text-to-text class:
the engine adds a probe document with one random image to the text documents, so the report starts with the vision
tower's rows; ``--max-layers`` cuts the language model (``text_config``), never the vision tower.

Example:
    >>> from xtl.tools.check_parity import main
    >>> main(["qwen3-0.6b", "--random", "--max-layers", "1", "--max-tokens", "16"])  # doctest: +SKIP
    0
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path
from typing import Any

from xtl.tools._cli import EXIT_CODES_HELP, EXIT_FAILED, EXIT_OK, ToolInputError, make_parser, run_cli

EXAMPLES = f"""examples:
  xtl check-parity path/to/hf_model
  xtl check-parity path/to/hf_model --dtype bfloat16 --mode fast --text prompts.txt --format json
  xtl check-parity qwen3-8b --random --max-layers 2 --max-tokens 128

{EXIT_CODES_HELP} (1: a row exceeded its tolerance; the first diverging layer is named)"""

_DTYPES = ("float32", "bfloat16")
# The engine's modes and tolerance presets, spelled out so that --help does not import torch (a test keeps them equal).
MODES = ("hf_impl", "fast")
CUT_VOCAB = 4096  # vocabulary of a random model cut with --max-layers
TOLERANCE_CHOICES = ("auto", "bitwise", "bitwise_forward", "fp32", "bf16", "fp8")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``check-parity`` options to ``parser``.

    Args:
        parser (argparse.ArgumentParser): Parser.
    """
    parser.add_argument("model", help="HF model directory, or a registered alias with --random")
    parser.add_argument("--random", action="store_true", help="random weights (seeded) instead of the directory's")
    parser.add_argument("--seed", type=int, default=0, help="seed of random weights and generated tokens")
    parser.add_argument(
        "--text", type=Path, metavar="FILE", help="documents (blank-line separated) tokenized with --tokenizer"
    )
    parser.add_argument("--tokenizer", metavar="DIR", help="tokenizer for --text (default: the model directory)")
    parser.add_argument("--max-tokens", type=_positive, default=512, help="tokens of the input (default 512)")
    parser.add_argument("--num-docs", type=_positive, default=2, help="documents of generated input (default 2)")
    parser.add_argument("--max-layers", type=_positive, help="compare only the first K decoder layers")
    parser.add_argument("--dtype", choices=_DTYPES, default="float32")
    parser.add_argument("--mode", choices=MODES, default="hf_impl", help="hf_impl: bitwise; fast: run's ops")
    parser.add_argument("--tolerance", choices=TOLERANCE_CHOICES, default="auto")
    parser.add_argument(
        "--grad-params",
        action="append",
        metavar="GLOB",
        help="xtl parameter names whose gradients are compared (repeatable; default first/last layer, norm, head)",
    )
    parser.add_argument("--no-grads", action="store_true", help="compare the forward only")
    parser.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--format", choices=("text", "json"), default="text")


def run(args: argparse.Namespace) -> int:
    """Run ``check-parity`` from parsed arguments.

    Args:
        args (argparse.Namespace): Parsed ``add_arguments`` options.

    Returns:
        int: Exit code.
    """
    import torch

    from xtl.model.parity import load_reference, run_parity_check

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype)
    directory = Path(args.model) if (Path(args.model) / "config.json").is_file() else None
    if directory is None and not args.random:
        raise ToolInputError(f"{args.model}: not an HF model directory (no config.json); an alias needs --random")
    config, total_layers = _xtl_config(args.model, directory, args.max_layers, args.random)
    hf_config = _reference_config(directory, config, args.random)
    documents = _documents(args, directory, config)  # input errors before the weights are loaded
    model = _xtl_model(config, directory, args.random, args.seed, dtype, device)
    try:
        reference = None
        if directory is not None and not args.random:
            reference, errors = load_reference(directory, hf_config, dtype, device)
            if reference is None:
                raise ToolInputError(f"transformers cannot load {directory}: {'; '.join(errors)}")
        report = run_parity_check(
            model,
            documents,
            hf_config=hf_config,
            reference=reference,
            mode=args.mode,
            tolerance=args.tolerance,
            grad_params=[] if args.no_grads else args.grad_params,
            dtype=dtype,
        )
    except ValueError as err:  # a --grad-params pattern that matches nothing, a model with no causal-LM reference
        raise ToolInputError(str(err)) from err
    text = config.language_config
    if text.num_hidden_layers < total_layers:
        report.notes.append(
            f"the model is cut to its first {text.num_hidden_layers} of {total_layers} decoder layers (both sides)"
            + (f", its vocabulary to {text.vocab_size} tokens (random weights)" if args.random else "")
        )
    print(report.to_json() if args.format == "json" else report.render())
    return EXIT_OK if report.ok else EXIT_FAILED


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point of ``xtl check-parity``.

    Args:
        argv (list[str] | None): Arguments (without the program name).

    Returns:
        int: Exit code (0 parity holds, 1 a row exceeded its tolerance, 2 usage or input error).
    """
    parser = make_parser("xtl check-parity", "Compare an xtl model with transformers' eager implementation.", EXAMPLES)
    add_arguments(parser)
    return run_cli(parser, argv, run)


# ---- private ---------------------------------------------------------------------------------------------------


def _xtl_config(name: str, directory: Path | None, max_layers: int | None, random: bool = False) -> tuple[Any, int]:
    """The xtl config of the directory or alias, cut to the first ``max_layers`` decoder layers, and the
    model's own number of decoder layers.

    A cut model compares the layers only (no logits, loss or gradients); with random weights its vocabulary is cut
    too (to :data:`CUT_VOCAB` tokens), so embedding and head, the largest tensors of a big model, stay small. Of a
    vision-language model the language model (``text_config``) is cut; its vision tower stays whole, and image
    placeholder ids beyond a cut vocabulary move to its last ids.
    """
    from xtl.model import get_model_config, get_model_config_from_hf

    try:
        config = get_model_config_from_hf(directory) if directory is not None else get_model_config(name)
    except KeyError as err:  # unknown alias: the message lists the known ones
        raise ToolInputError(str(err.args[0])) from err
    except ValueError as err:  # unsupported model_type
        raise ToolInputError(str(err)) from err
    if config.hf_config is None:
        raise ToolInputError(f"{type(config).__name__} has no transformers config (remote code): no reference")
    text = config.language_config  # the config itself, or a vision-language config's text_config
    total = text.num_hidden_layers
    if max_layers is not None and max_layers < total:
        changes: dict[str, Any] = {"num_hidden_layers": max_layers}
        for name in text.per_layer_fields:  # one entry per decoder layer: cut too
            if (values := getattr(text, name)) is not None:
                changes[name] = list(values[:max_layers])
        vision: dict[str, int] = {}
        if random:
            changes["vocab_size"] = vocab = min(text.vocab_size, CUT_VOCAB)
            ids = {"bos_token_id": text.bos_token_id, "eos_token_id": text.eos_token_id}
            for key, value in {**ids, "pad_token_id": text.pad_token_id}.items():  # ids the cut vocabulary lacks
                if isinstance(value, int) and value >= vocab:
                    changes[key] = None
            placeholders = config.placeholder_token_ids
            if any(value >= vocab for value in placeholders.values()):
                vision = {key: vocab - len(placeholders) + i for i, key in enumerate(placeholders)}
        if text is config:
            config = dataclasses.replace(config, **changes)
        else:
            config = dataclasses.replace(config, text_config=dataclasses.replace(text, **changes), **vision)
    return config, total


def _reference_config(directory: Path | None, config: Any, random: bool) -> Any:
    """transformers' own reading of the directory's config.json (else the xtl config's), with xtl's layer count
    (and, with random weights, xtl's cut vocabulary and the special ids it moved or dropped)."""
    from transformers import AutoConfig

    from xtl.model.parity import truncated_hf_config

    text = config.language_config
    hf_config = AutoConfig.from_pretrained(directory) if directory is not None else config.hf_config
    hf_config = truncated_hf_config(hf_config, text.num_hidden_layers)
    hf_text = hf_config.get_text_config(decoder=True)
    if random and text.vocab_size < hf_text.vocab_size:
        hf_text.vocab_size = text.vocab_size
        hf_text.bos_token_id, hf_text.eos_token_id, hf_text.pad_token_id = (
            text.bos_token_id,
            text.eos_token_id,
            text.pad_token_id,
        )
        for key, value in config.placeholder_token_ids.items():
            setattr(hf_config, key, value)
    return hf_config


def _xtl_model(config: Any, directory: Path | None, random: bool, seed: int, dtype: Any, device: Any) -> Any:
    import torch

    from xtl.model.hf.errors import CheckpointMismatchError

    with torch.device("meta"):
        model = config.build()
    if directory is not None and not random:
        whole = config.language_config.num_hidden_layers == _checkpoint_layers(directory)
        missing = model.from_hf(directory, strict=whole, device=device)  # a cut model ignores the deeper layers
        if missing:
            raise CheckpointMismatchError(f"{directory}: missing keys {', '.join(missing[:8])}")
    else:
        model.materialize(device)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model.init_weights()
    return model.to(dtype)


def _checkpoint_layers(directory: Path) -> int:
    from xtl.model.config import read_hf_config_dict

    values = read_hf_config_dict(directory)
    return int(values.get("text_config", values).get("num_hidden_layers", 0))


def _documents(args: argparse.Namespace, directory: Path | None, config: Any) -> Any:
    """The text documents (the engine adds a probe image for a vision-language model: the tool reads no images)."""
    from xtl.model.parity import ParityDocuments

    vocab_size = config.vocab_size
    placeholders = set(config.placeholder_token_ids.values())
    if args.text is None:
        if args.max_tokens < args.num_docs:
            raise ToolInputError(f"--max-tokens {args.max_tokens} is fewer than --num-docs {args.num_docs}")
        words = [t for t in range(vocab_size) if t not in placeholders]  # no image placeholder without its image
        documents = ParityDocuments.random(len(words), args.max_tokens, args.num_docs, args.seed)
        return ParityDocuments.from_token_lists([[words[t] for t in doc.tolist()] for doc in documents.input_ids])
    if not args.text.is_file():
        raise ToolInputError(f"--text {args.text}: no such file")
    source = args.tokenizer or directory
    if source is None:
        raise ToolInputError("--text needs a tokenizer: pass --tokenizer DIR")
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(source))
    except (OSError, ValueError) as err:
        raise ToolInputError(f"no tokenizer in {source}: {str(err).splitlines()[0]}") from err
    texts = [t.strip() for t in re.split(r"\n\s*\n", args.text.read_text()) if t.strip()]
    if not texts:
        raise ToolInputError(f"--text {args.text} holds no text")
    documents = ParityDocuments.from_token_lists([tokenizer(t)["input_ids"] for t in texts], args.max_tokens)
    if documents.max_token_id() >= vocab_size:
        raise ToolInputError(f"the tokenizer of {source} yields ids >= the model's vocab_size {vocab_size}")
    ids = config.placeholder_token_ids
    images = {ids[key] for key in ("image_token_id", "video_token_id") if key in ids}
    if any(t in images for doc in documents.input_ids for t in doc.tolist()):
        raise ToolInputError(
            f"--text {args.text} holds image or video placeholders (ids {sorted(images)}): check-parity reads no "
            "images; remove them (a probe image is added)"
        )
    return documents


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


if __name__ == "__main__":
    raise SystemExit(main())
