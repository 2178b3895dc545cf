"""Key/value cache for incremental decoding: per-layer buffers preallocated to a maximum length.

The model bodies take a cache as an argument and never branch on it: without one they use :data:`NO_KV_CACHE`,
whose :meth:`~KVCache.begin` returns the mask unchanged and whose layers return their keys and values unchanged.
With a :class:`KVCache`, a forward

1. calls :meth:`KVCache.begin` once: it reserves the cache slots of this call's tokens and returns the mask of
   the queries (the last slots) over every cached key, with a padding mask over the slots when some hold padding;
2. in every attention layer calls ``kv_cache.layer(i).update(k, v)``: the layer's new keys and values are written
   to their slots and the cached keys and values (``(B, H, S, D)``, ``S`` the slots in use) come back.

Every row uses the same slots: a left-padded ``(B, T)`` prefill fills slots ``0..T-1`` (padding slots are masked),
a packed prefill (a ``(1, T)`` batch with ``cu_seq_lens``, one document per row) writes document ``i`` right-aligned
into row ``i`` (the slots before it are masked) and attends within the pack as usual. Each later ``(B, 1)`` step
takes the next slot of every row.
"""

from __future__ import annotations

import torch

from xtl.ops.attention import AttentionMaskSpec


class LayerKVCache:
    """The key and value buffers of one attention layer, allocated on the first :meth:`update`.

    Buffers take the shape, dtype and device of the layer's own keys and values (``(B, H, max_length, D)``), so
    grouped-query, latent (the per-head keys and values MLA expands) and sink attention share this class.

    Args:
        cache: The model-level cache that plans where this call's tokens go.
    """

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this call's ``k``/``v`` ``(B, H, T, D)``; return the keys and values to attend over."""
        if self.keys is None:
            self.keys = self._buffer(k)
            self.values = self._buffer(v)
        self.cache.write(self.keys, k)
        self.cache.write(self.values, v)
        return self.cache.read(self.keys, k), self.cache.read(self.values, v)

    def _buffer(self, like: torch.Tensor) -> torch.Tensor:
        shape = (self.cache.batch_size, like.shape[1], self.cache.max_length, like.shape[3])
        return torch.zeros(shape, dtype=like.dtype, device=like.device)


