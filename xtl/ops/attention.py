"""Attention implementations behind one selector.

Every implementation takes ``q (B, H, T, D)``, ``k``/``v`` ``(B, Hkv, S, D)`` and an :class:`AttentionMaskSpec`
describing which keys each query may see, and returns ``(B, T, H, D)``. ``S`` is ``T``, or more when the keys
include cached ones (decoding with a KV cache): the queries are then the last ``T`` keys.

- ``eager``: bitwise equal to transformers' ``eager_attention_forward`` (fp32 softmax, same op order).
- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention``; packed batches run per document (CPU default).
- ``flash``: flash-attn varlen kernels (GPU, when ``flash_attn`` is importable).

``XTL_HF_IMPL=1`` makes :func:`get_attn_impl_fn` return ``eager`` whatever was asked.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from xtl.ops.selector import hf_impl_enabled

ATTN_IMPLS = ("auto", "eager", "sdpa", "flash")


@dataclass
class AttentionMaskSpec:
    """Which keys a query may attend to, independent of any implementation.

    Attributes:
        cu_seq_lens: Packed-document boundaries (batch of 1); ``None`` for an ordinary ``(B, T)`` batch.
        max_seq_len: Longest document of a packed batch.
        padding_mask: ``(B, S)`` over the keys with 1 for real tokens, 0 for padding (ordinary batches only).
        sliding_window: Keys further than ``sliding_window - 1`` positions back are hidden.
        doc_bounds: ``cu_seq_lens`` as Python ints, read once per forward (not once per layer: on GPU each read
            is a device-to-host sync).

    With ``S`` keys for ``T < S`` queries (cached keys, :class:`xtl.module.kv_cache.KVCache`) the queries are the
    last ``T`` keys, and the masks are built once per forward and shared by its layers.
    """

    cu_seq_lens: torch.Tensor | None = None
    max_seq_len: int | None = None
    padding_mask: torch.Tensor | None = None
    sliding_window: int | None = None
    doc_bounds: list[int] | None = None
    built: dict[tuple, torch.Tensor] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.cu_seq_lens is not None and self.doc_bounds is None:
            self.doc_bounds = self.cu_seq_lens.tolist()

    def with_window(self, sliding_window: int | None) -> AttentionMaskSpec:
        """The same spec for a layer with the given sliding window (sharing the masks built for the forward)."""
        spec = replace(self, sliding_window=sliding_window)
        spec.built = self.built
        return spec

    def boolean_mask(self, batch: int, seq_len: int, device: torch.device, kv_len: int | None = None) -> torch.Tensor:
        """``(B, 1, T, S)`` boolean mask, True where attention is allowed (transformers' convention).

        ``kv_len`` is the number of keys ``S`` (default ``T``; more with cached keys, the queries being the last).
        """
        kv_len = seq_len if kv_len is None else kv_len
        key = (batch, seq_len, kv_len, self.sliding_window, device)
        if key in self.built:
            return self.built[key]
        k_idx = torch.arange(kv_len, device=device)
        q_idx = k_idx[kv_len - seq_len :, None]
        allowed = k_idx <= q_idx
        if self.sliding_window is not None:
            allowed = allowed & (k_idx > q_idx - self.sliding_window)
        if self.cu_seq_lens is not None:
            lengths = (self.cu_seq_lens[1:] - self.cu_seq_lens[:-1]).long().to(device)
            doc = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths)
            allowed = allowed & (doc[:, None] == doc[None, :])
        allowed = allowed[None, None].expand(batch, 1, seq_len, kv_len)
        if self.padding_mask is not None:
            allowed = allowed & self.padding_mask.bool().to(device)[:, None, None, :]
        if kv_len != seq_len:  # decoding with cached keys: every layer of the forward asks for the same mask
            self.built[key] = allowed
        return allowed

    def additive_mask(
        self, batch: int, seq_len: int, dtype: torch.dtype, device: torch.device, kv_len: int | None = None
    ) -> torch.Tensor:
        """``(B, 1, T, S)`` additive mask: 0 where allowed, ``finfo(dtype).min`` elsewhere (as transformers)."""
        allowed = self.boolean_mask(batch, seq_len, device, kv_len)
        return torch.where(allowed, torch.zeros((), device=device, dtype=dtype), torch.finfo(dtype).min)


AttnFn = Callable[..., torch.Tensor]


def get_attn_impl_fn(name: str = "auto") -> AttnFn:
    """Return the attention function for ``name`` (``auto`` picks the fastest available).

    Args:
        name: One of ``auto``, ``eager``, ``sdpa``, ``flash``.

    Raises:
        ValueError: For an unknown name, or ``flash`` where flash-attn or CUDA is missing.
    """
    if name not in ATTN_IMPLS:
        raise ValueError(f"unknown attention implementation {name!r}; choose one of {ATTN_IMPLS}")
    if hf_impl_enabled() or name == "eager":
        return eager_attention
    if name == "auto":
        return flash_attention if flash_attn_available() else sdpa_attention
    if name == "flash":
        if not flash_attn_available():
            raise ValueError("attn_impl='flash' needs CUDA and the flash-attn package; use 'sdpa' or 'auto'")
        return flash_attention
    return sdpa_attention


def flash_attn_available() -> bool:
    """True when CUDA is present and ``flash_attn`` can be imported."""
    return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Expand ``(B, Hkv, T, D)`` to ``(B, Hkv * n_rep, T, D)`` (transformers' op order)."""
    batch, num_kv_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_kv_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_kv_heads * n_rep, slen, head_dim)


