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
derivation of every term is in ``docs/tools.md`` and ``xtl memory --measure`` checks it against autograd.

Example:
    >>> from xtl.tools.memory import TrainSetup, estimate_memory
    >>> est = estimate_memory("qwen3-8b", TrainSetup(seq_len=32768, chunk_loss=1024))
    >>> round(est.peak_mbn.bytes / 2**30, 1)
    30.8
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from huggingface_hub.errors import StrictDataclassError

from xtl.model import MODEL_TYPES, alias_names, get_model_config
from xtl.model.dims import ModelDims
from xtl.tools._cli import EXIT_CODES_HELP, EXIT_FAILED, EXIT_OK, ToolInputError, make_parser, run_cli

if TYPE_CHECKING:
    from xtl.model.dense.config import DenseConfig
    from xtl.tools._memory_measure import MeasureResult

GIB = 1024**3
COLUMNS = ("params", "grads", "opt_states", "master_params", "master_grads", "acts")
FP32 = 4
INDEX_BYTES = 8

EXAMPLES = """examples:
  xtl memory qwen3-8b --gpus-per-node 8 --seq-len 32768 --chunk-loss 1024          # FSDP, recompute, flash
  xtl memory qwen3-30b-a3b --nodes 4 --ep 8 --seq-len 8192
  xtl memory deepseek-v3 --nodes 128 --ep 64 --seq-len 4096
  xtl memory qwen3-32b --nodes 4 --zero 1 --tp 2 --pp 4 --vpp 2 --micro-batch-size 2
  xtl memory path/to/hf_model --no-recompute --format json
  xtl memory --measure                          # check the activation formula against autograd on this CPU

aliases: {aliases}
{exit_codes} (1: --measure disagreed beyond its tolerance)"""


