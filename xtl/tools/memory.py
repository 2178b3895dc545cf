"""``xtl memory``: per-GPU memory estimate of a training setup, before running it.

The model comes from an HF ``config.json`` (or a directory holding one), an alias of the model registry
(``qwen3-8b``, ``qwen3-30b-a3b``, ``deepseek-v3``, ...) or an xtl config; parameter counts come from
:class:`xtl.model.dims.ModelDims`. Training keeps fp32 master parameters and Adam moments, sharded over the
data-parallel group (ZeRO-1: optimizer states only; ZeRO-3/FSDP: everything, gathering one layer at a time in bf16),
computes in bf16 and keeps fp32 sharded master gradients. Tensor parallelism shards every part (sequence parallel
for activations), pipeline parallelism (ZeRO-1 only, 1F1B) keeps several micro-batches in flight on the first stage,
expert parallelism shards routed experts.

Activation accounting (elements per token, stored in the activation dtype unless marked fp32) is what a fused
training implementation keeps for backward: fused RMSNorm keeps its input plus an fp32 ``rstd`` per row and its
output is kept by the consumer linear; RoPE keeps nothing but cos/sin; flash attention keeps q, k, v, its output
and the fp32 log-sum-exp per head; fused SwiGLU keeps gate and up and the down projection keeps its input. The
memory settings of the run decide what each decoder layer keeps: all of that (no recompute), its input (full
recompute), its matmul outputs (selective recompute), or nothing on the GPU (activation offload: host memory).
The derivation of every term is in ``docs/tools.md`` and ``xtl memory --measure`` checks it against autograd and
against the ``ActivationCheckpointing`` / ``ActivationOffload`` callbacks.

LoRA (``--lora-rank R``, or a recipe's ``LoRA`` callback): the base weights are frozen -- stored in
``frozen_bytes`` (sharded under ZeRO-3, one layer gathered in bf16), with no gradients, master copies or Adam
states -- and the adapters, ``r * (in + out)`` parameters per adapted linear layer, train like any parameter; each
adapted layer keeps ``r`` more activation elements per token (``r + out`` under selective recompute). QLoRA
(``--qlora``) stores the adapted layers' base weights in NF4 (about 4.13 bits each) and adds the working set of
dequantizing the largest one; under FSDP (ZeRO-3, as ``xtl fit`` trains QLoRA on several GPUs) each GPU stores its
shard of the NF4 weights (and of the adapters and their optimizer states) and gathers one layer's NF4 weights. See
:mod:`xtl.tools._memory_lora`.

``--config`` reads these settings from a recipe (plus fragments), merged as ``xtl fit`` merges them
(:func:`read_recipe`).

Example:
    >>> from xtl.tools.memory import TrainSetup, estimate_memory
    >>> est = estimate_memory("qwen3-8b", TrainSetup(seq_len=32768, chunk_loss=1024))
    >>> round(est.peak_mbn.bytes / 2**30, 1)
    30.8
"""

from __future__ import annotations

import argparse
import json
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from huggingface_hub.errors import StrictDataclassError

from xtl.errors import ConfigError, UserError, short_message
from xtl.model import MODEL_TYPES, alias_names, get_model_config
from xtl.model.dims import ModelDims
from xtl.tools._cli import EXIT_CODES_HELP, EXIT_FAILED, EXIT_OK, ToolInputError, make_parser, run_cli
from xtl.tools._memory_lora import DEFAULT_TARGETS, NF4_DEQUANT_BYTES, BlockLoRA, block_lora, layer_linears
from xtl.tools.memory_recipe import Recipe, parse_memory_size, read_recipe

if TYPE_CHECKING:
    from xtl.model.dense.config import DenseConfig
    from xtl.strategies.layout import ParallelLayout
    from xtl.tools._memory_measure import MeasureResult

GIB = 1024**3
COLUMNS = ("params", "grads", "opt_states", "master_params", "master_grads", "acts")
FP32 = 4
INDEX_BYTES = 8
RECOMPUTE_MODES = ("none", "full", "selective")
USABLE_FRACTION = 0.9  # of a stated GPU memory; the rest: CUDA context, NCCL buffers, allocator fragmentation

EXAMPLES = """examples:
  xtl memory qwen3-8b --gpus-per-node 8 --seq-len 32768 --chunk-loss 1024          # FSDP, recompute, flash
  xtl memory qwen3-30b-a3b --nodes 4 --ep 8 --seq-len 8192
  xtl memory deepseek-v3 --nodes 128 --ep 64 --seq-len 4096
  xtl memory qwen3-32b --nodes 4 --zero 1 --tp 2 --pp 4 --vpp 2 --micro-batch-size 2
  xtl memory path/to/hf_model --no-recompute --format json
  xtl memory qwen3-8b --seq-len 8192 --recompute selective --recompute-every-n-layers 2 --offload
  xtl memory --config configs/qwen3_30b_a3b_sft.yaml qwen3-30b-a3b   # the recipe's layout and memory settings
  xtl memory --config configs/qwen3_8b_pretrain.yaml --config callbacks/activation_offload.yaml qwen3-8b
  xtl memory qwen3-8b --gpus-per-node 1 --seq-len 4096 --lora-rank 16          # LoRA: frozen bf16 base weights
  xtl memory qwen3-8b --gpus-per-node 1 --seq-len 4096 --lora-rank 16 --qlora  # QLoRA: NF4 base weights
  xtl memory --config configs/tiny_sft.yaml --config callbacks/lora.yaml --config callbacks/qlora.yaml
  xtl memory --measure                          # check the activation formulas against autograd on this CPU

aliases: {aliases}
{exit_codes} (1: --measure disagreed beyond its tolerance, or the peak exceeds the usable share of the GPU
memory stated by --gpu-memory or a recipe's `# gpu-memory:` line)"""