class KVCache:
    """Keys and values of every attention layer for ``batch_size`` sequences of up to ``max_length`` tokens.

    ``length`` counts the slots in use (the same in every row); ``key_mask[b, s]`` is False where slot ``s`` of row
    ``b`` holds no token of the sequence (padding), and no query sees its key. Reusing a cache for new prompts
    needs :meth:`reset`.

    Args:
        batch_size: Rows (sequences).
        max_length: Slots per row: the longest prompt plus the new tokens.

    Raises:
        ValueError: For a non-positive ``batch_size`` or ``max_length``.
    """

    def __init__(self, batch_size: int, max_length: int) -> None:
        if batch_size < 1:
            raise ValueError(f"KVCache batch_size must be >= 1, got {batch_size}")
        if max_length < 1:
            raise ValueError(f"KVCache max_length must be >= 1, got {max_length}")
        self.batch_size = batch_size
        self.max_length = max_length
        self._layers: dict[int, LayerKVCache] = {}
        self.reset()

    def reset(self) -> None:
        """Forget every cached token (buffers are kept and overwritten)."""
        self.length = 0
        self.key_mask: torch.Tensor | None = None
        self._padded = False
        self._start = 0
        self._index: tuple[torch.Tensor, torch.Tensor] | None = None
        self._attend_cached = True

    @property
    def lengths(self) -> list[int]:
        """Tokens cached per sequence (slots in use minus padding)."""
        if self.key_mask is None:
            return [0] * self.batch_size
        return self.key_mask[:, : self.length].sum(-1).tolist()

    def layer(self, index: int) -> LayerKVCache:
        """The cache of attention layer ``index`` (created on first use)."""
        if index not in self._layers:
            self._layers[index] = LayerKVCache(self)
        return self._layers[index]

    def begin(self, mask: AttentionMaskSpec, batch: int, seq_len: int, device: torch.device) -> AttentionMaskSpec:
        """Reserve the slots of a forward's ``batch x seq_len`` tokens; return the mask over the cached keys.

        Args:
            mask: The forward's own mask: packed (``cu_seq_lens``, a prefill into an empty cache, one document
                per row) or an ordinary batch (``padding_mask`` over this call's tokens, or none).
            batch: Rows of the forward (1 for a packed prefill).
            seq_len: Tokens per row.
            device: Device of the forward.

        Raises:
            ValueError: When the tokens do not fit, the batch size differs from the cache's, or a packed batch
                arrives in a cache that is not empty.
        """
        if mask.cu_seq_lens is not None:
            return self._begin_packed(mask, device)
        if batch != self.batch_size:
            raise ValueError(f"KVCache holds {self.batch_size} sequences but the forward has {batch}")
        if self.length + seq_len > self.max_length:
            raise ValueError(
                f"KVCache max_length {self.max_length} is too small: {self.length} cached + {seq_len} new tokens"
            )
        slots = self._key_mask(device).narrow(1, self.length, seq_len)
        if mask.padding_mask is None:  # every token is real (decoding steps): no mask to read back
            slots.fill_(True)
        else:
            real = mask.padding_mask.to(device).bool()
            self._padded = self._padded or not bool(real.all())
            slots.copy_(real)
        self._start, self._index, self._attend_cached = self.length, None, True
        self.length += seq_len
        padding = self.key_mask.narrow(1, 0, self.length) if self._padded else None
        return AttentionMaskSpec(padding_mask=padding, sliding_window=mask.sliding_window)

    def write(self, buffer: torch.Tensor, new: torch.Tensor) -> None:
        """Copy ``new`` ``(B, H, T, D)`` (packed: ``(1, H, T, D)``) into the slots :meth:`begin` reserved."""
        if self._index is None:
            buffer.narrow(2, self._start, new.shape[2]).copy_(new)
        else:
            rows, slots = self._index
            buffer[rows, :, slots] = new[0].transpose(0, 1)

    def read(self, buffer: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """What a layer attends over: the slots in use, or ``new`` itself during a packed prefill."""
        return buffer.narrow(2, 0, self.length) if self._attend_cached else new

    # ---- private ---------------------------------------------------------------------------------------------

    def _begin_packed(self, mask: AttentionMaskSpec, device: torch.device) -> AttentionMaskSpec:
        bounds = mask.doc_bounds or []
        lengths = [end - start for start, end in zip(bounds[:-1], bounds[1:])]
        if self.length:
            raise ValueError("a packed prefill needs an empty KVCache (call reset() first)")
        if len(lengths) != self.batch_size:
            raise ValueError(f"KVCache holds {self.batch_size} sequences but the packed prefill has {len(lengths)}")
        width = max(lengths)
        if width > self.max_length:
            raise ValueError(f"KVCache max_length {self.max_length} is too small for a {width}-token prompt")
        rows = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))
        slots = torch.cat([torch.arange(width - n, width, device=device) for n in lengths])
        self._key_mask(device)[rows, slots] = True
        self._padded = min(lengths) < width
        self._index, self._attend_cached = (rows, slots), False
        self.length = width
        return mask

    def _key_mask(self, device: torch.device) -> torch.Tensor:
        if self.key_mask is None:
            self.key_mask = torch.zeros(self.batch_size, self.max_length, dtype=torch.bool, device=device)
        return self.key_mask


class _NoLayerKVCache(LayerKVCache):
    """No cache for one layer: attend over this call's keys and values."""

    def __init__(self) -> None:
        self.keys = self.values = None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return k, v


class _NoKVCache(KVCache):
    """No cache: every forward attends over its own tokens (the default of the model bodies)."""

    def __init__(self) -> None:
        self.batch_size = self.max_length = 0

    def begin(self, mask: AttentionMaskSpec, batch: int, seq_len: int, device: torch.device) -> AttentionMaskSpec:
        return mask

    def layer(self, index: int) -> LayerKVCache:
        return NO_LAYER_KV_CACHE


NO_LAYER_KV_CACHE: LayerKVCache = _NoLayerKVCache()
NO_KV_CACHE: KVCache = _NoKVCache()
