"""``xtl memory --measure``: check the activation formulas against autograd on scaled-down dense models.

**Formula check.**
A tiny Qwen3 model is built with ``transformers`` (SDPA attention, which on CPU runs the flash kernel keeping q, k,
v, the output and the log-sum-exp), its RMSNorms and SwiGLU are routed through fused-style autograd functions (the
kernels the estimator assumes: RMSNorm keeps input + fp32 rstd, SwiGLU keeps gate + up), and one forward runs under
``torch.autograd.graph.saved_tensors_hooks``. The measured activation memory is the total size of the distinct
storages autograd saved, parameters excluded. It is compared with the estimator's formula for the same config
without recomputation (fp32), which the caller passes in (``xtl.tools.memory.measure_activations`` passes
``xtl memory``'s). A backward pass checks that the fused-style model computes the same loss and gradients as the
stock transformers model.

Tolerance: ``|measured / formula - 1| <= 3%``. What the formula leaves out is RoPE's cos/sin tables (shared by all
layers) and the label tensors of the loss, about 1% at the default size.

**Memory modes** (:func:`compare_modes`). For each mode of :data:`MODES` (no recompute, full, selective, full on
every 2nd layer, offload, full + offload) an xtl dense model (the same scaled-down Qwen3, SDPA) is built on meta,
transformed by the real ``ActivationCheckpointing`` / ``ActivationOffload`` callbacks (``transform_model``, as
``xtl fit`` applies them), materialized and initialized; its RMSNorms and SwiGLU go through the same fused-style
functions. One forward on a single sequence runs under a dispatch mode that records every storage an op creates;
at its end, the storages still alive (what autograd, checkpoint inputs and selective-checkpoint caches hold),
parameters excluded, are the GPU bytes, less the offload callback's host copies (``stats.held_bytes``: on CPU they
share the memory, on a GPU they would be in host memory), which are the host bytes. The model is measured with 4
and with 2 decoder layers and the difference halved, so the embedding, head, loss and RoPE tables cancel: the
result is what one decoder layer keeps, compared with the estimator's figure for the same two layers (the caller
passes it in). Backward then runs, and the gradients must equal those of the model without recompute or offload.

Tolerance per mode: ``|measured - estimate| <= 2%`` of the estimate, or of a layer's activations without recompute
where the estimate is 0 (the GPU bytes of offloaded layers); gradients equal to mode ``none`` within 1e-6.

**LoRA modes** (:data:`LORA_MODES`): the same measurement with the real ``LoRA`` callback applied first (frozen base
weights, rank-8 adapters on q/k/v/o and gate/up/down), without recompute, selective and full; the adapters'
gradients must be equal across the three.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

TOLERANCE = 0.03
MODE_TOLERANCE = 0.02
GRAD_TOLERANCE = 1e-6
MODES: dict[str, dict[str, Any]] = {
    "none": {"recompute": "none"},
    "full": {"recompute": "full"},
    "selective": {"recompute": "selective"},
    "full every 2": {"recompute": "full", "recompute_every_n_layers": 2},
    "offload": {"recompute": "none", "offload": True},
    "full+offload": {"recompute": "full", "offload": True},
}
"""Memory modes of :func:`compare_modes`, as ``TrainSetup`` fields (``recompute``, ``recompute_every_n_layers``,
``offload``, ``offload_every_n_layers``)."""
CP_MODES: dict[str, dict[str, Any]] = {
    "cp 2": {"recompute": "none", "cp": 2},
    "cp 2 full": {"recompute": "full", "cp": 2},
}
"""Context-parallel modes of :func:`compare_context_parallel` (2 gloo processes, Ulysses attention; gradients, summed
over the ranks, are compared with the whole sequence's on one process)."""
LORA_MODES: dict[str, dict[str, Any]] = {
    "lora": {"recompute": "none", "lora_rank": 8},
    "lora selective": {"recompute": "selective", "lora_rank": 8},
    "lora full": {"recompute": "full", "lora_rank": 8},
}
"""LoRA modes of :func:`compare_modes` (the ``LoRA`` callback with its default targets, rank 8; gradients are
compared with mode ``lora``)."""


@dataclass
class ModeResult:
    """What one decoder layer keeps for backward in one memory mode: measured vs estimated bytes (one sequence).

    Attributes:
        mode: Name of the mode (a key of :data:`MODES`).
        options: Its ``TrainSetup`` fields.
        gpu_measured: Bytes a layer keeps on the device (measured).
        gpu_estimate: The estimator's figure.
        host_measured: Bytes a layer keeps in host memory (offload; measured).
        host_estimate: The estimator's figure.
        reference: The estimator's bytes of a layer without recompute or offload (scale of a check whose estimate
            is 0).
        max_grad_diff: Largest gradient difference to mode ``none``.
        tolerance: Relative tolerance of both checks.
    """

    mode: str
    options: dict[str, Any]
    gpu_measured: float
    gpu_estimate: float
    host_measured: float
    host_estimate: float
    reference: float
    max_grad_diff: float
    tolerance: float = MODE_TOLERANCE

    @property
    def gpu_ratio(self) -> float | None:
        """float | None: measured / estimate on the device (``None`` where the estimate is 0)."""
        return self.gpu_measured / self.gpu_estimate if self.gpu_estimate else None

    @property
    def host_ratio(self) -> float | None:
        """float | None: measured / estimate in host memory (``None`` where the estimate is 0)."""
        return self.host_measured / self.host_estimate if self.host_estimate else None

    @property
    def ok(self) -> bool:
        """bool: Both checks within tolerance and gradients equal to mode ``none``."""
        return (
            self._close(self.gpu_measured, self.gpu_estimate)
            and self._close(self.host_measured, self.host_estimate)
            and self.max_grad_diff <= GRAD_TOLERANCE
        )

    def to_dict(self) -> dict:
        """Return a JSON-serializable dict.

        Returns:
            dict: The result.
        """
        return asdict(self) | {"gpu_ratio": self.gpu_ratio, "host_ratio": self.host_ratio, "ok": self.ok}

    def _close(self, measured: float, estimate: float) -> bool:
        return abs(measured - estimate) <= self.tolerance * (estimate or self.reference)


@dataclass
class MeasureResult:
    """Measured vs estimated activation bytes of one forward pass, and per memory mode (:class:`ModeResult`)."""

    config: dict
    measured_bytes: int
    formula_bytes: float
    stock_hf_bytes: int
    max_grad_diff: float
    tolerance: float = TOLERANCE
    modes: list[ModeResult] = field(default_factory=list)
    lora_modes: list[ModeResult] = field(default_factory=list)
    cp_modes: list[ModeResult] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        """float: measured / formula."""
        return self.measured_bytes / self.formula_bytes

    @property
    def formula_ok(self) -> bool:
        """bool: The formula check is within tolerance and the fused-style model matches the stock model."""
        return abs(self.ratio - 1) <= self.tolerance and self.max_grad_diff < 1e-4

    @property
    def ok(self) -> bool:
        """bool: The formula check and every memory mode (LoRA modes included) are within tolerance."""
        return self.formula_ok and all(mode.ok for mode in self.modes + self.lora_modes + self.cp_modes)

    def to_dict(self) -> dict:
        """Return a JSON-serializable dict.

        Returns:
            dict: The result.
        """
        return {
            "config": self.config,
            "measured_bytes": self.measured_bytes,
            "formula_bytes": self.formula_bytes,
            "ratio": self.ratio,
            "tolerance": self.tolerance,
            "stock_transformers_bytes": self.stock_hf_bytes,
            "max_grad_diff_vs_stock": self.max_grad_diff,
            "formula_ok": self.formula_ok,
            "modes": [mode.to_dict() for mode in self.modes],
            "lora_modes": [mode.to_dict() for mode in self.lora_modes],
            "cp_modes": [mode.to_dict() for mode in self.cp_modes],
            "ok": self.ok,
        }

    def render(self) -> str:
        """Return a human-readable report.

        Returns:
            str: Report text.
        """
        text = (
            f"scaled-down dense model: {self.config}\n"
            f"measured activations (fused RMSNorm/SwiGLU, SDPA): {self.measured_bytes} bytes\n"
            f"estimator formula:                                 {self.formula_bytes:.0f} bytes\n"
            f"ratio measured/formula: {self.ratio:.4f} (tolerance +-{self.tolerance:.0%}) -> "
            f"{'OK' if self.formula_ok else 'OUT OF TOLERANCE'}\n"
            f"stock transformers model (eager RMSNorm/SiLU keep extra copies): {self.stock_hf_bytes} bytes\n"
            f"max |grad difference| fused-style vs stock: {self.max_grad_diff:.2e}"
        )
        if self.modes:
            text += "\n\n" + _modes_table(self.modes, self.config["seq_len"])
        if self.lora_modes:
            text += "\n\n" + _modes_table(
                self.lora_modes, self.config["seq_len"], "LoRA rank 8 on q/k/v/o/gate/up/down"
            )
        if self.cp_modes:
            what = "context parallelism 2 (rank 0 of 2 gloo processes, Ulysses; gradients summed over the ranks)"
            whole = "the whole sequence's on one process"
            text += "\n\n" + _modes_table(self.cp_modes, self.config["seq_len"], what, whole)
        return text


def tiny_dense_config() -> dict:
    """HF fields of the scaled-down Qwen3-like model used by :func:`compare_with_autograd`.

    Returns:
        dict: HF ``Qwen3Config`` fields.
    """
    return {
        "model_type": "qwen3", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 192,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "tie_word_embeddings": False, "attention_bias": False,
    }  # fmt: skip


def compare_with_autograd(
    formula: Callable[[dict, int], float], seq_len: int = 256, config: dict | None = None, seed: int = 0
) -> MeasureResult:
    """Measure saved-activation bytes of a tiny transformers Qwen3 and compare them with ``formula``.

    Args:
        formula (Callable[[dict, int], float]): Estimated fp32 activation bytes of one forward without
            recomputation, from the HF config fields and the sequence length.
        seq_len (int): Tokens in the single sequence.
        config (dict | None): HF Qwen3 fields (defaults to :func:`tiny_dense_config`).
        seed (int): Seed for weights and tokens.

    Returns:
        MeasureResult: Measured and formula bytes.
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM

    fields = dict(config or tiny_dense_config())
    hf_kwargs = {k: v for k, v in fields.items() if k != "model_type"}
    torch.manual_seed(seed)
    stock = Qwen3ForCausalLM(Qwen3Config(**hf_kwargs, attn_implementation="sdpa")).float().eval()
    fused = Qwen3ForCausalLM(Qwen3Config(**hf_kwargs, attn_implementation="sdpa")).float().eval()
    fused.load_state_dict(stock.state_dict())
    _install_fused_ops(fused)
    ids = torch.randint(0, fields["vocab_size"], (1, seq_len))

    measured, fused_loss = _saved_bytes(fused, ids)
    stock_bytes, stock_loss = _saved_bytes(stock, ids)
    fused_loss.backward()
    stock_loss.backward()
    grad_diff = max(
        float((a.grad - b.grad).abs().max()) for a, b in zip(fused.parameters(), stock.parameters(), strict=True)
    )
    grad_diff = max(grad_diff, abs(float(fused_loss.detach() - stock_loss.detach())))
    estimate = formula(fields, seq_len)
    return MeasureResult(fields | {"seq_len": seq_len}, measured, estimate, stock_bytes, grad_diff)


def tiny_xtl_fields(num_layers: int) -> dict:
    """Fields of the xtl dense model :func:`compare_modes` builds: :func:`tiny_dense_config` as an xtl config.

    Args:
        num_layers (int): Decoder layers.

    Returns:
        dict: ``model_type`` plus xtl config fields (a recipe's ``model.init_args.model`` dict).
    """
    fields = {k: v for k, v in tiny_dense_config().items() if k != "attention_bias"}
    return fields | {"num_hidden_layers": num_layers, "attn_impl": "sdpa"}


def compare_modes(
    estimate: Callable[[dict, int, dict], tuple[float, float]],
    seq_len: int = 256,
    seed: int = 0,
    modes: dict[str, dict[str, Any]] | None = None,
) -> list[ModeResult]:
    """Measure what one decoder layer keeps for backward in each memory mode and compare with ``estimate``.

    Args:
        estimate (Callable[[dict, int, dict], tuple[float, float]]): ``(GPU, host)`` bytes all decoder layers of
            the model keep at the end of an fp32 forward, from the xtl fields (:func:`tiny_xtl_fields`), the
            sequence length and the mode's ``TrainSetup`` fields.
        seq_len (int): Tokens in the single sequence.
        seed (int): Seed for weights and tokens.
        modes (dict[str, dict[str, Any]] | None): The modes (default :data:`MODES`); the first is the reference of
            the gradients and of a zero estimate.

    Returns:
        list[ModeResult]: One per mode, in order.
    """
    deep, shallow = tiny_xtl_fields(4), tiny_xtl_fields(2)
    reference_grads: list[torch.Tensor] | None = None
    reference = 0.0
    results = []
    for mode, options in (MODES if modes is None else modes).items():
        gpu4, host4, grads = _kept_by_layers(deep, options, seq_len, seed)
        gpu2, host2, _ = _kept_by_layers(shallow, options, seq_len, seed)
        est4, est2 = estimate(deep, seq_len, options), estimate(shallow, seq_len, options)
        if reference_grads is None:  # the reference mode ("none") comes first
            reference_grads, reference = grads, (est4[0] - est2[0]) / 2
        grad_diff = max(float((a - b).abs().max()) for a, b in zip(grads, reference_grads, strict=True))
        results.append(
            ModeResult(
                mode=mode,
                options=dict(options),
                gpu_measured=(gpu4 - gpu2) / 2,
                gpu_estimate=(est4[0] - est2[0]) / 2,
                host_measured=(host4 - host2) / 2,
                host_estimate=(est4[1] - est2[1]) / 2,
                reference=reference,
                max_grad_diff=grad_diff,
            )
        )
    return results


def compare_context_parallel(
    estimate: Callable[[dict, int, dict], tuple[float, float]], seq_len: int = 256, seed: int = 0
) -> list[ModeResult]:
    """What one decoder layer keeps on rank 0 of a context-parallel pair, against ``estimate`` (:data:`CP_MODES`).

    One spawn of 2 gloo processes trains the models of :func:`compare_modes` on the halves of one sequence
    (:func:`xtl.data.collate.split_for_context_parallel`, attention through Ulysses); the gradients, summed over
    the ranks, must equal the whole sequence's on one process.

    Args:
        estimate (Callable[[dict, int, dict], tuple[float, float]]): As for :func:`compare_modes` (the mode's
            fields include ``cp``).
        seq_len (int): Tokens in the sequence (even).
        seed (int): Seed for weights and tokens.

    Returns:
        list[ModeResult]: One per mode, in order.
    """
    import tempfile
    from pathlib import Path

    import torch.multiprocessing as mp

    deep, shallow = tiny_xtl_fields(4), tiny_xtl_fields(2)
    _, _, whole_grads = _kept_by_layers(deep, {"recompute": "none"}, seq_len, seed)
    reference = estimate(deep, seq_len, {"recompute": "none"})[0] / 4
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cp.pt"
        mp.spawn(_cp_worker, args=(_free_port(), str(out), seq_len, seed), nprocs=2, join=True)
        measured = torch.load(out)
    results = []
    for mode, options in CP_MODES.items():
        (gpu4, grads), gpu2 = measured[mode]
        est4, est2 = estimate(deep, seq_len, options), estimate(shallow, seq_len, options)
        grad_diff = max(float((a - b).abs().max()) for a, b in zip(grads, whole_grads, strict=True))
        results.append(
            ModeResult(mode, dict(options), (gpu4 - gpu2) / 2, (est4[0] - est2[0]) / 2, 0.0, 0.0, reference, grad_diff)
        )
    return results


def _cp_worker(rank: int, port: int, out: str, seq_len: int, seed: int) -> None:
    """One rank of :func:`compare_context_parallel`: per mode, (bytes, summed gradients) of the 4-layer model and the
    bytes of the 2-layer one; rank 0 saves them to ``out``."""
    import os

    import torch.distributed as dist

    from xtl.data import Pack, collate_pack
    from xtl.data.collate import split_for_context_parallel
    from xtl.strategies.layout import ParallelLayout

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    layout = ParallelLayout(cp=2)
    dist.init_process_group("gloo", rank=rank, world_size=layout.world_size)
    meshes = layout.build("cpu")
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, tiny_dense_config()["vocab_size"], (seq_len,), generator=generator).numpy()
    pack = collate_pack(Pack(0, ids, ids.copy(), [seq_len]))
    share = split_for_context_parallel(pack, layout.context_rank(rank), layout.cp)
    results = {}
    for mode, options in CP_MODES.items():
        kept = []
        for fields in (tiny_xtl_fields(4), tiny_xtl_fields(2)):
            model, _ = _build_xtl(fields, options, seed)
            for module in model.attention_modules():
                module.use_context_parallel(meshes.cp_group())
            params = {p.untyped_storage()._cdata for p in model.parameters()}
            created = CreatedStorages()
            with created:
                out_ = model(seq_ctx=share.seq_ctx, labels=share.labels, return_logits=False)
            gpu = created.settled_alive_bytes(params)  # gloo's worker threads drop their buffers late
            (out_.loss_sum / (seq_len - 1)).backward()  # the mean over the whole sequence's targets
            grads = [p.grad.detach().clone() for p in model.parameters()]
            for grad in grads:  # the shares' gradients sum over the data group
                dist.all_reduce(grad, group=meshes.data_group())
            kept.append((gpu, grads))
        results[mode] = (kept[0], kept[1][0])
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _saved_bytes(model: torch.nn.Module, ids: torch.Tensor) -> tuple[int, torch.Tensor]:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    return sum(seen.values()), loss


class _RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # noqa: ANN001
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (x.float() * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # noqa: ANN001
        x, weight, rstd = ctx.saved_tensors
        xhat = x.float() * rstd
        grad_w = (grad.float() * xhat).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        g = grad.float() * weight.float()
        grad_x = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_w, None


class _SwiGLUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(gate, up)
        return torch.nn.functional.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
        gate, up = ctx.saved_tensors
        sig = torch.sigmoid(gate)
        silu = gate * sig
        return grad * up * sig * (1 + gate * (1 - sig)), grad * silu


def _install_fused_ops(model: torch.nn.Module) -> None:
    """Route the norms and gated MLPs of an xtl model or of transformers' Qwen3 through the autograd functions
    above."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm

    from xtl.module.mlp import GatedMLP
    from xtl.module.norm import RMSNorm

    for module in model.modules():
        if isinstance(module, (RMSNorm, Qwen3RMSNorm)):
            eps = module.eps if isinstance(module, RMSNorm) else module.variance_epsilon
            module.forward = functools.partial(_rms_norm, module, eps)
        elif isinstance(module, (GatedMLP, Qwen3MLP)):
            module.forward = lambda x, m=module: m.down_proj(_SwiGLUFn.apply(*_gate_up(m, x)))


def _rms_norm(
    norm: torch.nn.Module, eps: float, x: torch.Tensor, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """A norm's forward through :class:`_RMSNormFn`; with ``residual`` (an xtl decoder layer's add + norm call),
    ``(normed, residual + x)``."""
    if residual is None:
        return _RMSNormFn.apply(x, norm.weight, eps)
    summed = residual + x
    return _RMSNormFn.apply(summed, norm.weight, eps), summed


def _gate_up(mlp: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up projections of an xtl (maybe fused) or HF MLP."""
    from xtl.module.mlp import GatedMLP

    if isinstance(mlp, GatedMLP):
        return mlp.project_gate_up(x)
    return mlp.gate_proj(x), mlp.up_proj(x)


class CreatedStorages(TorchDispatchMode):
    """Weak references to the storages of every tensor an op creates while active."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                self.storages.setdefault(storage._cdata, (StorageWeakRef(storage), storage.nbytes()))
        return out

    def alive_bytes(self, exclude: set[int]) -> int:
        """Bytes of the recorded storages still alive, except those in ``exclude`` (``_cdata`` keys)."""
        return sum(size for key, (ref, size) in self.storages.items() if not ref.expired() and key not in exclude)

    def settled_alive_bytes(self, exclude: set[int], interval_s: float = 0.02, limit_s: float = 5.0) -> int:
        """:meth:`alive_bytes` once it holds still for three reads ``interval_s`` apart (at most ``limit_s``).

        A collective's work object keeps its tensors until the process group's worker thread lets go of it, which
        can come after ``wait()`` returns; under load that is late enough to count a layer's buffers twice.
        """
        import gc
        import time

        deadline = time.monotonic() + limit_s
        reads = [-1]
        while time.monotonic() < deadline:
            gc.collect()
            reads.append(self.alive_bytes(exclude))
            if len(reads) >= 4 and reads[-1] == reads[-2] == reads[-3]:
                break
            time.sleep(interval_s)
        return reads[-1]


def _build_xtl(fields: dict, options: dict[str, Any], seed: int) -> tuple[torch.nn.Module, list[Any]]:
    """The xtl model of ``fields`` with the callbacks of a memory mode applied as ``xtl fit`` applies them."""
    from xtl.callbacks import ActivationCheckpointing, ActivationOffload, LoRA
    from xtl.model import MODEL_TYPES

    callbacks: list[Any] = [LoRA(rank=options["lora_rank"])] if options.get("lora_rank") else []
    if options.get("recompute", "none") != "none":
        every = options.get("recompute_every_n_layers", 1)
        callbacks.append(ActivationCheckpointing(mode=options["recompute"], every_n_layers=every))
    if options.get("offload"):
        every = options.get("offload_every_n_layers", 1)
        callbacks.append(ActivationOffload(every_n_layers=every, pin_memory=False))
    config_fields = dict(fields)
    config = MODEL_TYPES[config_fields.pop("model_type")](**config_fields)
    with torch.device("meta"):
        model = config.build()
    for callback in sorted(callbacks, key=lambda c: c.transform_stage):  # stable: callback order per stage
        model = callback.transform_model(model)
    model.materialize("cpu")
    torch.manual_seed(seed)
    model.init_weights()
    _install_fused_ops(model)
    return model.float().train(), callbacks


def _kept_by_layers(
    fields: dict, options: dict[str, Any], seq_len: int, seed: int
) -> tuple[int, int, list[torch.Tensor]]:
    """(GPU bytes, host bytes) alive at the end of one forward of the mode's model, and its gradients."""
    from xtl.callbacks import ActivationOffload

    model, callbacks = _build_xtl(fields, options, seed)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, fields["vocab_size"], (1, seq_len), generator=generator)
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    created = CreatedStorages()
    with created:
        loss = model(input_ids=ids, labels=ids, return_logits=False).loss
    host = sum(c.stats.held_bytes for c in callbacks if isinstance(c, ActivationOffload))
    gpu = created.alive_bytes(params) - host
    loss.backward()
    return gpu, host, [p.grad.detach().clone() for p in model.parameters() if p.requires_grad]


def _modes_table(modes: list[ModeResult], seq_len: int, what: str = "", grads_against: str | None = None) -> str:
    def ratio(value: float | None) -> str:
        return "-" if value is None else f"{value:.4f}"

    fields = tiny_xtl_fields(4)
    title = f"memory modes with {what}" if what else "memory modes"
    lines = [
        f"{title}: bytes one decoder layer keeps for backward, {seq_len} tokens, fp32 (xtl {fields['model_type']}"
        f" h {fields['hidden_size']}, I {fields['intermediate_size']}, {fields['num_attention_heads']} heads, "
        f"{fields['num_key_value_heads']} KV heads; real callbacks; 4-layer minus 2-layer model, halved)",
        f"tolerance per mode: |measured - estimate| <= {MODE_TOLERANCE:.0%} of the estimate (of the no-recompute "
        f"layer, {modes[0].reference:.0f} bytes, where the estimate is 0); gradients equal to "
        f"{grads_against or 'mode ' + modes[0].mode} within {GRAD_TOLERANCE:g}",
        f"{'mode':<14}{'GPU est':>10}{'measured':>10}{'ratio':>8}{'host est':>10}{'measured':>10}{'ratio':>8}"
        f"{'tol':>6}{'grad diff':>11}  result",
    ]
    for m in modes:
        lines.append(
            f"{m.mode:<14}{m.gpu_estimate:>10.0f}{m.gpu_measured:>10.0f}{ratio(m.gpu_ratio):>8}"
            f"{m.host_estimate:>10.0f}{m.host_measured:>10.0f}{ratio(m.host_ratio):>8}{m.tolerance:>6.0%}"
            f"{m.max_grad_diff:>11.1e}  {'OK' if m.ok else 'OUT OF TOLERANCE'}"
        )
    return "\n".join(lines)