@dataclass
class TrainSetup:
    """Parallel layout, sequence and memory-saving options of a training run.

    The GPUs of one tensor- and pipeline-parallel position (all of them at ``tp = pp = 1``) form xtl's
    :class:`~xtl.strategies.layout.ParallelLayout` (:attr:`layout`): ``dp_replicate x dp_shard x cp``, ``ep`` inside
    the shard group; ``dp_shard`` is what the others leave. ``tp`` and ``pp`` (Megatron-style, ZeRO-1) are modelled
    here only.

    Args:
        nodes (int): Number of nodes.
        gpus_per_node (int): GPUs per node.
        tp (int): Tensor-parallel size (sequence parallel assumed for activations).
        pp (int): Pipeline-parallel size (ZeRO-1 only).
        vpp (int): Virtual pipeline stages per rank (interleaved 1F1B).
        ep (int): Expert-parallel size (``ParallelLayout.ep``): routed experts split over ``ep`` GPUs of the shard
            group, each slice sharded over the ``edp`` others.
        zero (int): 1 (optimizer states sharded) or 3 (FSDP: parameters, gradients and states sharded).
        dp_replicate (int): ZeRO-3 replicas (HSDP, ``ParallelLayout.dp_replicate``): parameters, gradients and
            states are sharded over the ``dp_shard x cp`` GPUs of one replica.
        cp (int): Context-parallel size (``ParallelLayout.cp``, ZeRO-3): each group of ``cp`` GPUs trains one
            sequence, ``1 / cp`` of its tokens each, with Ulysses attention (the gathered q/k/v/output of
            ``heads / cp`` heads, key/value heads repeated up to a multiple of ``cp``, and one block's all-to-all
            buffers); the ``cp`` GPUs shard parameters with the ``dp_shard`` ones and read the same data (``dp``
            counts them once).
        seq_len (int): Tokens per sequence.
        micro_batch_size (int): Sequences per micro-batch.
        recompute (str): Activation checkpointing of the decoder layers: ``none``, ``full`` (a layer keeps its
            input) or ``selective`` (it keeps its matmul outputs).
        recompute_every_n_layers (int): Checkpoint layers ``i`` with ``i % k == 0``; the others keep everything.
        offload (bool): Activation offload: what the offloaded layers keep for backward lives in host memory.
        offload_every_n_layers (int): Offload layers ``i`` with ``i % k == 0``.
        offload_layers (tuple[int, ...] | None): Offload these layer indices instead (negative count from the end).
        flash_attn (bool): Flash attention (no O(L^2) probabilities kept).
        chunk_loss (int): Tokens per loss chunk (0: logits of the whole micro-batch at once).
        capacity (float): MoE capacity factor (1.0 = balanced routing).
        act_bytes (int): Activation dtype size.
        param_bytes (int): Compute parameter dtype size (bf16).
        grad_bytes (int): Compute gradient dtype size (bf16).
        master_bytes (int): Master parameter / gradient dtype size (fp32).
        optim_bytes (int): Size of one Adam moment element (fp32); two moments are kept.
        lora_rank (int): LoRA adapter rank; 0 trains every parameter. With LoRA the base weights are frozen (no
            gradients, no optimizer state) and only the adapters train.
        lora_targets (tuple[str, ...] | None): Adapted linear layers (``LoRA.target_modules`` patterns; ``None``:
            its defaults, q/k/v/o and gate/up/down).
        qlora (bool): Store the frozen base weights of the adapted layers in NF4 (QLoRA).
        qlora_all_linear (bool): With ``qlora``, every linear layer of the decoder layers in NF4, adapted or not.
        frozen_bytes (int | None): Storage size of a frozen (LoRA base) weight that is not NF4 (``None``: the
            compute dtype's, ``param_bytes``).
    """

    nodes: int = 1
    gpus_per_node: int = 8
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    zero: int = 3
    dp_replicate: int = 1
    cp: int = 1
    seq_len: int = 4096
    micro_batch_size: int = 1
    recompute: str = "full"
    recompute_every_n_layers: int = 1
    offload: bool = False
    offload_every_n_layers: int = 1
    offload_layers: tuple[int, ...] | None = None
    flash_attn: bool = True
    chunk_loss: int = 0
    capacity: float = 1.0
    act_bytes: int = 2
    param_bytes: int = 2
    grad_bytes: int = 2
    master_bytes: int = 4
    optim_bytes: int = 4
    lora_rank: int = 0
    lora_targets: tuple[str, ...] | None = None
    qlora: bool = False
    qlora_all_linear: bool = False
    frozen_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.offload_layers is not None:
            self.offload_layers = tuple(self.offload_layers)
        if self.lora_targets is not None:
            self.lora_targets = tuple(self.lora_targets)

    @property
    def stored_frozen_bytes(self) -> int:
        """int: Storage size of a frozen weight that is not NF4 (``frozen_bytes``, else ``param_bytes``)."""
        return self.frozen_bytes if self.frozen_bytes is not None else self.param_bytes

    @property
    def gpus(self) -> int:
        """int: Total GPUs."""
        return self.nodes * self.gpus_per_node

    @property
    def layout(self) -> ParallelLayout:
        """ParallelLayout: xtl's layout of the GPUs of one tensor- and pipeline-parallel position.

        Raises:
            ToolInputError: The sizes form no layout.
        """
        from xtl.strategies.layout import ParallelLayout

        try:
            return ParallelLayout.for_world(
                self.gpus // (self.tp * self.pp), self.dp_replicate, "auto", self.ep, self.cp
            )
        except ConfigError as exc:
            raise ToolInputError(short_message(exc)) from None

    @property
    def dp(self) -> int:
        """int: Data-parallel size: GPUs that read different data (``ParallelLayout.dp_size``, ``dp_replicate x
        dp_shard``; the ``cp`` GPUs of a sequence count once)."""
        return self.layout.dp_size

    @property
    def shard(self) -> int:
        """int: GPUs a non-expert parameter (ZeRO-1: its optimizer state) is sharded over
        (``ParallelLayout.shard_size``, ``dp_shard x cp``: one replica)."""
        return self.layout.shard_size

    @property
    def edp(self) -> int:
        """int: GPUs a routed-expert slice is sharded over: ``ParallelLayout.edp`` (``dp_shard x cp / ep``) times
        ``tp`` (experts are not split by tensor parallelism)."""
        return self.layout.edp * self.tp


@dataclass
class Phase:
    """Memory at one point of a training step: total bytes and the labelled terms that add up to it."""

    name: str
    bytes: float
    items: list[tuple[str, float]] = field(default_factory=list)


@dataclass
class MemoryEstimate:
    """Result of :func:`estimate_memory` (all memory in bytes)."""

    model: str
    setup: TrainSetup
    params: dict[str, int]
    parts: dict[str, dict[str, float]]
    phases: dict[str, Phase]
    peak_mb1: Phase
    peak_mbn: Phase
    host_bytes: float = 0.0

    def to_dict(self) -> dict:
        """Return a JSON-serializable dict (bytes plus GiB).

        Returns:
            dict: The estimate.
        """
        return {
            "model": self.model,
            "setup": asdict(self.setup) | _layout_fields(self.setup),
            "params": self.params,
            "parts_bytes": self.parts,
            "phases": {
                p.name: {"bytes": p.bytes, "gib": p.bytes / GIB, "items": [[k, v] for k, v in p.items]}
                for p in self.phases.values()
            },
            "peak_micro_batch_1": {"phase": self.peak_mb1.name, "bytes": self.peak_mb1.bytes},
            "peak_micro_batch_n": {"phase": self.peak_mbn.name, "bytes": self.peak_mbn.bytes},
            "host_offload_bytes": self.host_bytes,
        }

    def render(self) -> str:
        """Return the human-readable report.

        Returns:
            str: Report text.
        """
        s, p = self.setup, self.params
        lines = [
            f"model {self.model}: zero {s.zero}, gpus {s.gpus}, {_layout_text(s)}, tp {s.tp}, pp {s.pp}, "
            f"vpp {s.vpp}, micro-batch {s.micro_batch_size} x {s.seq_len} tokens, recompute {_recompute_text(s)}, "
            f"offload {_offload_text(s)}, flash-attn {s.flash_attn}, chunk-loss {s.chunk_loss or 'off'}, "
            f"activations {s.act_bytes}-byte",
            *_lora_lines(s),
            "parameters: " + ", ".join(f"{k} {v / 1e9:.4f}B" for k, v in p.items()),
            f"peak, micro-batch 1:  {self.peak_mb1.bytes / GIB:.3f} GiB at {self.peak_mb1.name}",
            f"peak, micro-batch >1: {self.peak_mbn.bytes / GIB:.3f} GiB at {self.peak_mbn.name}",
        ]
        if s.offload:
            lines.append(f"host memory for offloaded activations: {self.host_bytes / GIB:.3f} GiB per GPU")
        lines += [
            "",
            f"{'part (GiB)':<18}" + "".join(f"{c:>15}" for c in COLUMNS),
        ]
        for row, cols in self.parts.items():
            lines.append(f"{row:<18}" + "".join(f"{cols[c] / GIB:>15.6f}" for c in COLUMNS))
        for phase in self.phases.values():
            lines += ["", f"{phase.name}: {phase.bytes / GIB:.4f} GiB"]
            lines += [f"  {label:<68} {val / GIB:10.4f} GiB" for label, val in phase.items]
        return "\n".join(lines)


def estimate_memory(model: str | dict | DenseConfig | ModelDims, setup: TrainSetup | None = None) -> MemoryEstimate:
    """Estimate per-GPU memory of one training step.

    Args:
        model (str | dict | DenseConfig | ModelDims): Alias, ``config.json`` path or HF model directory, HF config
            dict, xtl config or dimensions.
        setup (TrainSetup | None): Training setup (defaults: 1 node x 8 GPUs, FSDP, recompute, flash attention).

    Returns:
        MemoryEstimate: Parameter counts, per-part table, phases and peaks.
    """
    setup = setup or TrainSetup()
    dims = model_dims(model)
    _validate(dims, setup)
    return _Estimator(dims, setup).run()