@dataclass
class TrainSetup:
    """Parallel layout, sequence and memory-saving options of a training run.

    Args:
        nodes (int): Number of nodes.
        gpus_per_node (int): GPUs per node.
        tp (int): Tensor-parallel size (sequence parallel assumed for activations).
        pp (int): Pipeline-parallel size (ZeRO-1 only).
        vpp (int): Virtual pipeline stages per rank (interleaved 1F1B).
        ep (int): Expert-parallel size.
        zero (int): 1 (optimizer states sharded) or 3 (FSDP: parameters, gradients and states sharded).
        seq_len (int): Tokens per sequence.
        micro_batch_size (int): Sequences per micro-batch.
        recompute (bool): Full activation recomputation per decoder layer.
        flash_attn (bool): Flash attention (no O(L^2) probabilities kept).
        chunk_loss (int): Tokens per loss chunk (0: logits of the whole micro-batch at once).
        capacity (float): MoE capacity factor (1.0 = balanced routing).
        act_bytes (int): Activation dtype size.
        param_bytes (int): Compute parameter dtype size (bf16).
        grad_bytes (int): Compute gradient dtype size (bf16).
        master_bytes (int): Master parameter / gradient dtype size (fp32).
        optim_bytes (int): Size of one Adam moment element (fp32); two moments are kept.
    """

    nodes: int = 1
    gpus_per_node: int = 8
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    zero: int = 3
    seq_len: int = 4096
    micro_batch_size: int = 1
    recompute: bool = True
    flash_attn: bool = True
    chunk_loss: int = 0
    capacity: float = 1.0
    act_bytes: int = 2
    param_bytes: int = 2
    grad_bytes: int = 2
    master_bytes: int = 4
    optim_bytes: int = 4

    @property
    def gpus(self) -> int:
        """int: Total GPUs."""
        return self.nodes * self.gpus_per_node

    @property
    def dp(self) -> int:
        """int: Data-parallel size of the non-expert parameters."""
        return self.gpus // (self.tp * self.pp)

    @property
    def edp(self) -> int:
        """int: Data-parallel size of the routed experts."""
        return self.gpus // (self.ep * self.pp)


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

    def to_dict(self) -> dict:
        """Return a JSON-serializable dict (bytes plus GiB).

        Returns:
            dict: The estimate.
        """
        return {
            "model": self.model,
            "setup": asdict(self.setup) | {"dp": self.setup.dp, "edp": self.setup.edp, "gpus": self.setup.gpus},
            "params": self.params,
            "parts_bytes": self.parts,
            "phases": {
                p.name: {"bytes": p.bytes, "gib": p.bytes / GIB, "items": [[k, v] for k, v in p.items]}
                for p in self.phases.values()
            },
            "peak_micro_batch_1": {"phase": self.peak_mb1.name, "bytes": self.peak_mb1.bytes},
            "peak_micro_batch_n": {"phase": self.peak_mbn.name, "bytes": self.peak_mbn.bytes},
        }

    def render(self) -> str:
        """Return the human-readable report.

        Returns:
            str: Report text.
        """
        s, p = self.setup, self.params
        lines = [
            f"model {self.model}: zero {s.zero}, gpus {s.gpus}, dp {s.dp}, tp {s.tp}, pp {s.pp}, vpp {s.vpp}, "
            f"ep {s.ep}, micro-batch {s.micro_batch_size} x {s.seq_len} tokens, recompute {s.recompute}, "
            f"flash-attn {s.flash_attn}, chunk-loss {s.chunk_loss or 'off'}",
            "parameters: " + ", ".join(f"{k} {v / 1e9:.4f}B" for k, v in p.items()),
            f"peak, micro-batch 1:  {self.peak_mb1.bytes / GIB:.3f} GiB at {self.peak_mb1.name}",
            f"peak, micro-batch >1: {self.peak_mbn.bytes / GIB:.3f} GiB at {self.peak_mbn.name}",
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


def measure_activations(seq_len: int = 256, config: dict | None = None, seed: int = 0) -> MeasureResult:
    """Measure the activations autograd saves for a tiny dense model and compare them with this estimator.

    See :mod:`xtl.tools._memory_measure`.

    Args:
        seq_len (int): Tokens in the single sequence.
        config (dict | None): HF Qwen3 fields (defaults to a scaled-down Qwen3).
        seed (int): Seed for weights and tokens.

    Returns:
        MeasureResult: Measured and formula bytes.
    """
    from xtl.tools._memory_measure import compare_with_autograd

    return compare_with_autograd(_forward_activation_bytes, seq_len, config, seed)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``memory`` options to ``parser``.

    Args:
        parser (argparse.ArgumentParser): Parser.
    """
    d = TrainSetup()
    parser.add_argument("model", nargs="?", help="alias or path to config.json / HF model directory")
    parser.add_argument("--nodes", type=int, default=d.nodes)
    parser.add_argument("--gpus-per-node", type=int, default=d.gpus_per_node)
    parser.add_argument("--tp", type=int, default=d.tp, help="tensor parallel (sequence parallel activations)")
    parser.add_argument("--pp", type=int, default=d.pp, help="pipeline parallel, 1F1B (requires --zero 1)")
    parser.add_argument("--vpp", type=int, default=d.vpp, help="virtual pipeline stages per rank")
    parser.add_argument("--ep", type=int, default=d.ep, help="expert parallel")
    parser.add_argument("--zero", type=int, choices=(1, 3), default=d.zero, help="1: ZeRO-1, 3: FSDP (default)")
    parser.add_argument("--seq-len", type=int, help=f"tokens per sequence (default {d.seq_len}; 256 with --measure)")
    parser.add_argument("--micro-batch-size", type=int, default=d.micro_batch_size)
    parser.add_argument("--recompute", action=argparse.BooleanOptionalAction, default=d.recompute)
    parser.add_argument("--flash-attn", action=argparse.BooleanOptionalAction, default=d.flash_attn)
    parser.add_argument("--chunk-loss", type=int, default=d.chunk_loss, help="tokens per loss chunk, 0 = off")
    parser.add_argument("--capacity", type=float, default=d.capacity, help="MoE capacity factor")
    parser.add_argument("--act-bytes", type=int, default=d.act_bytes, help="activation dtype size")
    parser.add_argument("--format", choices=("text", "json"), default="text")
    parser.add_argument(
        "--measure", action="store_true", help="measure activations of a scaled-down dense model and compare"
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
    if not args.model:
        raise ToolInputError("give a model alias or config path (or --measure)")
    setup = TrainSetup(
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        tp=args.tp,
        pp=args.pp,
        vpp=args.vpp,
        ep=args.ep,
        zero=args.zero,
        seq_len=args.seq_len or TrainSetup.seq_len,
        micro_batch_size=args.micro_batch_size,
        recompute=args.recompute,
        flash_attn=args.flash_attn,
        chunk_loss=args.chunk_loss,
        capacity=args.capacity,
        act_bytes=args.act_bytes,
    )
    est = estimate_memory(args.model, setup)
    print(json.dumps(est.to_dict(), indent=2) if args.format == "json" else est.render())
    return EXIT_OK


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
    setup = TrainSetup(nodes=1, gpus_per_node=1, seq_len=seq_len, recompute=False, act_bytes=4)
    parts = estimate_memory(dims, setup).parts
    layer = parts["layer_attn"]["acts"] + parts["layer_mlp"]["acts"]
    return parts["embed"]["acts"] + parts["head"]["acts"] + layer * dims.num_layers


def _validate(dims: ModelDims, s: TrainSetup) -> None:
    problems = []
    if min(s.nodes, s.gpus_per_node, s.tp, s.pp, s.vpp, s.ep, s.seq_len, s.micro_batch_size) < 1:
        problems.append("sizes must be >= 1")
    elif s.gpus % (s.tp * s.pp) or s.gpus % (s.ep * s.pp):
        problems.append(f"{s.gpus} GPUs are not divisible by tp*pp={s.tp * s.pp} and ep*pp={s.ep * s.pp}")
    elif s.zero == 3 and s.pp > 1:
        problems.append("pipeline parallelism is modelled with --zero 1 (Megatron-style), not with FSDP")
    elif dims.num_layers % s.pp or (dims.num_layers // s.pp) % s.vpp:
        problems.append(f"{dims.num_layers} layers do not split into pp={s.pp} x vpp={s.vpp} stages")
    elif s.ep > 1 and (not dims.is_moe or dims.num_experts % s.ep):
        problems.append(f"ep={s.ep} needs an MoE model whose expert count ({dims.num_experts}) it divides")
    elif dims.num_kv_heads % s.tp and not dims.is_mla:
        problems.append(f"tp={s.tp} does not divide {dims.num_kv_heads} key/value heads")
    if problems:
        raise ToolInputError("; ".join(problems))


class _Estimator:
    def __init__(self, dims: ModelDims, setup: TrainSetup) -> None:
        self.d, self.s = dims, setup
        self.tokens = setup.micro_batch_size * setup.seq_len / setup.tp  # per GPU, sequence parallel
        self.local_layers = dims.num_layers // setup.pp
        # xtl's expert-parallel layout: dense parameters are sharded over all data-parallel ranks, routed experts
        # over the expert-data-parallel ranks (edp) after being split over ep
        self.shard = setup.dp
        self.expert_shard = setup.edp

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
            params=self.d.parameter_counts(),
            parts=self._parts(0 if self.s.pp == 1 else self.s.pp - 1),
            phases=phases,
            peak_mb1=mb1,
            peak_mbn=mbn,
        )

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

    def _layer_counts(self, layer: int) -> tuple[float, float, float]:
        """(attention, non-expert mlp, routed experts) local parameter counts of one layer."""
        d, s = self.d, self.s
        experts = d.expert_params(layer)
        return d.attention_params() / s.tp, (d.mlp_params(layer) - experts) / s.tp, experts / s.ep

    def _layer_part(self, layer: int, which: str) -> dict[str, float]:
        attn, mlp, experts = self._layer_counts(layer)
        if which == "attn":
            part = self._full(attn) | self._states(attn, 0)
            act = self._attn_act_bytes() * self.tokens
        else:
            part = self._full(mlp + experts) | self._states(mlp, experts)
            act = self._mlp_act_bytes(layer) * self.tokens
        return part | {"acts": act}

    def _layer_acts(self, layer: int) -> float:
        return self._layer_part(layer, "attn")["acts"] + self._layer_part(layer, "mlp")["acts"]

    def _embed_part(self) -> dict[str, float]:
        count = self.d.embedding_params() / self.s.tp
        return self._full(count) | self._states(count, 0) | {"acts": self.tokens * INDEX_BYTES}

    def _head_part(self) -> dict[str, float]:
        d, s = self.d, self.s
        count = d.head_params() / s.tp
        loss_tokens = s.micro_batch_size * s.seq_len
        if s.chunk_loss > 0:
            loss_tokens = min(loss_tokens, s.chunk_loss)
        acts = (2 * d.hidden_size * s.act_bytes + FP32) * self.tokens  # final norm input and output, rstd
        acts += loss_tokens * d.vocab_size * FP32 / s.tp  # fp32 log-probabilities kept by the cross-entropy
        part = self._full(count) | self._states(count, 0) | {"acts": acts}
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
            "acts": self.tokens * self.d.hidden_size * self.s.act_bytes
        }
        return rows

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
            return norm + lora + core + lse
        qd, kd = a * d.head_dim, d.num_kv_heads * d.head_dim
        qk_norm = ((qd + kd) * act + (a + d.num_kv_heads) * FP32) if d.qk_norm else 0
        core = (qd + kd + kd + qd) * act  # q and k after RoPE, v, output (o_proj input)
        return norm + qk_norm + core + lse

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

    # ---- phases ------------------------------------------------------------------------------------------------
    def _phases(self, stage: int) -> dict[str, Phase]:
        return self._zero3_phases() if self.s.zero == 3 else self._zero1_phases(stage)

    def _zero3_phases(self) -> dict[str, Phase]:
        r = self._parts(0)
        n, layers = self.local_layers, self._stage_layers(0)
        sharded = ("embed", "head", "all_attn", "all_mlp")
        static = sum(r[p]["master_params"] + r[p]["opt_states"] for p in sharded)
        static_grad = sum(r[p]["master_grads"] for p in sharded)
        last = r["layer_attn"]["params"] + r["layer_mlp"]["params"] + r["layer_attn"]["acts"] + r["layer_mlp"]["acts"]
        if self.s.recompute:
            rest_label, rest = f"checkpoints: layer inputs x {n - 1}", r["layer_input_ckpt"]["acts"] * (n - 1)
        else:
            rest_label, rest = (
                f"activations of the other {n - 1} layers",
                sum(self._layer_acts(i) for i in layers[:-1]),
            )
        fwd = [
            ("static: master params + Adam states (sharded)", static),
            ("gathered last layer: bf16 params + activations", last),
            ("gathered head: bf16 params + activations + loss logits", r["head"]["params"] + r["head"]["acts"]),
            ("embedding activations (token ids)", r["embed"]["acts"]),
            (rest_label, rest),
        ]
        first_mlp = r.get("first_layer_mlp", r["layer_mlp"])
        first = r["layer_attn"]["params"] + first_mlp["params"] + r["layer_attn"]["acts"] + first_mlp["acts"]
        prev_grads = r["layer_attn"]["grads"] + self._layer_part(layers[1], "mlp")["grads"] if n > 1 else 0.0
        bwd = [
            ("static: master params + Adam states (sharded)", static),
            ("static: master grads (sharded)", static_grad),
            ("gathered first layer: bf16 params + activations", first),
            ("gathered embedding: bf16 params + activations", r["embed"]["params"] + r["embed"]["acts"]),
            ("previous layer bf16 grads being reduce-scattered", prev_grads),
        ]
        fwd2 = fwd[:1] + [("static: master grads (sharded)", static_grad)] + fwd[1:]
        return {
            "micro1_forward_end": Phase("micro1_forward_end", sum(v for _, v in fwd), fwd),
            "micro1_backward_end": Phase("micro1_backward_end", sum(v for _, v in bwd), bwd),
            "microN_forward_end": Phase("microN_forward_end", sum(v for _, v in fwd2), fwd2),
        }

    def _zero1_phases(self, stage: int) -> dict[str, Phase]:
        s, r = self.s, self._parts(stage)
        layers = self._stage_layers(stage)
        first_stage, last_stage = stage == 0, stage == s.pp - 1
        names = ["all_attn", "all_mlp"] + (["embed"] if first_stage else []) + (["head"] if last_stage else [])
        static = sum(r[p][c] for p in names for c in COLUMNS if c != "acts")
        if s.recompute:
            per_mb = r["layer_input_ckpt"]["acts"] * len(layers)
            working = self._layer_acts(layers[-1])
        else:
            per_mb, working = sum(self._layer_acts(i) for i in layers), 0.0
        per_mb += r["embed"]["acts"] if first_stage else 0.0
        head = r["head"]["acts"] if last_stage else 0.0
        flying = float(s.pp - stage)
        if s.vpp > 1:
            flying *= 1 + (s.pp - 1) / (s.pp * s.vpp)
        tag = f" (stage {stage})" if s.pp > 1 else ""
        static_item = (f"static: bf16 params + grads, sharded master params/grads + Adam states{tag}", static)
        work_item = ("recompute working set: one layer's activations", working)

        def phase(name: str, items: list[tuple[str, float]]) -> Phase:
            return Phase(name + tag, sum(v for _, v in items), items)

        first_acts = self._layer_acts(layers[0]) + (r["embed"]["acts"] if first_stage else 0.0)
        return {
            "micro1_forward_end": phase(
                "micro1_forward_end",
                [static_item, ("activations of 1 micro-batch", per_mb), work_item, ("head", head)],
            ),
            "micro1_backward_end": phase(
                "micro1_backward_end", [static_item, ("first layer activations", first_acts)]
            ),
            "microN_forward_end": phase(
                "microN_forward_end",
                [static_item, (f"activations of {flying:g} in-flight micro-batches", per_mb * flying), work_item]
                + [("head", head)],
            ),
        }


if __name__ == "__main__":
    raise SystemExit(main())
