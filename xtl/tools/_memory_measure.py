"""``xtl memory --measure``: check the activation formula against autograd on a scaled-down dense model.

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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

TOLERANCE = 0.03


@dataclass
class MeasureResult:
    """Measured vs estimated activation bytes of one forward pass."""

    config: dict
    measured_bytes: int
    formula_bytes: float
    stock_hf_bytes: int
    max_grad_diff: float
    tolerance: float = TOLERANCE

    @property
    def ratio(self) -> float:
        """float: measured / formula."""
        return self.measured_bytes / self.formula_bytes

    @property
    def ok(self) -> bool:
        """bool: Within tolerance and the fused-style model matches the stock model."""
        return abs(self.ratio - 1) <= self.tolerance and self.max_grad_diff < 1e-4

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
            "ok": self.ok,
        }

    def render(self) -> str:
        """Return a human-readable report.

        Returns:
            str: Report text.
        """
        return (
            f"scaled-down dense model: {self.config}\n"
            f"measured activations (fused RMSNorm/SwiGLU, SDPA): {self.measured_bytes} bytes\n"
            f"estimator formula:                                 {self.formula_bytes:.0f} bytes\n"
            f"ratio measured/formula: {self.ratio:.4f} (tolerance +-{self.tolerance:.0%}) -> "
            f"{'OK' if self.ok else 'OUT OF TOLERANCE'}\n"
            f"stock transformers model (eager RMSNorm/SiLU keep extra copies): {self.stock_hf_bytes} bytes\n"
            f"max |grad difference| fused-style vs stock: {self.max_grad_diff:.2e}"
        )


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
    for module in model.modules():
        name = type(module).__name__
        if name.endswith("RMSNorm"):
            eps = module.variance_epsilon
            module.forward = lambda x, m=module, e=eps: _RMSNormFn.apply(x, m.weight, e)
        elif name.endswith("MLP"):
            module.forward = lambda x, m=module: m.down_proj(_SwiGLUFn.apply(m.gate_proj(x), m.up_proj(x)))