def model_dims(model: str | dict | DenseConfig | ModelDims) -> ModelDims:
    """Dimensions of a model given as an alias, a ``config.json`` path, an HF model directory or an HF config dict.

    Aliases resolve through the model registry (``xtl.model.get_model_config``); a ``config.json`` goes through the
    registry's family for its ``model_type`` and that family's transformers config class.

    Args:
        model (str | dict | DenseConfig | ModelDims): The model.

    Returns:
        ModelDims: Its dimensions (named after the alias, the model directory or the config class).

    Raises:
        ToolInputError: Unknown alias (the message lists the known ones), unsupported ``model_type`` or invalid
            config.
    """
    if isinstance(model, ModelDims):
        return model
    if isinstance(model, dict):
        return ModelDims.from_config(_config_from_hf_dict(model, "config"), str(model.get("model_type", "model")))
    if not isinstance(model, str):
        return ModelDims.from_config(model)
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise ToolInputError(f"{path.parent} holds no config.json")
    if path.is_file():
        try:
            fields = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ToolInputError(f"{path} is not valid JSON: {exc}") from exc
        return ModelDims.from_config(_config_from_hf_dict(fields, str(path)), path.parent.name or str(path))
    try:
        return ModelDims.from_config(get_model_config(model), model)
    except KeyError:
        raise ToolInputError(
            f"{model!r} is neither a config.json path, an HF model directory nor a known alias "
            f"(aliases: {', '.join(alias_names())})"
        ) from None


def recipe_model_dims(recipe: Recipe, model: str | None = None) -> ModelDims:
    """Dimensions of the model ``recipe`` trains, or of ``model`` named instead, with the recipe's overrides.

    ``model`` (an alias or a path, as for :func:`model_dims`) replaces ``model.init_args.model``: recipes name
    their model by ``env:VAR`` paths, which are unset where no checkpoint is at hand. ``model_overrides`` apply
    either way, as ``xtl fit`` applies them.

    Args:
        recipe (Recipe): The recipe's settings.
        model (str | None): A model to use instead of the recipe's.

    Returns:
        ModelDims: Its dimensions.

    Raises:
        ToolInputError: No model, an unset ``env:`` variable (the message says to name the model), or a model that
            does not resolve.
    """
    from xtl.utils import resolve_path

    value = model if model is not None else recipe.model
    where = "the model given" if model is not None else "model.init_args.model"
    hint = f"name the model on the command line: xtl memory --config {' --config '.join(recipe.files)} MODEL"
    if value is None:
        raise ToolInputError(f"{recipe.files[0]} sets no model.init_args.model; {hint}")
    if isinstance(value, str):
        try:
            value = resolve_path(value)
        except UserError as exc:
            raise ToolInputError(f"{where}: {short_message(exc)}; or {hint}") from None
    if not isinstance(value, dict) and not recipe.model_overrides:
        return model_dims(value)
    from xtl.train.model_spec import resolve_model_config  # what xtl fit calls (dict fields, overrides)

    path = Path(value) if isinstance(value, str) else None
    if path is not None and path.is_file():  # a config.json: its directory
        value = str(path.parent)
    config, _ = resolve_model_config(value, recipe.model_overrides)
    name = value.get("model_type", "model") if isinstance(value, dict) else Path(value).name or value
    return ModelDims.from_config(config, str(name))


