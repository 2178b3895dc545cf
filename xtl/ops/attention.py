"""Attention implementations behind one selector.

Every implementation takes ``q (B, H, T, D)``, ``k``/``v`` ``(B, Hkv, S, D)`` and an :class:`AttentionMaskSpec`
describing which keys each query may see, and returns ``(B, T, H, D)``. ``S`` is ``T``, or more when the keys
include cached ones (decoding with a KV cache): the queries are then the last ``T`` keys.

- ``eager``: bitwise equal to transformers' ``eager_attention_forward`` (fp32 softmax, same op order).
- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention``. A packed batch runs one call per document-length
  bucket (documents right-padded to a multiple of ``DOC_LENGTH_BUCKET`` tokens and stacked along the batch; causality
  hides the padding), each causal, or with an ``(L, L)`` banded mask for a sliding window; sinks run
  :func:`eager_attention` per bucket. CPU default; on CPU, 16-bit documents of up to ``CPU_FP32_MAX_DOC_LEN`` tokens
  are attended in fp32 (faster there; output cast back).
- ``flash``: flash-attn varlen kernels (GPU, when ``flash_attn`` is importable).
- ``varlen``: PyTorch's own FlashAttention varlen kernel, ``torch.nn.attention.varlen.varlen_attn`` (GPU).

``auto`` picks ``flash``, else ``varlen`` (CUDA), else ``sdpa``. ``flash`` and ``varlen`` hand what their kernel
does not do (sinks, padding masks, cached keys; for ``varlen`` also dropout, fp32 and CPU tensors) to ``sdpa``.
``XTL_HF_IMPL=1`` makes :func:`get_attn_impl_fn` return ``eager`` whatever was asked.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from xtl.ops.selector import hf_impl_enabled

# packed documents are padded to a multiple of this many tokens and attended a bucket at a time
DOC_LENGTH_BUCKET = 16
ATTN_IMPLS = ("auto", "eager", "sdpa", "flash", "varlen")

# What torch's varlen kernel (FlashAttention 2) takes: half-precision inputs, head dims up to 256 in steps of 8.
_VARLEN_DTYPES = (torch.float16, torch.bfloat16)
_VARLEN_MAX_HEAD_DIM = 256


class MaskCache:
    """Masks built for one forward, keyed by shape, window and device, shared by every layer of the forward.

    A plain object on purpose: ``torch.distributed.utils._apply_to_tensors`` (FSDP2's input cast) copies dicts
    and dataclasses but passes other objects through unchanged, so the cache survives the cast.
    """

    __slots__ = ("masks",)

    def __init__(self) -> None:
        self.masks: dict[tuple, torch.Tensor] = {}

    def __contains__(self, key: tuple) -> bool:
        return key in self.masks

    def __getitem__(self, key: tuple) -> torch.Tensor:
        return self.masks[key]

    def __setitem__(self, key: tuple, mask: torch.Tensor) -> None:
        self.masks[key] = mask


@dataclass
class AttentionMaskSpec:
    """Which keys a query may attend to, independent of any implementation.

    Attributes:
        cu_seq_lens: Packed-document boundaries (batch of 1); ``None`` for an ordinary ``(B, T)`` batch.
        max_seq_len: Longest document of a packed batch.
        padding_mask: ``(B, S)`` over the keys with 1 for real tokens, 0 for padding (ordinary batches only).
        sliding_window: Keys further than ``sliding_window - 1`` positions back are hidden.
        doc_bounds: ``cu_seq_lens`` as Python ints (the packed batch's host-side copy). Derived here only when
            ``cu_seq_lens`` is on the CPU; a device tensor is never read back (each read is a device-to-host
            sync), so without ``doc_bounds`` a packed batch on GPU attends through an explicit ``(T, T)`` mask.

    With ``S`` keys for ``T < S`` queries (cached keys, :class:`xtl.module.kv_cache.KVCache`) the queries are the
    last ``T`` keys, and the masks are built once per forward and shared by its layers.

    Every field can be given to ``dataclasses.replace``: FSDP2's mixed precision rebuilds dataclass inputs of each
    sharded layer that way, and ``built`` (a :class:`MaskCache`, not a container FSDP walks into) is passed on as
    the same object, so the layers of a forward still share the masks.
    """

    cu_seq_lens: torch.Tensor | None = None
    max_seq_len: int | None = None
    padding_mask: torch.Tensor | None = None
    sliding_window: int | None = None
    doc_bounds: Sequence[int] | None = None
    built: MaskCache = field(default_factory=MaskCache, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.doc_bounds is None and self.cu_seq_lens is not None and self.cu_seq_lens.device.type == "cpu":
            self.doc_bounds = self.cu_seq_lens.tolist()

    def document_bounds(self, seq_len: int, kv_len: int) -> Sequence[int] | None:
        """Host-side boundaries of the documents that attend independently, causally, without padding.

        An ordinary batch is one document per row (``[0, T]``). ``None`` where attention needs an explicit mask:
        a padding mask, cached keys (``kv_len != seq_len``), or packed boundaries known only on the device.
        """
        if self.padding_mask is not None or kv_len != seq_len:
            return None
        if self.cu_seq_lens is None:
            return [0, seq_len]
        return self.doc_bounds

    def with_window(self, sliding_window: int | None) -> AttentionMaskSpec:
        """The same spec for a layer with the given sliding window (sharing the masks built for the forward)."""
        if sliding_window == self.sliding_window:
            return self
        return replace(self, sliding_window=sliding_window)

    def boolean_mask(self, batch: int, seq_len: int, device: torch.device, kv_len: int | None = None) -> torch.Tensor:
        """``(B, 1, T, S)`` boolean mask, True where attention is allowed (transformers' convention).

        ``kv_len`` is the number of keys ``S`` (default ``T``; more with cached keys, the queries being the last).
        """
        kv_len = seq_len if kv_len is None else kv_len
        key = (batch, seq_len, kv_len, self.sliding_window, device)
        if key in self.built:
            return self.built[key]
        if seq_len == 1 and self.cu_seq_lens is None and (self.sliding_window or kv_len) >= kv_len:
            # one query, the last position: it sees every key that holds a token (decoding)
            if self.padding_mask is None:
                return torch.ones(batch, 1, 1, kv_len, dtype=torch.bool, device=device)
            self.built[key] = self.padding_mask.bool().to(device)[:, None, None, :].expand(batch, 1, 1, kv_len)
            return self.built[key]
        k_idx = torch.arange(kv_len, device=device)
        q_idx = k_idx[kv_len - seq_len :, None]
        allowed = k_idx <= q_idx
        if self.sliding_window is not None:
            allowed = allowed & (k_idx > q_idx - self.sliding_window)
        if self.cu_seq_lens is not None:
            lengths = (self.cu_seq_lens[1:] - self.cu_seq_lens[:-1]).long().to(device)
            doc = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths, output_size=kv_len)
            allowed = allowed & (doc[:, None] == doc[None, :])
        allowed = allowed[None, None].expand(batch, 1, seq_len, kv_len)
        if self.padding_mask is not None:
            allowed = allowed & self.padding_mask.bool().to(device)[:, None, None, :]
        if kv_len != seq_len:  # decoding with cached keys: every layer of the forward asks for the same mask
            self.built[key] = allowed
        return allowed

    def sdpa_mask(
        self, batch: int, seq_len: int, dtype: torch.dtype, device: torch.device, kv_len: int
    ) -> torch.Tensor:
        """:meth:`boolean_mask` as the additive ``dtype`` mask SDPA makes of it (0 allowed, ``-inf`` hidden).

        With cached keys it is built once per forward and shared by the layers (SDPA would convert the boolean
        mask again in every layer); the attention output is the same as with the boolean mask.
        """
        key = ("sdpa", batch, seq_len, kv_len, self.sliding_window, dtype, device)
        if key in self.built:
            return self.built[key]
        allowed = self.boolean_mask(batch, seq_len, device, kv_len)
        additive = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))
        if kv_len != seq_len:
            self.built[key] = additive
        return additive

    def banded_causal_mask(self, length: int, device: torch.device) -> torch.Tensor:
        """``(L, L)`` boolean causal mask of one document under this spec's sliding window (True: allowed).

        Built once per forward and length, and shared by the forward's layers with the same window.
        """
        key = ("band", length, self.sliding_window, device)
        if key not in self.built:
            idx = torch.arange(length, device=device)
            behind = idx[:, None] - idx[None, :]  # query minus key position
            allowed = behind >= 0
            if self.sliding_window is not None:
                allowed = allowed & (behind < self.sliding_window)
            self.built[key] = allowed
        return self.built[key]

    def additive_mask(
        self, batch: int, seq_len: int, dtype: torch.dtype, device: torch.device, kv_len: int | None = None
    ) -> torch.Tensor:
        """``(B, 1, T, S)`` additive mask: 0 where allowed, ``finfo(dtype).min`` elsewhere (as transformers)."""
        allowed = self.boolean_mask(batch, seq_len, device, kv_len)
        return torch.where(allowed, torch.zeros((), device=device, dtype=dtype), torch.finfo(dtype).min)


AttnFn = Callable[..., torch.Tensor]


def get_attn_impl_fn(name: str = "auto") -> AttnFn:
    """Return the attention function for ``name`` (``auto`` picks the fastest available).

    ``auto`` is ``flash`` when flash-attn is installed on CUDA, else ``varlen`` on CUDA, else ``sdpa``.

    Args:
        name: One of ``auto``, ``eager``, ``sdpa``, ``flash``, ``varlen``.

    Raises:
        ValueError: For an unknown name, ``flash`` where flash-attn or CUDA is missing, or ``varlen`` where CUDA
            or ``torch.nn.attention.varlen`` is missing.
    """
    if name not in ATTN_IMPLS:
        raise ValueError(f"unknown attention implementation {name!r}; choose one of {ATTN_IMPLS}")
    if hf_impl_enabled() or name == "eager":
        return eager_attention
    if name == "auto":
        if flash_attn_available():
            return flash_attention
        return varlen_attention if varlen_available() else sdpa_attention
    if name == "flash":
        if not flash_attn_available():
            raise ValueError("attn_impl='flash' needs CUDA and the flash-attn package; use 'sdpa' or 'auto'")
        return flash_attention
    if name == "varlen":
        if not varlen_available():
            raise ValueError(
                "attn_impl='varlen' needs CUDA and torch.nn.attention.varlen (PyTorch >= 2.10); use 'sdpa' or 'auto'"
            )
        return varlen_attention
    return sdpa_attention


def flash_attn_available() -> bool:
    """True when CUDA is present and ``flash_attn`` can be imported."""
    return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


def varlen_available() -> bool:
    """True when CUDA is present and PyTorch ships ``torch.nn.attention.varlen`` (its FlashAttention kernel)."""
    return torch.cuda.is_available() and importlib.util.find_spec("torch.nn.attention.varlen") is not None


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
    attn_weights = attention_probs(attn_weights, q.dtype, dropout, sinks)
    attn_output = torch.matmul(attn_weights, value_states)
    return attn_output.transpose(1, 2).contiguous()


def attention_probs(
    scores: torch.Tensor, dtype: torch.dtype, dropout: float = 0.0, sinks: torch.Tensor | None = None
) -> torch.Tensor:
    """Masked scores ``(B, H, T, S)`` to probabilities in transformers' eager formulation: an fp32 softmax cast to
    ``dtype``, or with sinks an extra logit per head that joins the softmax and is dropped; then dropout."""
    if sinks is not None:
        sink_logits = sinks.reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[-2], -1)
        combined = torch.cat([scores, sink_logits], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = F.softmax(combined, dim=-1, dtype=combined.dtype)
        probs = probs[..., :-1]
    else:
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(dtype)
    if dropout > 0.0:
        probs = F.dropout(probs, p=dropout, training=True)
    return probs


def sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: AttentionMaskSpec,
    scaling: float,
    dropout: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``scaled_dot_product_attention``, one call per document-length bucket of a packed batch.

    Documents are right-padded to a multiple of :data:`DOC_LENGTH_BUCKET` tokens, stacked along the batch and
    attended causally (or with an ``(L, L)`` banded mask for a sliding window shorter than the bucket); causality
    hides the padding, so the result equals one call per document up to summation order
    (:func:`attend_by_document_length`). Sinks run :func:`eager_attention` per bucket the same way. Padding masks,
    cached keys and packed batches without host-side ``doc_bounds`` use one call with an explicit mask (sinks: one
    :func:`eager_attention` call). On CPU, short 16-bit documents are attended in fp32.

    Args:
        q: Queries ``(B, H, T, D)``.
        k: Keys ``(B, Hkv, S, D)``.
        v: Values ``(B, Hkv, S, Dv)``.
        mask: Visibility spec.
        scaling: Softmax scale.
        dropout: Attention dropout probability (training only).
        sinks: Optional per-head attention-sink logits ``(H,)`` (GPT-OSS).

    Returns:
        ``(B, T, H, Dv)``.
    """
    bounds = mask.document_bounds(q.shape[2], k.shape[2])
    if bounds is None:
        return _sdpa_masked(q, k, v, mask, scaling, dropout, sinks)
    window = mask.sliding_window
    if sinks is not None:
        per_doc = AttentionMaskSpec(sliding_window=window)

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return eager_attention(q, k, v, per_doc, scaling, dropout, sinks)

    else:

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            length, gqa, dtype = q.shape[2], q.shape[1] != k.shape[1], q.dtype
            if _cpu_fp32_faster(q, length):
                q, k, v = q.float(), k.float(), v.float()
            if window is None or window >= length:  # the window hides nothing inside this document
                out = F.scaled_dot_product_attention(
                    q, k, v, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=gqa
                )
            else:
                band = mask.banded_causal_mask(length, q.device)
                out = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=band, dropout_p=dropout, scale=scaling, enable_gqa=gqa
                )
            return out.transpose(1, 2).to(dtype)

    return attend_by_document_length(q, k, v, bounds, attend)


def attend_by_document_length(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bounds: Sequence[int],
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    bucket: int = DOC_LENGTH_BUCKET,
) -> torch.Tensor:
    """Run ``attend`` once per document-length bucket, the documents of a bucket stacked along the batch.

    Documents are right-padded to their bucket's length (a multiple of ``bucket``): causal attention never lets a
    real query see a later (padded) key, so padding changes no real output, and a pack of many short documents
    takes a few calls instead of one per distinct length. Each bucket is one gather per input along the tokens and
    one per output (their backward is one scatter each), with the index tensors built on the host.

    Args:
        q: Queries ``(B, H, T, D)``.
        k: Keys ``(B, Hkv, T, D)``.
        v: Values ``(B, Hkv, T, Dv)``.
        bounds: Document boundaries as host ints, ``0 = bounds[0] < ... < bounds[-1] = T``.
        attend: Causal attention within documents: ``(n, H, L, D)`` inputs to an ``(n, L, H, Dv)`` output.
        bucket: Padded document lengths are multiples of this (1: exact lengths, no padding).

    Returns:
        ``(B, T, H, Dv)``, contiguous: each document's output in its place.
    """
    if len(bounds) == 2:
        return attend(q, k, v).contiguous()
    plan = _bucket_plan(tuple(bounds), bucket, q.device)
    batch, outs = q.shape[0], []
    for gather, valid, docs, length in plan.buckets:
        inputs = [
            t.index_select(2, gather).unflatten(2, (docs, length)).transpose(1, 2).flatten(0, 1) for t in (q, k, v)
        ]
        out = attend(*inputs)  # (B * docs, L, H, Dv)
        outs.append(out.reshape(batch, docs * length, *out.shape[2:]).index_select(1, valid))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    return out.index_select(1, plan.inverse)


@dataclass(frozen=True)
class _BucketPlan:
    """Index tensors of :func:`attend_by_document_length`: per bucket ``(gather, valid, docs, length)``, and the
    permutation from bucket order back to token order."""

    buckets: list[tuple[torch.Tensor, torch.Tensor, int, int]]
    inverse: torch.Tensor


@functools.lru_cache(maxsize=64)
def _bucket_plan(bounds: tuple[int, ...], bucket: int, device: torch.device) -> _BucketPlan:
    """Built on the host once per distinct packing (every layer of a forward shares it). Cached across calls, so
    built outside inference mode: a plan first made by an evaluation (Lightning runs it under
    ``torch.inference_mode``) must serve a training step with the same packing too."""
    with torch.inference_mode(False):
        return _build_bucket_plan(bounds, bucket, device)


def _build_bucket_plan(bounds: tuple[int, ...], bucket: int, device: torch.device) -> _BucketPlan:
    groups: dict[int, list[int]] = {}
    for doc, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        groups.setdefault(-(-(end - start) // bucket) * bucket, []).append(doc)
    buckets, order = [], []
    for length, docs in groups.items():
        gather, valid = [], []
        for slot, doc in enumerate(docs):
            start, end = bounds[doc], bounds[doc + 1]
            # padded positions repeat the document's last token: hidden from every real query by causality
            gather += [min(start + i, end - 1) for i in range(length)]
            valid += range(slot * length, slot * length + end - start)
            order += range(start, end)
        as_index = functools.partial(torch.tensor, dtype=torch.long)
        buckets.append((as_index(gather).to(device), as_index(valid).to(device), len(docs), length))
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[torch.tensor(order)] = torch.arange(len(order))
    return _BucketPlan(buckets, inverse.to(device))


# CPU SDPA's 16-bit kernels lose to fp32 on short documents (1 thread, fwd+bwd, bf16 -> fp32 time: 0.27x at
# L = 30, 0.38x at L = 128, 1.06x at L = 512 with 4 heads of 32): attend short documents in fp32.
CPU_FP32_MAX_DOC_LEN = 256


def _cpu_fp32_faster(q: torch.Tensor, length: int) -> bool:
    return q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16) and length <= CPU_FP32_MAX_DOC_LEN


def _sdpa_masked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: AttentionMaskSpec,
    scaling: float,
    dropout: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """One call over all ``(B, T, S)`` scores: padding masks, cached keys, device-only document boundaries."""
    if sinks is not None:
        return eager_attention(q, k, v, mask, scaling, dropout, sinks)
    gqa = q.shape[1] != k.shape[1]
    if mask.sliding_window is None and mask.padding_mask is None and q.shape[2] == 1:
        # one query per row, the last key: it sees every key
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scaling, enable_gqa=gqa)
        return out.transpose(1, 2).contiguous()
    if k.shape[2] != q.shape[2]:  # cached keys: the layers of the forward share one additive mask
        allowed = mask.sdpa_mask(q.shape[0], q.shape[2], q.dtype, q.device, k.shape[2])
    else:
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
    cu, max_len = varlen_cu_seqlens(mask, batch, seq_len, q.device)
    window = (-1, -1) if mask.sliding_window is None else varlen_window(mask.sliding_window)
    out = flash_attn_varlen_func(
        flatten_heads(q),
        flatten_heads(k),
        flatten_heads(v),
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


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: AttentionMaskSpec,
    scaling: float,
    dropout: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """PyTorch's FlashAttention varlen kernel (``torch.nn.attention.varlen.varlen_attn``) over packed documents.

    Queries, keys and values are flattened to ``(B * T, H, D)`` with document boundaries ``cu_seqlens`` (an
    ordinary batch is one document per row); GQA is native, a sliding window is the kernel's ``window_size``, and
    values narrower than the queries (MLA) are zero-padded and the output cut back. What the kernel does not do
    falls back to :func:`sdpa_attention`: sinks, padding masks, cached keys, dropout (the kernel has none), fp32 or
    CPU tensors, head dims not a multiple of 8 or above 256.

    Args:
        q: Queries ``(B, H, T, D)``.
        k: Keys ``(B, Hkv, T, D)``.
        v: Values ``(B, Hkv, T, Dv)``, ``Dv <= D``.
        mask: Visibility spec.
        scaling: Softmax scale.
        dropout: Attention dropout probability (training only).
        sinks: Optional per-head attention-sink logits ``(H,)`` (GPT-OSS).

    Returns:
        ``(B, T, H, Dv)``.
    """
    if not varlen_supported(q, k, v, mask, dropout, sinks):
        return sdpa_attention(q, k, v, mask, scaling, dropout, sinks)
    from torch.nn.attention.varlen import varlen_attn

    batch, heads, seq_len, head_dim = q.shape
    value_dim = v.shape[-1]
    if value_dim != head_dim:
        v = F.pad(v, (0, head_dim - value_dim))
    cu, max_len = varlen_cu_seqlens(mask, batch, seq_len, q.device)
    out = varlen_attn(
        flatten_heads(q),
        flatten_heads(k),
        flatten_heads(v),
        cu,
        cu,
        max_len,
        max_len,
        scale=scaling,
        window_size=varlen_window(mask.sliding_window),
        enable_gqa=heads != k.shape[1],
    )
    out = unflatten_heads(out, batch)
    return out if value_dim == head_dim else out[..., :value_dim].contiguous()


def varlen_supported(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: AttentionMaskSpec,
    dropout: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> bool:
    """Whether :func:`varlen_attention` can run these inputs on its kernel (else it calls :func:`sdpa_attention`)."""
    head_dim = q.shape[-1]
    return (
        q.is_cuda
        and q.dtype in _VARLEN_DTYPES
        and sinks is None
        and dropout == 0.0
        and mask.padding_mask is None
        and q.shape[2] == k.shape[2]
        and (mask.cu_seq_lens is None or q.shape[0] == 1)
        and head_dim % 8 == 0
        and head_dim <= _VARLEN_MAX_HEAD_DIM
        and v.shape[-1] <= head_dim
    )


def varlen_window(sliding_window: int | None) -> tuple[int, int]:
    """FlashAttention's ``window_size`` ``(left, right)`` for a causal layer.

    ``(-1, 0)`` is plain causal; a window of ``W`` keys (the query and the ``W - 1`` before it, transformers'
    ``sliding_window``) is ``(W - 1, 0)``. A tuple, as ``varlen_attn`` detects causal by ``== (-1, 0)``.
    """
    return (-1, 0) if sliding_window is None else (sliding_window - 1, 0)


def varlen_cu_seqlens(
    mask: AttentionMaskSpec, batch: int, seq_len: int, device: torch.device
) -> tuple[torch.Tensor, int]:
    """``(cu_seqlens, max_seqlen)`` of the flattened ``B * T`` tokens, with no device-to-host sync.

    An ordinary batch is one document per row. ``max_seqlen`` is ``mask.max_seq_len``, else the longest of
    ``doc_bounds``, else ``T`` (an upper bound only sizes the kernel's grid).
    """
    if mask.cu_seq_lens is None:
        return torch.arange(0, (batch + 1) * seq_len, seq_len, dtype=torch.int32, device=device), seq_len
    cu = mask.cu_seq_lens.to(device=device, dtype=torch.int32)
    if mask.max_seq_len is not None:
        return cu, int(mask.max_seq_len)
    if mask.doc_bounds is not None:
        bounds = mask.doc_bounds
        return cu, max(end - start for start, end in zip(bounds[:-1], bounds[1:]))
    return cu, seq_len


def flatten_heads(t: torch.Tensor) -> torch.Tensor:
    """``(B, H, T, D)`` to the varlen layout ``(B * T, H, D)`` (rows laid end to end; a view when ``B == 1``)."""
    return t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[-1])


def unflatten_heads(t: torch.Tensor, batch: int) -> torch.Tensor:
    """The varlen layout ``(B * T, H, D)`` back to ``(B, T, H, D)``."""
    return t.reshape(batch, -1, *t.shape[1:])