def eager_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: AttentionMaskSpec,
    scaling: float,
    dropout: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference attention, bitwise equal to transformers' eager path.

    Args:
        q: Queries ``(B, H, T, D)``.
        k: Keys ``(B, Hkv, T, D)``.
        v: Values ``(B, Hkv, T, D)``.
        mask: Visibility spec.
        scaling: Softmax scale.
        dropout: Attention dropout probability (training only).
        sinks: Optional per-head attention-sink logits ``(H,)`` (GPT-OSS).
    """
    n_rep = q.shape[1] // k.shape[1]
    key_states = repeat_kv(k, n_rep)
    value_states = repeat_kv(v, n_rep)
    attn_weights = torch.matmul(q, key_states.transpose(2, 3)) * scaling
    attn_weights = attn_weights + mask.additive_mask(q.shape[0], q.shape[2], attn_weights.dtype, q.device, k.shape[2])
    if sinks is not None:
        sink_logits = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)
        combined = torch.cat([attn_weights, sink_logits], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = F.softmax(combined, dim=-1, dtype=combined.dtype)
        attn_weights = probs[..., :-1]
    else:
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q.dtype)
    if dropout > 0.0:
        attn_weights = F.dropout(attn_weights, p=dropout, training=True)
    attn_output = torch.matmul(attn_weights, value_states)
    return attn_output.transpose(1, 2).contiguous()


def sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: AttentionMaskSpec,
    scaling: float,
    dropout: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``scaled_dot_product_attention``; a packed batch is attended one document at a time (no mask tensor).

    Sliding windows, padding and sinks fall back to an explicit mask or to :func:`eager_attention`.
    """
    if sinks is not None:
        return eager_attention(q, k, v, mask, scaling, dropout, sinks)
    gqa = q.shape[1] != k.shape[1]
    unmasked = mask.sliding_window is None and mask.padding_mask is None
    if unmasked and q.shape[2] == 1:  # one query per row, the last key: it sees every key
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scaling, enable_gqa=gqa)
        return out.transpose(1, 2).contiguous()
    if unmasked and q.shape[2] == k.shape[2]:
        if mask.doc_bounds is None or len(mask.doc_bounds) == 2:
            out = F.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=gqa
            )
            return out.transpose(1, 2).contiguous()
        bounds = mask.doc_bounds
        outs = [
            F.scaled_dot_product_attention(
                q[:, :, s:e],
                k[:, :, s:e],
                v[:, :, s:e],
                dropout_p=dropout,
                is_causal=True,
                scale=scaling,
                enable_gqa=gqa,
            )
            for s, e in zip(bounds[:-1], bounds[1:])
        ]
        return torch.cat(outs, dim=2).transpose(1, 2).contiguous()
    allowed = mask.boolean_mask(q.shape[0], q.shape[2], q.device, k.shape[2])
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous()


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: AttentionMaskSpec,
    scaling: float,
    dropout: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """flash-attn varlen kernel over packed documents (GPU only)."""
    from flash_attn import flash_attn_varlen_func

    if sinks is not None or mask.padding_mask is not None or q.shape[2] != k.shape[2]:
        return sdpa_attention(q, k, v, mask, scaling, dropout, sinks)
    batch, heads, seq_len, head_dim = q.shape
    if mask.cu_seq_lens is None:
        cu = torch.arange(0, (batch + 1) * seq_len, seq_len, dtype=torch.int32, device=q.device)
        max_len = seq_len
    else:
        cu = mask.cu_seq_lens.to(device=q.device, dtype=torch.int32)
        max_len = int(mask.max_seq_len or seq_len)
    window = (-1, -1) if mask.sliding_window is None else (mask.sliding_window - 1, 0)

    def flat(t: torch.Tensor) -> torch.Tensor:
        return t.transpose(1, 2).reshape(-1, t.shape[1], head_dim)

    out = flash_attn_varlen_func(
        flat(q),
        flat(k),
        flat(v),
        cu,
        cu,
        max_len,
        max_len,
        dropout_p=dropout,
        softmax_scale=scaling,
        causal=True,
        window_size=window,
    )
    return out.reshape(batch, seq_len, heads, head_dim)