def measure_activations(
    seq_len: int = 256, config: dict | None = None, seed: int = 0, modes: bool = True
) -> MeasureResult:
    """Measure the activations autograd saves for tiny dense models and compare them with this estimator.

    Two checks (see :mod:`xtl.tools._memory_measure`): the activation formula without recompute against a
    transformers Qwen3 with fused-style ops, and, per memory mode (none, full, selective, full every 2 layers,
    offload, full + offload), what an xtl model's decoder layers keep under the real ``ActivationCheckpointing`` /
    ``ActivationOffload`` callbacks against :class:`TrainSetup`'s ``recompute`` / ``offload`` estimate, and the same
    with the ``LoRA`` callback (no recompute, selective, full) against the ``lora_rank`` estimate.

    Args:
        seq_len (int): Tokens in the single sequence.
        config (dict | None): HF Qwen3 fields of the first check (defaults to a scaled-down Qwen3).
        seed (int): Seed for weights and tokens.
        modes (bool): Run the per-mode check too.

    Returns:
        MeasureResult: Measured and formula bytes (``modes``: one row per memory mode).
    """
    from xtl.tools._memory_measure import LORA_MODES, compare_context_parallel, compare_modes, compare_with_autograd

    result = compare_with_autograd(_forward_activation_bytes, seq_len, config, seed)
    if modes:
        result.modes = compare_modes(_layers_kept_bytes, seq_len, seed)
        result.lora_modes = compare_modes(_layers_kept_bytes, seq_len, seed, LORA_MODES)
        result.cp_modes = compare_context_parallel(_layers_kept_bytes, seq_len, seed)
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``memory`` options to ``parser``.

    Setup options default to ``None`` (unset): :class:`TrainSetup`'s defaults, or with ``--config`` the recipe's
    settings, apply to what is not given.

    Args:
        parser (argparse.ArgumentParser): Parser.
    """
    d = TrainSetup()
    parser.add_argument(
        "model",
        nargs="?",
        help="alias or path to config.json / HF model directory (with --config: replaces the recipe's model)",
    )
    parser.add_argument("--model", dest="model_option", metavar="MODEL", help="the model (as the positional)")
    parser.add_argument(
        "--config",
        action="append",
        metavar="FILE",
        help="recipe, then fragments (repeat), merged as xtl fit merges them: the model, GPUs, ep, dtype, "
        "sequence length, recompute and offload come from them; options given here override",
    )
    parser.add_argument("--nodes", type=int, help=f"default {d.nodes}")
    parser.add_argument("--gpus-per-node", type=int, help=f"default {d.gpus_per_node}")
    parser.add_argument("--tp", type=int, help="tensor parallel (sequence parallel activations)")
    parser.add_argument("--pp", type=int, help="pipeline parallel, 1F1B (requires --zero 1)")
    parser.add_argument("--vpp", type=int, help="virtual pipeline stages per rank")
    parser.add_argument("--ep", type=int, help="expert parallel")
    parser.add_argument("--zero", type=int, choices=(1, 3), help="1: ZeRO-1, 3: FSDP (default)")
    parser.add_argument(
        "--dp-replicate", type=int, help="HSDP: replicas of each parameter shard (ZeRO-3; e.g. --nodes), default 1"
    )
    parser.add_argument("--cp", type=int, help="context parallel (Ulysses; ZeRO-3): GPUs sharing one sequence")
    parser.add_argument("--seq-len", type=int, help=f"tokens per sequence (default {d.seq_len}; 256 with --measure)")
    parser.add_argument("--micro-batch-size", type=int, help=f"default {d.micro_batch_size}")
    parser.add_argument(
        "--recompute",
        nargs="?",
        const="full",
        choices=RECOMPUTE_MODES,
        help="activation checkpointing of the decoder layers: none, full (also --recompute alone) or selective "
        "(default full; with --config: the recipe's ActivationCheckpointing, none without one)",
    )
    parser.add_argument(
        "--no-recompute", dest="recompute", action="store_const", const="none", help="= --recompute none"
    )
    parser.add_argument(
        "--recompute-every-n-layers",
        type=int,
        metavar="K",
        help="checkpoint layers i with i %% K == 0; the others keep full activations (default 1)",
    )
    parser.add_argument(
        "--offload",
        action=argparse.BooleanOptionalAction,
        help="activation offload: what the offloaded layers keep for backward lives in host memory (default off; "
        "with --config: the recipe's ActivationOffload)",
    )
    parser.add_argument(
        "--offload-every-n-layers", type=int, metavar="K", help="offload layers i with i %% K == 0 (implies --offload)"
    )
    parser.add_argument(
        "--offload-layers", type=_int_list, metavar="I,J,...", help="offload these layers (implies --offload)"
    )
    parser.add_argument("--flash-attn", action=argparse.BooleanOptionalAction, help="default on")
    parser.add_argument("--chunk-loss", type=int, help="tokens per loss chunk, 0 = off (default)")
    parser.add_argument("--capacity", type=float, help=f"MoE capacity factor (default {d.capacity})")
    parser.add_argument(
        "--act-bytes", type=int, help=f"activation dtype size (default {d.act_bytes}; with --config: the recipe's)"
    )
    parser.add_argument(
        "--lora-rank",
        type=int,
        metavar="R",
        help="LoRA: frozen base weights, adapters of rank R train (gradients and Adam states for them only); "
        "default 0: every parameter trains (with --config: the recipe's LoRA callback)",
    )
    parser.add_argument(
        "--lora-targets",
        type=_name_list,
        metavar="NAME,...",
        help=f"adapted linear layers, names or patterns as LoRA.target_modules (default {','.join(DEFAULT_TARGETS)})",
    )
    parser.add_argument(
        "--qlora",
        action=argparse.BooleanOptionalAction,
        help="QLoRA: the adapted layers' base weights in NF4, about 4.13 bits each (needs a LoRA rank)",
    )
    parser.add_argument(
        "--frozen-bytes",
        type=int,
        metavar="N",
        help="storage size of a frozen base weight that is not NF4 (default: the compute dtype's, 2; with "
        "--config: what xtl fit stores, fp32 under FSDP, else the model's param_dtype)",
    )
    parser.add_argument(
        "--gpu-memory",
        type=_memory_size_arg,
        metavar="SIZE",
        help=f"GPU memory to check the peak against, e.g. 80GiB: it must fit in {USABLE_FRACTION:.0%}% of it "
        "(default: a recipe's `# gpu-memory:` line)",
    )
    parser.add_argument("--format", choices=("text", "json"), default="text")
    parser.add_argument(
        "--measure",
        action="store_true",
        help="measure activations of scaled-down dense models per memory mode and compare",
    )


def run(args: argparse.Namespace) -> int:
    """Run ``memory`` from parsed arguments.

    Args:
        args (argparse.Namespace): Parsed ``add_arguments`` options.

    Returns:
        int: Exit code.
    """
    if args.measure:
        result = measure_activations(seq_len=args.seq_len or 256)
        print(json.dumps(result.to_dict(), indent=2) if args.format == "json" else result.render())
        return EXIT_OK if result.ok else EXIT_FAILED
    if args.model and args.model_option and args.model != args.model_option:
        raise ToolInputError(f"two models given ({args.model!r} and --model {args.model_option!r}); give one")
    model = args.model_option or args.model
    recipe = read_recipe(args.config) if args.config else None
    if recipe is None and not model:
        raise ToolInputError("give a model alias or config path (or --config RECIPE, or --measure)")
    dims = recipe_model_dims(recipe, model) if recipe is not None else model_dims(model)
    if recipe is not None and model:
        recipe.read_from["model"] = f"{model} (command line; model.init_args.model is {recipe.model!r})"
    setup = TrainSetup(**(recipe.setup if recipe is not None else {}) | _explicit_setup(args))
    est = estimate_memory(dims, setup)
    gpu_memory, source = args.gpu_memory, "--gpu-memory"
    if gpu_memory is None and recipe is not None and recipe.gpu_memory is not None:
        gpu_memory, source = recipe.gpu_memory, f"`# gpu-memory:` line of {recipe.gpu_memory_file}"
    fits = gpu_memory is None or est.peak_mbn.bytes <= USABLE_FRACTION * gpu_memory
    if args.format == "json":
        out = est.to_dict()
        if recipe is not None:
            out["recipe"] = recipe.to_dict()
        if gpu_memory is not None:
            out["gpu_memory"] = {
                "bytes": gpu_memory,
                "usable_bytes": USABLE_FRACTION * gpu_memory,
                "source": source,
                "peak_bytes": est.peak_mbn.bytes,
                "fits": fits,
            }
        print(json.dumps(out, indent=2))
    else:
        text = est.render()
        if recipe is not None:
            text = recipe.render() + "\n" + text
        if gpu_memory is not None:
            verdict = "fits in" if fits else "EXCEEDS"
            text += (
                f"\n\nGPU memory {gpu_memory / GIB:g} GiB ({source}): peak {est.peak_mbn.bytes / GIB:.3f} GiB "
                f"{verdict} the usable {USABLE_FRACTION * gpu_memory / GIB:.3f} GiB ({USABLE_FRACTION:.0%}; the rest "
                "for the CUDA context, NCCL buffers and allocator fragmentation)"
            )
        print(text)
    return EXIT_OK if fits else EXIT_FAILED


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point of ``xtl memory``.

    Args:
        argv (list[str] | None): Arguments (without the program name).

    Returns:
        int: Exit code (0 ok, 1 --measure out of tolerance, 2 usage or input error).
    """
    epilog = EXAMPLES.format(aliases=", ".join(alias_names()), exit_codes=EXIT_CODES_HELP)
    parser = make_parser("xtl memory", "Estimate per-GPU training memory of an HF causal LM.", epilog)
    add_arguments(parser)
    return run_cli(parser, argv, run)


def _config_from_hf_dict(fields: dict, where: str) -> DenseConfig:
    model_type = fields.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ToolInputError(
            f"{where} lacks a supported model_type (got {model_type!r}; supported: {', '.join(sorted(MODEL_TYPES))})"
        )
    cls = MODEL_TYPES[model_type]
    try:
        return cls.from_hf_config(cls.hf_config_class.from_dict(fields))
    except (KeyError, TypeError, ValueError, StrictDataclassError) as exc:  # transformers validates field types
        raise ToolInputError(f"{where} has an invalid field: {exc}") from exc


def _forward_activation_bytes(config: dict, seq_len: int) -> float:
    """Activation bytes of one fp32 forward without recomputation, of the dense model with HF fields ``config``."""
    dims = model_dims(config)
    setup = TrainSetup(nodes=1, gpus_per_node=1, seq_len=seq_len, recompute="none", act_bytes=4)
    parts = estimate_memory(dims, setup).parts
    layer = parts["layer_attn"]["acts"] + parts["layer_mlp"]["acts"]
    return parts["embed"]["acts"] + parts["head"]["acts"] + layer * dims.num_layers


def _layers_kept_bytes(fields: dict, seq_len: int, options: dict) -> tuple[float, float]:
    """(GPU, host) bytes all decoder layers of the xtl model ``fields`` keep at the end of an fp32 forward."""
    fields = dict(fields)
    config = MODEL_TYPES[fields.pop("model_type")](**fields)
    dims = ModelDims.from_config(config)
    base = {"nodes": 1, "gpus_per_node": options.get("cp", 1), "seq_len": seq_len, "act_bytes": 4}
    setup = TrainSetup(**(base | options))
    _validate(dims, setup)
    est = _Estimator(dims, setup)
    kept = [est.kept(layer) for layer in range(dims.num_layers)]
    return sum(gpu for gpu, _ in kept), sum(host for _, host in kept)


def _explicit_setup(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`TrainSetup` fields given on the command line (they override a recipe's)."""
    given = {f.name: getattr(args, f.name) for f in fields(TrainSetup) if getattr(args, f.name, None) is not None}
    if args.offload_every_n_layers is not None or args.offload_layers is not None:
        given.setdefault("offload", True)
        if args.offload_layers is None:
            given["offload_layers"] = None  # the command line's every-n replaces a recipe's layer list
        else:
            given["offload_layers"] = tuple(args.offload_layers)
            given["offload_every_n_layers"] = 1
    return given


def _name_list(text: str) -> list[str]:
    names = [item.strip() for item in text.split(",") if item.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected layer names such as q_proj,v_proj; got {text!r}")
    return names


def _int_list(text: str) -> list[int]:
    try:
        return [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected layer indices such as 0,2,5; got {text!r}") from None


def _memory_size_arg(text: str) -> int:
    try:
        return parse_memory_size(text, "--gpu-memory")
    except ToolInputError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _lora_lines(s: TrainSetup) -> list[str]:
    if not s.lora_rank:
        return []
    targets = ", ".join(s.lora_targets if s.lora_targets is not None else DEFAULT_TARGETS)
    nf4 = ""
    if s.qlora:
        nf4 = ", NF4 " + ("for every linear layer" if s.qlora_all_linear else "for the adapted layers")
    return [
        f"lora: rank {s.lora_rank} on {targets}; frozen base weights {s.stored_frozen_bytes}-byte{nf4}; gradients "
        "and Adam states for the adapters only"
    ]


def _layout_text(s: TrainSetup) -> str:
    """``dp_replicate 2 x dp_shard 4 x cp 1 (dp 8), ep 1`` (``ep 2 (edp 4)`` with experts split)."""
    layout = s.layout
    text = f"dp_replicate {layout.dp_replicate} x dp_shard {layout.dp_shard} x cp {layout.cp} (dp {s.dp})"
    return text + (f", ep {s.ep} (edp {s.edp})" if s.ep > 1 else ", ep 1")


def _layout_fields(s: TrainSetup) -> dict[str, int]:
    """What the layout derives, for the JSON report's ``setup``."""
    return {"gpus": s.gpus, "dp": s.dp, "dp_shard": s.layout.dp_shard, "edp": s.edp}


def _recompute_text(s: TrainSetup) -> str:
    if s.recompute == "none" or s.recompute_every_n_layers == 1:
        return s.recompute
    return f"{s.recompute} (every {s.recompute_every_n_layers} layers)"


def _offload_text(s: TrainSetup) -> str:
    if not s.offload:
        return "off"
    if s.offload_layers is not None:
        return f"layers {list(s.offload_layers)}"
    return "on" if s.offload_every_n_layers == 1 else f"every {s.offload_every_n_layers} layers"


def _validate(dims: ModelDims, s: TrainSetup) -> None:
    problems = []
    ranks = s.gpus // (s.tp * s.pp) if min(s.tp, s.pp) >= 1 else 0  # the layout's GPUs: dp_replicate x dp_shard x cp
    if s.recompute not in RECOMPUTE_MODES:
        problems.append(f"recompute must be one of {', '.join(RECOMPUTE_MODES)}; got {s.recompute!r}")
    elif min(s.recompute_every_n_layers, s.offload_every_n_layers) < 1:
        problems.append("--recompute-every-n-layers and --offload-every-n-layers must be >= 1")
    elif s.offload_layers is not None and s.offload_every_n_layers != 1:
        problems.append("give either offload layers or offload every-n-layers, not both")
    elif s.offload_layers is not None and any(not -dims.num_layers <= i < dims.num_layers for i in s.offload_layers):
        problems.append(f"offload layers {list(s.offload_layers)} are out of range for {dims.num_layers} layers")
    elif min(s.nodes, s.gpus_per_node, s.tp, s.pp, s.vpp, s.ep, s.seq_len, s.micro_batch_size) < 1:
        problems.append("sizes must be >= 1")
    elif s.gpus % (s.tp * s.pp):
        problems.append(f"{s.gpus} GPUs are not divisible by tp*pp={s.tp * s.pp}")
    elif s.cp < 1 or ranks % s.cp or (s.cp > 1 and (s.zero != 3 or s.tp > 1 or dims.num_heads % s.cp)):
        problems.append(
            f"cp={s.cp} is modelled with ZeRO-3 and tp 1; it must divide the {ranks} GPUs and the "
            f"{dims.num_heads} heads"
        )
    elif s.dp_replicate < 1 or (ranks // s.cp) % s.dp_replicate or (s.dp_replicate > 1 and (s.zero != 3 or s.ep > 1)):
        problems.append(
            f"dp_replicate={s.dp_replicate} needs ZeRO-3 without ep and must divide the {ranks // s.cp} GPUs of "
            "dp_replicate x dp_shard (GPUs / cp)"
        )
    elif (ranks // s.dp_replicate) % s.ep:
        problems.append(
            f"ep={s.ep} must divide the {ranks // s.dp_replicate} GPUs a parameter is sharded over (dp_shard x cp)"
        )
    elif s.zero == 3 and s.pp > 1:
        problems.append("pipeline parallelism is modelled with --zero 1 (Megatron-style), not with FSDP")
    elif dims.num_layers % s.pp or (dims.num_layers // s.pp) % s.vpp:
        problems.append(f"{dims.num_layers} layers do not split into pp={s.pp} x vpp={s.vpp} stages")
    elif s.ep > 1 and (not dims.is_moe or dims.num_experts % s.ep):
        problems.append(f"ep={s.ep} needs an MoE model whose expert count ({dims.num_experts}) it divides")
    elif dims.num_kv_heads % s.tp and not dims.is_mla:
        problems.append(f"tp={s.tp} does not divide {dims.num_kv_heads} key/value heads")
    problems += _lora_problems(dims, s)
    if problems:
        raise ToolInputError("; ".join(problems))


def _lora_problems(dims: ModelDims, s: TrainSetup) -> list[str]:
    if s.lora_rank < 0 or (s.frozen_bytes is not None and s.frozen_bytes < 1):
        return ["the LoRA rank must be >= 0 and the frozen weight size >= 1 byte"]
    if s.qlora and not s.lora_rank:
        return ["QLoRA quantizes the frozen base weights under LoRA adapters: give a LoRA rank (--lora-rank R)"]
    if s.qlora and (s.tp > 1 or s.pp > 1 or (s.zero == 1 and s.gpus > 1)):
        return [
            f"--qlora: xtl's QLoRA shards its NF4 weights with FSDP (--zero 3), without tensor or pipeline "
            f"parallelism; got --tp {s.tp} --pp {s.pp} --zero {s.zero}: give --tp 1 --pp 1 --zero 3"
        ]
    if not s.lora_rank:
        return []
    targets = s.lora_targets if s.lora_targets is not None else DEFAULT_TARGETS
    if any(
        b.adapted
        for layer in range(dims.num_layers)
        for b in block_lora(dims, layer, 1, targets, False, False).values()
    ):
        return []
    names = sorted(
        {name.rsplit(".", 1)[-1] for layer in range(dims.num_layers) for name in layer_linears(dims, layer)}
    )
    return [f"LoRA targets {list(targets)} match no linear layer of {dims.name}; its linear layers are named {names}"]


class _Estimator:
    def __init__(self, dims: ModelDims, setup: TrainSetup) -> None:
        self.d, self.s = dims, setup
        # per GPU: sequence parallel (tp), context parallel (cp)
        self.tokens = setup.micro_batch_size * setup.seq_len / (setup.tp * setup.cp)
        self.local_layers = dims.num_layers // setup.pp
        # xtl's expert-parallel layout: dense parameters are sharded over all data-parallel ranks, routed experts
        # over the expert-data-parallel ranks (edp) after being split over ep
        self.shard = setup.shard
        self.expert_shard = setup.edp
        self._lora_cache: dict[int, dict[str, BlockLoRA]] = {}
        if setup.offload_layers is not None:
            self.offload_set = {i % dims.num_layers for i in setup.offload_layers}
        else:
            self.offload_set = set(range(0, dims.num_layers, setup.offload_every_n_layers))

    def run(self) -> MemoryEstimate:
        stages = sorted({0, self.s.pp - 1})
        phases_by_stage = {st: self._phases(st) for st in stages}
        phases: dict[str, Phase] = {}
        for name in ("micro1_forward_end", "micro1_backward_end", "microN_forward_end"):
            worst = max((phases_by_stage[st][name] for st in stages), key=lambda p: p.bytes)
            phases[name] = worst
        mb1 = max((phases["micro1_forward_end"], phases["micro1_backward_end"]), key=lambda p: p.bytes)
        mbn = max(phases.values(), key=lambda p: p.bytes)
        return MemoryEstimate(
            model=self.d.name,
            setup=self.s,
            params=self.d.parameter_counts() | self._lora_params(),
            parts=self._parts(0 if self.s.pp == 1 else self.s.pp - 1),
            phases=phases,
            peak_mb1=mb1,
            peak_mbn=mbn,
            host_bytes=max(self._host_bytes(st) for st in stages),
        )

    # ---- what each decoder layer keeps for backward (recompute and offload settings) --------------------------
    def checkpointed(self, layer: int) -> bool:
        s = self.s
        return s.recompute != "none" and layer % s.recompute_every_n_layers == 0

    def offloaded(self, layer: int) -> bool:
        return self.s.offload and layer in self.offload_set

    def saved(self, layer: int) -> float:
        """Bytes ``layer`` keeps for backward of one micro-batch, wherever they live."""
        if not self.checkpointed(layer):
            per_token = self._attn_act_bytes() + self._mlp_act_bytes(layer)
            per_token += sum(self._adapter_act_bytes(layer, which) for which in ("attn", "mlp"))
        elif self.s.recompute == "full":
            per_token = self._checkpoint_act_bytes(layer)
        else:
            per_token = self._selective_attn_act_bytes() + self._selective_mlp_act_bytes(layer)
            per_token += sum(self._adapter_act_bytes(layer, which, selective=True) for which in ("attn", "mlp"))
        return per_token * self.tokens

    def kept(self, layer: int) -> tuple[float, float]:
        """(GPU, host) bytes ``layer`` keeps for backward of one micro-batch at the end of forward.

        An offloaded layer keeps nothing on the GPU; its host copy holds what it saves plus, when it is not
        checkpointed, its own copy of RoPE's cos/sin (shared by all layers on the GPU, copied per layer).
        """
        if not self.offloaded(layer):
            return self.saved(layer), 0.0
        rope = 0.0 if self.checkpointed(layer) else 2 * self._rotary_dim() * self.s.act_bytes * self.tokens
        return 0.0, self.saved(layer) + rope

    def _layer_kind(self, layer: int) -> str:
        if self.offloaded(layer):
            return "nothing on the GPU (offloaded)"
        if not self.checkpointed(layer):
            return "all activations"
        return "layer input (full recompute)" if self.s.recompute == "full" else "matmul outputs (selective)"

    def _kept_item(self, layers: Sequence[int], label: str) -> tuple[str, float]:
        kinds = Counter(self._layer_kind(layer) for layer in layers)
        text = ", ".join(f"{kind} x {count}" for kind, count in kinds.items()) or "none"
        return f"{label}: {text}", sum(self.kept(layer)[0] for layer in layers)

    def _offload_in_flight(self, layers: Sequence[int]) -> list[tuple[str, float]]:
        """One offloaded layer's saved tensors on the GPU besides the working layer: being copied to the host in
        forward, prefetched back for the next layer in backward."""
        others = [layer for layer in layers[:-1] if self.offloaded(layer)]
        if not others:
            return []
        return [("offload: one more layer's saved tensors (copy / prefetch)", max(self.saved(i) for i in others))]

    def _host_bytes(self, stage: int) -> float:
        host = sum(self.kept(layer)[1] for layer in self._stage_layers(stage))
        return host * (self._in_flight(stage) if self.s.zero == 1 else 1.0)

    # ---- per-part bytes ----------------------------------------------------------------------------------------
    def _states(self, dense_count: float, expert_count: float) -> dict[str, float]:
        s = self.s
        sharded = dense_count / self.shard + expert_count / self.expert_shard
        return {
            "opt_states": 2 * sharded * s.optim_bytes,
            "master_params": sharded * s.master_bytes,
            "master_grads": sharded * s.master_bytes,
        }

    def _full(self, count: float) -> dict[str, float]:
        return {"params": count * self.s.param_bytes, "grads": count * self.s.grad_bytes}

    def _weights(self, count: float) -> dict[str, float]:
        """Columns of ``count`` non-expert parameters: trained, or frozen under LoRA."""
        return self._frozen(count, 0.0, 0.0, 0.0) if self.s.lora_rank else self._full(count) | self._states(count, 0)

    def _frozen(self, dense: float, expert: float, nf4_bytes: float, nf4_stored: float) -> dict[str, float]:
        """Columns of frozen weights (LoRA base): ``dense`` / ``expert`` parameters in ``frozen_bytes`` plus NF4
        weights of ``nf4_bytes`` gathered, ``nf4_stored`` per GPU; no gradients, no optimizer state.

        ZeRO-3 stores them sharded (``master_params``: the stored copy; NF4: each GPU's shard) and gathers one layer
        in the compute dtype (NF4 weights gathered as NF4: ``params``); ZeRO-1 keeps them whole (``params``).
        """
        s = self.s
        stored = dense * s.stored_frozen_bytes / self.shard + nf4_stored
        stored += expert * s.stored_frozen_bytes / self.expert_shard
        zero = dict.fromkeys(("grads", "opt_states", "master_grads"), 0.0)
        if s.zero == 3:
            return zero | {"params": (dense + expert) * s.param_bytes + nf4_bytes, "master_params": stored}
        return zero | {"params": (dense + expert) * s.stored_frozen_bytes + nf4_bytes, "master_params": 0.0}

    def _lora(self, layer: int) -> dict[str, BlockLoRA]:
        """LoRA figures of the attention and MLP blocks of ``layer`` (cached)."""
        if layer not in self._lora_cache:
            s = self.s
            targets = s.lora_targets if s.lora_targets is not None else DEFAULT_TARGETS
            shard = self.shard if s.zero == 3 else 1  # the FSDP ranks that shard each NF4 weight
            self._lora_cache[layer] = block_lora(
                self.d, layer, s.lora_rank, targets, s.qlora, s.qlora_all_linear, shard
            )
        return self._lora_cache[layer]

    def _lora_params(self) -> dict[str, int]:
        """Parameter counts of the LoRA setup (none without LoRA): adapters, and weights stored in NF4."""
        if not self.s.lora_rank:
            return {}
        blocks = [b for layer in range(self.d.num_layers) for b in self._lora(layer).values()]
        counts = {"lora_adapters": sum(b.adapter_params for b in blocks)}
        return counts | ({"nf4_weights": sum(b.nf4_numel for b in blocks)} if self.s.qlora else {})

    def _adapter_act_bytes(self, layer: int, which: str, selective: bool = False) -> float:
        """Bytes one token keeps for the adapters of a block: the ``lora_A`` output (``r``) per adapted layer;
        selective recompute keeps every matmul output, the ``lora_B`` output (``out``) too."""
        if not self.s.lora_rank:
            return 0.0
        block = self._lora(layer)[which]
        per_token = len(block.adapted) * self.s.lora_rank + (block.adapter_outputs if selective else 0)
        return per_token * self.s.act_bytes

    def _dequant_item(self, layers: Sequence[int]) -> list[tuple[str, float]]:
        """QLoRA: the working set of dequantizing the largest NF4 weight for its matmul (none without NF4)."""
        if not self.s.qlora:
            return []
        largest = max((b.largest_nf4 for layer in layers for b in self._lora(layer).values()), default=0)
        if not largest:
            return []
        label = f"NF4 dequantization working set: {NF4_DEQUANT_BYTES} bytes x the largest NF4 weight"
        return [(label, NF4_DEQUANT_BYTES * largest / self.s.tp)]

    def _layer_counts(self, layer: int) -> tuple[float, float, float]:
        """(attention, non-expert mlp, routed experts) local parameter counts of one layer."""
        d, s = self.d, self.s
        experts = d.expert_params(layer)
        return d.attention_params() / s.tp, (d.mlp_params(layer) - experts) / s.tp, experts / s.ep

    def _layer_part(self, layer: int, which: str) -> dict[str, float]:
        attn, mlp, experts = self._layer_counts(layer)
        if which == "attn":
            dense, expert, act = attn, 0.0, self._attn_act_bytes() * self.tokens
        else:
            dense, expert, act = mlp, experts, self._mlp_act_bytes(layer) * self.tokens
        if not self.s.lora_rank:
            return self._full(dense + expert) | self._states(dense, expert) | {"acts": act}
        block, tp = self._lora(layer)[which], self.s.tp
        frozen = self._frozen(dense - block.nf4_numel / tp, expert, block.nf4_bytes / tp, block.nf4_shard_bytes / tp)
        adapters = self._full(block.adapter_params / tp) | self._states(block.adapter_params / tp, 0)
        part = {col: frozen[col] + adapters[col] for col in frozen}
        return part | {"acts": act + self._adapter_act_bytes(layer, which) * self.tokens}

    def _layer_acts(self, layer: int) -> float:
        return self._layer_part(layer, "attn")["acts"] + self._layer_part(layer, "mlp")["acts"]

    def _embed_part(self) -> dict[str, float]:
        count = self.d.embedding_params() / self.s.tp
        return self._weights(count) | {"acts": self.tokens * INDEX_BYTES}

    def _head_part(self) -> dict[str, float]:
        d, s = self.d, self.s
        count = d.head_params() / s.tp
        loss_tokens = s.micro_batch_size * s.seq_len
        if s.chunk_loss > 0:
            loss_tokens = min(loss_tokens, s.chunk_loss)
        acts = (2 * d.hidden_size * s.act_bytes + FP32) * self.tokens  # final norm input and output, rstd
        acts += loss_tokens * d.vocab_size * FP32 / s.tp  # fp32 log-probabilities kept by the cross-entropy
        part = self._weights(count) | {"acts": acts}
        if d.tie_word_embeddings:  # the tied embedding weight is gathered for the head, its states live in embed
            part["params"] += d.embedding_params() / s.tp * s.param_bytes
        return part

    def _stage_layers(self, stage: int) -> range:
        return range(stage * self.local_layers, (stage + 1) * self.local_layers)

    def _parts(self, stage: int) -> dict[str, dict[str, float]]:
        layers = self._stage_layers(stage)
        first, last = layers[0], layers[-1]
        zero1 = self.s.zero == 1
        rows = {
            "embed": self._embed_part(),
            "head": self._head_part(),
            "layer_attn": self._layer_part(last, "attn"),
            "layer_mlp": self._layer_part(last, "mlp"),
        }
        if self._layer_counts(first) != self._layer_counts(last):
            rows["first_layer_mlp"] = self._layer_part(first, "mlp")
        for which in ("attn", "mlp"):
            total = dict.fromkeys(COLUMNS, 0.0)
            for layer in layers:
                for col, val in self._layer_part(layer, which).items():
                    if col != "acts" and (zero1 or col not in ("params", "grads")):
                        total[col] += val
            rows[f"all_{which}"] = total
        rows["layer_input_ckpt"] = dict.fromkeys(COLUMNS, 0.0) | {
            "acts": self.tokens * self._checkpoint_act_bytes(last)
        }
        if self.d.mtp_layers:
            rows["mtp"] = self._mtp_part()
        return rows

    def _mtp_part(self) -> dict[str, float]:
        """The multi-token-prediction depths (after the last layer, on the last stage): their weights, and per
        micro-batch what they keep for backward (each depth's decoder layer under the run's recompute setting, its
        input norms, projection input and output norm, and its loss's fp32 log-probabilities as the head's)."""
        d, s = self.d, self.s
        counts = d.parameter_counts()
        dense, expert = (counts["mtp"] - counts["mtp_experts"]) / s.tp, counts["mtp_experts"] / s.ep
        weights = self._frozen(dense, expert, 0.0) if s.lora_rank else self._full(dense + expert)
        if not s.lora_rank:
            weights |= self._states(dense, expert)
        h, act = d.hidden_size, s.act_bytes
        own = (2 * h + 2 * h + 2 * h) * act + 3 * FP32  # enorm/hnorm inputs, projection input, output norm
        acts = 0.0
        for depth, layer in enumerate(d.mtp_layer_indices()):
            if s.recompute == "none" or depth % s.recompute_every_n_layers:
                kept = self._attn_act_bytes() + self._mlp_act_bytes(layer)
            elif s.recompute == "full":
                kept = self._checkpoint_act_bytes(layer)
            else:
                kept = self._selective_attn_act_bytes() + self._selective_mlp_act_bytes(layer)
            acts += (kept + own) * self.tokens
        loss = self._head_part()["acts"] - (2 * h * act + FP32) * self.tokens  # the head's loss share
        return weights | {"acts": acts + d.mtp_layers * loss}

    # ---- activations (bytes per token of one micro-batch, full tensor before tp) ------------------------------
    def _attn_act_bytes(self) -> float:
        """Bytes one token keeps for the backward of one attention block, with its input norm."""
        d, act = self.d, self.s.act_bytes
        h, a = d.hidden_size, d.num_heads
        norm = 2 * h * act + FP32  # input, output (kept by the q/k/v projections), rstd
        lse = a * FP32 if self.s.flash_attn else a * self.s.seq_len * act  # log-sum-exp, or the probabilities
        if d.is_mla:
            lora = (2 * d.q_lora_rank + 2 * d.kv_lora_rank) * act  # q_a / kv_a norm inputs and outputs
            lora += FP32 * ((1 if d.q_lora_rank else 0) + 1)  # q_a / kv_a norm rstd
            core = (2 * a * d.qk_head_dim + 2 * a * d.v_head_dim) * act  # q, k, v, output
            ulysses = a * d.v_head_dim * act if self.s.cp > 1 else 0  # o_proj keeps the output exchanged back
            return norm + lora + core + ulysses + lse
        qd, kd = a * d.head_dim, d.num_kv_heads * d.head_dim
        qk_norm = ((qd + kd) * act + (a + d.num_kv_heads) * FP32) if d.qk_norm else 0
        if self.s.cp > 1:  # the kernel keeps the gathered q, k, v (repeated) and output; o_proj the local output
            kv = kd * self._kv_repeats()
            return norm + qk_norm + (qd + kv + kv + qd + qd) * act + lse
        core = (qd + kd + kd + qd) * act  # q and k after RoPE, v, output (o_proj input)
        return norm + qk_norm + core + lse

    def _kv_repeats(self) -> int:
        """How often Ulysses repeats each key/value head (:func:`xtl.ops.ulysses.ulysses_kv_repeats`)."""
        kv = self.d.num_heads if self.d.is_mla else self.d.num_kv_heads
        return self.s.cp // math.gcd(kv, self.s.cp)

    def _ulysses_item(self) -> list[tuple[str, float]]:
        """Context parallelism: one attention block's all-to-all send and receive buffers (q, k, v, output)."""
        if self.s.cp == 1:
            return []
        d, a = self.d, self.d.num_heads
        if d.is_mla:
            per_token = 2 * a * d.qk_head_dim + a * d.v_head_dim + a * d.v_head_dim
        else:
            per_token = 2 * a * d.head_dim + 2 * d.num_kv_heads * d.head_dim * self._kv_repeats()
        label = f"Ulysses all-to-all buffers (cp {self.s.cp}): one attention block's q, k, v and output in flight"
        return [(label, 2 * per_token * self.s.act_bytes * self.tokens)]

    def _mlp_act_bytes(self, layer: int) -> float:
        """Bytes one token keeps for the backward of one MLP / MoE block, with its post-attention norm."""
        d, act = self.d, self.s.act_bytes
        h = d.hidden_size
        norm = 2 * h * act + FP32
        if not d.is_moe_layer(layer):
            return norm + 3 * d.intermediate_size * act  # gate, up, down input
        k, i = d.experts_per_token, d.moe_intermediate_size
        router = d.num_experts * FP32 + k * (FP32 + INDEX_BYTES)  # scores, top-k weights, permutation indices
        routed = self.s.capacity * k * (h + 3 * i) * act  # permuted input, gate, up, down input
        combine = k * h * act  # expert outputs, needed for the gradient of the top-k weights
        shared = 3 * d.shared_intermediate_size * act
        return norm + router + routed + combine + shared

    def _checkpoint_act_bytes(self, layer: int) -> float:
        """Bytes one token keeps in a fully recomputed layer: its input, plus the top-k routing decisions (fp32
        weights, int64 ids) of an MoE layer, which recomputation reuses."""
        d = self.d
        routing = d.experts_per_token * (FP32 + INDEX_BYTES) if d.is_moe_layer(layer) else 0
        return d.hidden_size * self.s.act_bytes + routing

    def _selective_attn_act_bytes(self) -> float:
        """Bytes one token keeps in a selectively recomputed attention block: the layer input and the outputs of
        the matmuls and of attention (norms and RoPE are recomputed from them)."""
        d, act = self.d, self.s.act_bytes
        h, a = d.hidden_size, d.num_heads
        lse = a * FP32 if self.s.flash_attn else a * self.s.seq_len * act  # log-sum-exp, or the scores (bmm)
        if d.is_mla:
            q = (d.q_lora_rank + a * d.qk_head_dim) if d.q_lora_rank else a * d.qk_head_dim  # q_a, q_b / q_proj
            kv = d.kv_lora_rank + d.qk_rope_head_dim + a * (d.qk_nope_head_dim + d.v_head_dim)  # kv_a, kv_b
            core = q + kv + a * d.v_head_dim  # attention output
        else:
            qd, kd = a * d.head_dim, d.num_kv_heads * d.head_dim
            core = qd + kd + kd + qd  # q/k/v projection outputs, attention output
        return (h + core + h) * act + lse  # layer input, core, o_proj output

    def _selective_mlp_act_bytes(self, layer: int) -> float:
        """Bytes one token keeps in a selectively recomputed MLP / MoE block: the matmul outputs (gate, up, down;
        router logits) and the top-k routing decisions; norm, activation and permutations are recomputed."""
        d, act = self.d, self.s.act_bytes
        h = d.hidden_size
        if not d.is_moe_layer(layer):
            return (2 * d.intermediate_size + h) * act
        k, i = d.experts_per_token, d.moe_intermediate_size
        router = d.num_experts * FP32 + k * (FP32 + INDEX_BYTES)  # fp32 logits, top-k weights and ids
        routed = self.s.capacity * k * (2 * i + h) * act  # grouped-matmul outputs: gate, up, down
        shared = (2 * d.shared_intermediate_size + h) * act if d.shared_intermediate_size else 0
        return router + routed + shared

    def _rotary_dim(self) -> int:
        return self.d.qk_rope_head_dim if self.d.is_mla else self.d.head_dim

    # ---- phases ------------------------------------------------------------------------------------------------
    def _phases(self, stage: int) -> dict[str, Phase]:
        return self._zero3_phases() if self.s.zero == 3 else self._zero1_phases(stage)

    def _zero3_phases(self) -> dict[str, Phase]:
        r = self._parts(0)
        n, layers = self.local_layers, self._stage_layers(0)
        sharded = ("embed", "head", "all_attn", "all_mlp") + (("mtp",) if "mtp" in r else ())
        static = sum(r[p]["master_params"] + r[p]["opt_states"] for p in sharded)
        static_grad = sum(r[p]["master_grads"] for p in sharded)
        last = r["layer_attn"]["params"] + r["layer_mlp"]["params"] + r["layer_attn"]["acts"] + r["layer_mlp"]["acts"]
        static_label = "static: master params + Adam states (sharded)"
        if self.s.lora_rank:
            static_label = "static: frozen weights, adapter master params + Adam states (sharded)"
        fwd = [
            (static_label, static),
            ("gathered last layer: bf16 params + activations", last),
            ("gathered head: bf16 params + activations + loss logits", r["head"]["params"] + r["head"]["acts"]),
            ("embedding activations (token ids)", r["embed"]["acts"]),
            self._kept_item(layers[:-1], f"kept by the other {n - 1} layers"),
            *self._mtp_item(r),
            *self._offload_in_flight(layers),
            *self._dequant_item(layers),
            *self._ulysses_item(),
        ]
        first_mlp = r.get("first_layer_mlp", r["layer_mlp"])
        first = r["layer_attn"]["params"] + first_mlp["params"] + r["layer_attn"]["acts"] + first_mlp["acts"]
        prev_grads = r["layer_attn"]["grads"] + self._layer_part(layers[1], "mlp")["grads"] if n > 1 else 0.0
        bwd = [
            (static_label, static),
            ("static: master grads (sharded)", static_grad),
            ("gathered first layer: bf16 params + activations", first),
            ("gathered embedding: bf16 params + activations", r["embed"]["params"] + r["embed"]["acts"]),
            ("previous layer bf16 grads being reduce-scattered", prev_grads),
            *self._dequant_item(layers),
            *self._ulysses_item(),
        ]
        fwd2 = fwd[:1] + [("static: master grads (sharded)", static_grad)] + fwd[1:]
        return {
            "micro1_forward_end": Phase("micro1_forward_end", sum(v for _, v in fwd), fwd),
            "micro1_backward_end": Phase("micro1_backward_end", sum(v for _, v in bwd), bwd),
            "microN_forward_end": Phase("microN_forward_end", sum(v for _, v in fwd2), fwd2),
        }

    def _mtp_item(self, r: dict[str, dict[str, float]]) -> list[tuple[str, float]]:
        """ZeRO-3, end of forward: what the MTP depths keep for backward, with one depth's gathered bf16 weights."""
        if "mtp" not in r:
            return []
        label = f"MTP depths ({self.d.mtp_layers}): kept activations and loss log-probabilities, one depth gathered"
        return [(label, r["mtp"]["acts"] + r["mtp"]["params"] / self.d.mtp_layers)]

    def _in_flight(self, stage: int) -> float:
        """Micro-batches whose activations a 1F1B stage holds (interleaved: more)."""
        s = self.s
        flying = float(s.pp - stage)
        if s.vpp > 1:
            flying *= 1 + (s.pp - 1) / (s.pp * s.vpp)
        return flying

    def _zero1_phases(self, stage: int) -> dict[str, Phase]:
        s, r = self.s, self._parts(stage)
        layers = self._stage_layers(stage)
        first_stage, last_stage = stage == 0, stage == s.pp - 1
        names = ["all_attn", "all_mlp"] + (["embed"] if first_stage else [])
        names += (["head"] + (["mtp"] if "mtp" in r else [])) if last_stage else []
        static = sum(r[p][c] for p in names for c in COLUMNS if c != "acts")
        per_mb_label, per_mb = self._kept_item(layers, "kept by the layers")
        last = layers[-1]
        # the last layer's backward starts by recomputing / restoring what it does not keep on the GPU
        plain = not (self.checkpointed(last) or self.offloaded(last))
        working = 0.0 if plain else self._layer_acts(last) - self.kept(last)[0]
        per_mb += r["embed"]["acts"] if first_stage else 0.0
        head = r["head"]["acts"] + r.get("mtp", {}).get("acts", 0.0) if last_stage else 0.0
        flying = self._in_flight(stage)
        tag = f" (stage {stage})" if s.pp > 1 else ""
        static_item = (f"static: bf16 params + grads, sharded master params/grads + Adam states{tag}", static)
        if s.lora_rank:
            static_item = (
                f"static: frozen weights, adapter params + grads, sharded masters + Adam states{tag}",
                static,
            )
        work_item = ("recompute / restore working set: the rest of one layer's activations", working)
        extra = self._offload_in_flight(layers) + self._dequant_item(layers)

        def phase(name: str, items: list[tuple[str, float]]) -> Phase:
            return Phase(name + tag, sum(v for _, v in items), items)

        first_acts = self._layer_acts(layers[0]) + (r["embed"]["acts"] if first_stage else 0.0)
        return {
            "micro1_forward_end": phase(
                "micro1_forward_end",
                [static_item, (f"activations of 1 micro-batch ({per_mb_label})", per_mb), work_item, ("head", head)]
                + extra,
            ),
            "micro1_backward_end": phase(
                "micro1_backward_end",
                [static_item, ("first layer activations", first_acts), *self._dequant_item(layers)],
            ),
            "microN_forward_end": phase(
                "microN_forward_end",
                [static_item, (f"activations of {flying:g} in-flight micro-batches", per_mb * flying), work_item]
                + [("head", head)]
                + extra,
            ),
        }


if __name__ == "__main__":
    raise SystemExit(main())
