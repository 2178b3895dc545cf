"""Tokenize functions: one raw row in, zero or more ``DataItem`` out.

``PretrainTokenizeFn`` handles ``{"text": ...}`` (with optional chunking of long documents);
``ChatTokenizeFn`` renders OpenAI-style ``messages`` through a chat template and masks everything that is not
assistant output. Both tokenize a whole batch of rows in one call to the Rust tokenizer.

The fingerprint of a tokenize function (its class sources plus its arguments) is part of the cache key, so editing
the code or changing an argument re-tokenizes.
"""

from __future__ import annotations

import inspect
import json
import re
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import numpy as np
import xxhash
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerBase

import xtl.data.templates as _templates_module
from xtl.data.item import IGNORE_INDEX, DataError, DataItem
from xtl.data.templates import HF_TEMPLATE, ChatTemplate, Rendered, get_template, normalize_messages

Locator = Callable[[int], str]
SampleArrays = tuple[np.ndarray, np.ndarray]
# A sample may carry a third element, a tag stored per sample (``tags.npy`` of the cache; the label of an unpaired
# preference row, the margin of a preference pair): ``(ids, mask, tag)``.

_GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")


class TokenizeFn(ABC):
    """Base of tokenize functions. Subclasses implement ``batch`` and list their arguments in ``config``.

    Args:
        tokenizer (PreTrainedTokenizerBase): A fast (Rust-backed) Hugging Face tokenizer.

    Attributes:
        tagged (bool): Whether the samples carry a tag (``(ids, mask, tag)``), stored with the cache.
        tag_dtype (type): The numpy type the tags are stored as (``int8`` labels; ``float32`` preference margins).
    """

    tagged: bool = False
    tag_dtype: type = np.int8

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise DataError(
                f"{type(tokenizer).__name__} is not a fast tokenizer; xtl needs a tokenizer.json (Rust tokenizers)"
            )
        self.tokenizer = tokenizer
        self._backend_clone: Tokenizer | None = None
        self._token_bytes: TokenBytes | None | bool = False  # False: not built yet; None: not a byte-level BPE

    @property
    def _backend(self) -> Tokenizer:
        """A clone without post-processor (same ids with ``add_special_tokens=False``, untrimmed offsets).

        Built on first use, so a warm start (which only fingerprints the function) never copies a large vocabulary.
        """
        if self._backend_clone is None:
            clone = Tokenizer.from_str(self.tokenizer.backend_tokenizer.to_str())
            clone.post_processor = None
            clone.no_truncation()
            clone.no_padding()
            self._backend_clone = clone
        return self._backend_clone

    def _byte_table(self) -> TokenBytes | None:
        """The per-id byte table of a byte-level BPE (``None`` for other tokenizers), built on first use."""
        if self._token_bytes is False:
            self._token_bytes = TokenBytes.from_tokenizer(self._backend)
        return self._token_bytes  # type: ignore[return-value]

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_backend_clone"] = None  # rebuilt in the receiving process
        state["_token_bytes"] = False
        return state

    def __call__(self, row: dict[str, Any], location: str = "<row>") -> list[DataItem]:
        """Tokenize one row.

        Args:
            row (dict): The raw record.
            location (str): ``file:line`` of the record, for error messages.

        Returns:
            list[DataItem]: The samples the row yields (usually one).
        """
        return self.batch([row], lambda _: location)[0]

    def batch(self, rows: list[dict[str, Any] | None], locate: Locator) -> list[list[DataItem]]:
        """Tokenize several rows at once into ``DataItem`` lists.

        Args:
            rows (list[dict | None]): Raw records (``None`` for a skipped row).
            locate (Callable[[int], str]): Location of ``rows[i]`` for error messages.

        Returns:
            list[list[DataItem]]: The samples of every row.
        """
        return [[arrays_to_item(s[0], s[1]) for s in samples] for samples in self.batch_arrays(rows, locate)]

    @abstractmethod
    def batch_arrays(self, rows: list[dict[str, Any] | None], locate: Locator) -> list[list[SampleArrays]]:
        """Tokenize several rows into numpy arrays (the cache builder's fast path).

        Args:
            rows (list[dict | None]): Raw records (``None`` for a skipped row).
            locate (Callable[[int], str]): Location of ``rows[i]`` for error messages.

        Returns:
            list[list[tuple[np.ndarray, np.ndarray]]]: Per row, its samples as (int64 ids, bool loss mask); the
            mask is False at position 0.
        """

    @abstractmethod
    def config(self) -> dict[str, Any]:
        """The JSON-serializable arguments that change the output.

        Returns:
            dict: Arguments.
        """

    def fingerprint(self) -> str:
        """Hash of the source code of this class (and its bases and helper modules) and of ``config()``.

        Returns:
            str: Hex digest.
        """
        h = xxhash.xxh3_128()
        modules = {cls.__module__ for cls in type(self).__mro__ if cls.__module__ not in ("builtins", "abc")}
        modules.update(self._extra_modules())
        for name in sorted(modules):
            module = sys.modules.get(name)
            if module is not None:
                try:
                    h.update(inspect.getsource(module).encode())
                except (OSError, TypeError):
                    h.update(name.encode())
        h.update(type(self).__qualname__.encode())
        h.update(json.dumps(self.config(), sort_keys=True, default=str).encode())
        return h.hexdigest()

    def _extra_modules(self) -> set[str]:
        return set()


class PretrainTokenizeFn(TokenizeFn):
    """Pretraining text: ``[BOS] text [EOS]``, every token a target except the first.

    Documents longer than ``chunk_size`` tokens become several samples: windows of ``chunk_size`` tokens with
    stride ``chunk_size - chunk_overlap``. BOS appears only in the first chunk and EOS only in the last; the first
    ``chunk_overlap`` tokens of a continuation chunk are context only (label -100), so no token is trained twice.

    Args:
        tokenizer (PreTrainedTokenizerBase): Fast tokenizer.
        text_key (str): Field holding the text.
        add_bos (bool | None): Prepend BOS; ``None`` means "if the tokenizer has a BOS token".
        add_eos (bool): Append EOS.
        bos_token (str | None): Override the tokenizer's BOS token.
        eos_token (str | None): Override the tokenizer's EOS token (e.g. ``<|endoftext|>`` for Qwen pretraining).
        chunk_size (int | None): Split documents longer than this (tokens, BOS/EOS included).
        chunk_overlap (int): Context tokens repeated at the start of each continuation chunk.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        text_key: str = "text",
        add_bos: bool | None = None,
        add_eos: bool = True,
        bos_token: str | None = None,
        eos_token: str | None = None,
        chunk_size: int | None = None,
        chunk_overlap: int = 0,
    ) -> None:
        super().__init__(tokenizer)
        self.text_key = text_key
        if add_bos is None:
            add_bos = (bos_token or tokenizer.bos_token) is not None
        self.bos_id = _special_id(tokenizer, bos_token or tokenizer.bos_token, "BOS") if add_bos else None
        self.eos_id = _special_id(tokenizer, eos_token or tokenizer.eos_token, "EOS") if add_eos else None
        if chunk_size is not None and chunk_size < 2:
            raise DataError(f"chunk_size must be at least 2 tokens, got {chunk_size}")
        if chunk_size is not None and not 0 <= chunk_overlap < chunk_size - 1:
            raise DataError(f"chunk_overlap must be in [0, chunk_size - 1), got {chunk_overlap} for {chunk_size}")
        self.chunk_size = chunk_size
        self.chunk_overlap = chunk_overlap if chunk_size is not None else 0

    def config(self) -> dict[str, Any]:
        return {
            "text_key": self.text_key,
            "bos_id": self.bos_id,
            "eos_id": self.eos_id,
            "chunk_size": self.chunk_size,
            "chunk_overlap": self.chunk_overlap,
        }

    def batch_arrays(self, rows: list[dict[str, Any] | None], locate: Locator) -> list[list[SampleArrays]]:
        texts = []
        for i, row in enumerate(rows):
            if row is None:
                texts.append("")
                continue
            text = row.get(self.text_key)
            if not isinstance(text, str):
                problem = f"no {self.text_key!r} key" if text is None else f"{self.text_key!r} is not a string"
                raise DataError(
                    f'{locate(i)}: {problem} (keys: {sorted(row)}); text sources need {{{self.text_key!r}: "..."}}'
                    " per record: set `text_key` to your field, or use kind: chat for records with 'messages'"
                )
            texts.append(text)
        encodings = self._backend.encode_batch_fast(texts, add_special_tokens=False)
        prefix = [] if self.bos_id is None else [self.bos_id]
        suffix = [] if self.eos_id is None else [self.eos_id]
        out = []
        for enc in encodings:
            ids = np.array(prefix + enc.ids + suffix, dtype=np.int64)
            out.append(self._chunks(ids) if len(ids) else [])
        return out

    def _chunks(self, ids: np.ndarray) -> list[SampleArrays]:
        size = self.chunk_size
        if size is None or len(ids) <= size:
            return [(ids, _first_masked(np.ones(len(ids), dtype=bool)))]
        stride = size - self.chunk_overlap
        chunks = []
        for start in range(0, len(ids), stride):
            chunk = ids[start : start + size]
            mask = np.ones(len(chunk), dtype=bool)
            mask[: 1 if start == 0 else max(1, self.chunk_overlap)] = False
            chunks.append((chunk, mask))
            if start + size >= len(ids):
                break
        return chunks


class ChatTokenizeFn(TokenizeFn):
    """Chat SFT from OpenAI-style ``messages`` with assistant-only loss.

    Args:
        tokenizer (PreTrainedTokenizerBase): Fast tokenizer carrying the template's special tokens.
        template (str): Built-in template name (``qwen3``, ``chatml``, ``qwen2.5``, ``llama3``) or ``hf`` to render
            with the tokenizer's own ``chat_template`` and its ``{% generation %}`` assistant mask.
        messages_key (str): Field holding the messages.
        tools_key (str): Field holding tool definitions (optional in each record).
        template_kwargs (dict | None): Built-in: constructor overrides (``date_string`` for llama3). ``hf``: extra
            keyword arguments for ``apply_chat_template``.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        template: str = "qwen3",
        messages_key: str = "messages",
        tools_key: str = "tools",
        template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(tokenizer)
        self.template_name = template
        self.messages_key = messages_key
        self.tools_key = tools_key
        self.template_kwargs = dict(template_kwargs or {})
        self.template: ChatTemplate | None = None
        if template == HF_TEMPLATE:
            chat_template = tokenizer.chat_template
            if not isinstance(chat_template, str) or not _GENERATION_BLOCK.search(chat_template):
                raise DataError(
                    "template 'hf' needs a tokenizer chat_template that marks assistant output with "
                    "{% generation %} ... {% endgeneration %} blocks; this tokenizer's template has none. Pick a "
                    f"built-in template ({', '.join(sorted(_templates_module.TEMPLATES))}) or add generation blocks"
                )
        else:
            self.template = get_template(template, **self.template_kwargs)
            vocab = tokenizer.get_added_vocab()
            missing = [t for t in self.template.required_tokens if t not in vocab]
            if missing:
                raise DataError(
                    f"the tokenizer lacks special tokens {missing} that template {template!r} emits; choose the "
                    "template that matches the tokenizer, or template: hf"
                )

    def config(self) -> dict[str, Any]:
        return {
            "template": self.template_name,
            "messages_key": self.messages_key,
            "tools_key": self.tools_key,
            "template_kwargs": self.template_kwargs,
        }

    def render(self, row: dict[str, Any], location: str = "<row>", add_generation_prompt: bool = False) -> Rendered:
        """Render one record with a built-in template.

        Args:
            row (dict): Record with ``messages`` (and optional ``tools``).
            location (str): Record location for error messages.
            add_generation_prompt (bool): Append the (masked) assistant header.

        Returns:
            Rendered: Text and loss spans.
        """
        if self.template is None:
            raise DataError("render() needs a built-in template; template 'hf' tokenizes through apply_chat_template")
        messages, tools = self._messages(row, location)
        return self.template.render(messages, tools, add_generation_prompt, location)

    def encode(self, row: dict[str, Any], location: str = "<row>", add_generation_prompt: bool = False) -> DataItem:
        """Render and tokenize one record (e.g. an evaluation prompt with ``add_generation_prompt=True``).

        Args:
            row (dict): Record with ``messages`` (and optional ``tools``).
            location (str): Record location for error messages.
            add_generation_prompt (bool): Append the (masked) assistant header.

        Returns:
            DataItem: Ids and labels.
        """
        if self.template is None:
            return arrays_to_item(*self._hf_arrays(row, location, add_generation_prompt))
        rendered = self.render(row, location, add_generation_prompt)
        return arrays_to_item(*self._encode_rendered([rendered])[0])

    def batch_arrays(self, rows: list[dict[str, Any] | None], locate: Locator) -> list[list[SampleArrays]]:
        if self.template is None:
            return [[] if row is None else [self._hf_arrays(row, locate(i))] for i, row in enumerate(rows)]
        kept = [(i, self.render(row, locate(i))) for i, row in enumerate(rows) if row is not None]
        out: list[list[SampleArrays]] = [[] for _ in rows]
        for (i, _), arrays in zip(kept, self._encode_rendered([r for _, r in kept])):
            out[i] = [arrays]
        return out

    def _encode_rendered(self, rendered: list[Rendered]) -> list[SampleArrays]:
        """Tokenize rendered conversations and mark the tokens that overlap their loss spans.

        A byte-level BPE takes the fast path: ids without offset tracking (``encode_batch_fast``), token extents
        from the byte length of every id, used only when the ids spell the text byte for byte. Any other tokenizer
        (or a text the check rejects, e.g. one a normalizer changed) gets the tokenizer's character offsets.
        """
        texts = [r.text for r in rendered]
        out: list[SampleArrays | None] = [None] * len(rendered)
        table = self._byte_table()
        if table is not None:
            for k, enc in enumerate(self._backend.encode_batch_fast(texts, add_special_tokens=False)):
                out[k] = table.span_arrays(np.asarray(enc.ids, dtype=np.int64), texts[k], rendered[k].loss_spans)
        missing = [k for k, arrays in enumerate(out) if arrays is None]
        if missing:
            encodings = self._backend.encode_batch([texts[k] for k in missing], add_special_tokens=False)
            for k, enc in zip(missing, encodings):
                out[k] = _span_arrays(enc, rendered[k].loss_spans)
        return out  # type: ignore[return-value]

    def _messages(self, row: dict[str, Any], location: str) -> tuple[list[Any], list[Any] | None]:
        if self.messages_key not in row:
            raise DataError(
                f"{location}: no {self.messages_key!r} key (keys: {sorted(row)}); chat sources need "
                f"{{{self.messages_key!r}: [{{'role': ..., 'content': ...}}, ...]}}: set `messages_key`, or use "
                "kind: text for pretraining text"
            )
        tools = row.get(self.tools_key)
        if tools is not None and not isinstance(tools, list):
            raise DataError(f"{location}: {self.tools_key!r} must be a list of tool definitions")
        return row[self.messages_key], tools or None

    def _hf_arrays(self, row: dict[str, Any], location: str, add_generation_prompt: bool = False) -> SampleArrays:
        messages, tools = self._messages(row, location)
        roles = ("system", "user", "assistant", "tool", "ipython", "developer")
        messages = normalize_messages(messages, roles, location, HF_TEMPLATE)
        wants_loss = [m.get("loss", True) for m in messages if m["role"] == "assistant"]
        clean = [{k: v for k, v in m.items() if k != "loss"} for m in messages]
        try:
            out = self.tokenizer.apply_chat_template(
                clean,
                tools=tools,
                tokenize=True,
                return_dict=True,
                add_generation_prompt=add_generation_prompt,
                return_assistant_tokens_mask=True,
                **self.template_kwargs,
            )
        except Exception as exc:  # the template's own raise_exception() or a Jinja error
            raise DataError(f"{location}: the tokenizer's chat_template failed: {exc}") from exc
        ids = list(out["input_ids"])
        mask = np.asarray(out["assistant_masks"], dtype=bool)
        if not all(wants_loss):
            runs = _runs(mask)
            if len(runs) != len(wants_loss):
                raise DataError(
                    f"{location}: 'loss': false needs one {{% generation %}} block per assistant message, but the "
                    f"template produced {len(runs)} blocks for {len(wants_loss)} assistant messages"
                )
            for (a, b), keep in zip(runs, wants_loss):
                if not keep:
                    mask[a:b] = False
        return np.asarray(ids, dtype=np.int64), _first_masked(mask)

    def _extra_modules(self) -> set[str]:
        return {_templates_module.__name__}


class TokenBytes:
    """The UTF-8 bytes of every token id of a byte-level BPE, to find token extents from the ids alone.

    The offsets a tokenizer reports cost about a third of its encode time; for a byte-level BPE they follow from the
    ids: token ``i`` covers the bytes after the tokens before it. :meth:`span_arrays` uses them only when the ids spell
    the text exactly (no normalizer changed it, no added token absorbed whitespace), so the loss mask is the one the
    offsets would give.

    Args:
        flat (np.ndarray): uint8, the bytes of all ids back to back.
        starts (np.ndarray): int64 per id, where its bytes start in ``flat``.
        lengths (np.ndarray): int64 per id, its byte length (-1 for an id without known bytes).
    """

    def __init__(self, flat: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> None:
        self.flat = flat
        self.starts = starts
        self.lengths = lengths

    @classmethod
    def from_tokenizer(cls, backend: Tokenizer) -> TokenBytes | None:
        """Build the table of a ``tokenizers.Tokenizer``.

        Args:
            backend (Tokenizer): The Rust tokenizer.

        Returns:
            TokenBytes | None: The table, or ``None`` unless the model is a BPE behind a ``ByteLevel`` pre-tokenizer
            that adds no prefix space.
        """
        spec = json.loads(backend.to_str())
        if (spec.get("model") or {}).get("type") != "BPE" or not _plain_byte_level(spec.get("pre_tokenizer")):
            return None
        if not _rarely_changes_text(spec.get("normalizer")):
            return None  # a lowercasing/stripping normalizer would send most texts down the slow path twice
        vocab = backend.get_vocab(with_added_tokens=False)
        added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}
        alphabet = _byte_level_alphabet()
        if not set("".join(vocab)) <= alphabet.keys():
            return None  # tokens outside the byte-level alphabet: not a byte-level vocabulary
        size = max([*vocab.values(), *added.keys(), -1]) + 1
        pieces: list[bytes] = [b""] * size
        lengths = np.full(size, -1, dtype=np.int64)
        translate = str.maketrans({ch: chr(b) for ch, b in alphabet.items()})
        for token, i in vocab.items():
            pieces[i] = token.translate(translate).encode("latin-1")
        for i, content in added.items():
            pieces[i] = content.encode("utf-8")
        known = set(vocab.values()) | set(added)
        for i in known:
            lengths[i] = len(pieces[i])
        flat = np.frombuffer(b"".join(pieces), dtype=np.uint8)
        sizes = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=size)
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        return cls(flat, starts, lengths)

    def token_ends(self, ids: np.ndarray, data: bytes) -> np.ndarray | None:
        """End byte of every token in ``data``, or ``None`` unless the ids spell ``data`` exactly.

        Args:
            ids (np.ndarray): int64 token ids.
            data (bytes): The UTF-8 text they were encoded from.

        Returns:
            np.ndarray | None: int64 cumulative byte lengths.
        """
        if len(ids) and (ids.min() < 0 or ids.max() >= len(self.lengths)):
            return None
        lengths = self.lengths[ids]
        if len(ids) and lengths.min() < 0:
            return None
        ends = np.cumsum(lengths)
        total = int(ends[-1]) if len(ends) else 0
        if total != len(data):
            return None
        index = np.repeat(self.starts[ids] - (ends - lengths), lengths) + np.arange(total)
        if not np.array_equal(self.flat[index], np.frombuffer(data, dtype=np.uint8)):
            return None
        return ends

    def span_arrays(self, ids: np.ndarray, text: str, spans: list[tuple[int, int]]) -> SampleArrays | None:
        """Ids and loss mask (a token is supervised when its bytes overlap a span), or ``None`` to fall back.

        Args:
            ids (np.ndarray): int64 token ids of ``text``.
            text (str): The rendered text.
            spans (list[tuple[int, int]]): ``[start, end)`` character spans that receive loss.

        Returns:
            tuple[np.ndarray, np.ndarray] | None: Ids and bool mask (False at position 0).
        """
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates: let the tokenizer's own path report it
            return None
        ends = self.token_ends(ids, data)
        if ends is None:
            return None
        mask = np.zeros(len(ids), dtype=bool)
        if spans:
            bounds = np.asarray(spans, dtype=np.int64)
            if len(data) != len(text):  # non-ASCII: character index -> byte index
                codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
                width = 1 + (codes >= 0x80).astype(np.int64) + (codes >= 0x800) + (codes >= 0x10000)
                bounds = np.concatenate([[0], np.cumsum(width)])[bounds]
            starts = ends - self.lengths[ids]
            first = np.searchsorted(ends, bounds[:, 0], side="right")  # first token ending after the span start
            stop = np.searchsorted(starts, bounds[:, 1], side="left")  # tokens starting before the span end
            for a, b in zip(first.tolist(), stop.tolist()):
                mask[a:b] = True
        return ids, _first_masked(mask)


def _plain_byte_level(pre_tokenizer: dict[str, Any] | None) -> bool:
    if not pre_tokenizer:
        return False
    parts = pre_tokenizer.get("pretokenizers") if pre_tokenizer.get("type") == "Sequence" else [pre_tokenizer]
    levels = [p for p in parts or [] if p.get("type") == "ByteLevel"]
    return bool(levels) and not any(p.get("add_prefix_space") for p in levels)


def _rarely_changes_text(normalizer: dict[str, Any] | None) -> bool:
    if not normalizer:
        return True
    parts = normalizer.get("normalizers") if normalizer.get("type") == "Sequence" else [normalizer]
    return all(p.get("type") in ("NFC", "NFKC") for p in parts or [])


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-to-unicode map, inverted: the character that stands for each byte in a byte-level vocabulary."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """Hash of everything in a tokenizer that changes token ids: its Rust pipeline, special tokens and template.

    Args:
        tokenizer (PreTrainedTokenizerBase): Fast tokenizer.

    Returns:
        str: Hex digest.
    """
    h = xxhash.xxh3_128()
    h.update(tokenizer.backend_tokenizer.to_str().encode())
    h.update(json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str).encode())
    h.update(str(tokenizer.chat_template or "").encode())
    return h.hexdigest()


def arrays_to_item(ids: np.ndarray, mask: np.ndarray) -> DataItem:
    """Turn (ids, loss mask) arrays into a ``DataItem`` (labels -100 where the mask is False, and at position 0).

    Args:
        ids (np.ndarray): Token ids.
        mask (np.ndarray): Boolean loss mask.

    Returns:
        DataItem: The item.
    """
    labels = np.where(mask, ids, IGNORE_INDEX)
    if len(labels):
        labels[0] = IGNORE_INDEX
    return {"input_ids": ids.tolist(), "labels": labels.tolist(), "num_tokens": len(ids)}


def _first_masked(mask: np.ndarray) -> np.ndarray:
    if len(mask):
        mask[0] = False
    return mask


def _span_arrays(enc: Any, spans: list[tuple[int, int]]) -> SampleArrays:
    """Ids and loss mask of an encoding: a token is supervised when it overlaps a loss span."""
    ids = np.asarray(enc.ids, dtype=np.int64)
    mask = np.zeros(len(ids), dtype=bool)
    offsets: np.ndarray | None = None
    for a, b in spans:
        first, last = enc.char_to_token(a), enc.char_to_token(b - 1)
        if first is not None and last is not None:
            mask[first : last + 1] = True
            continue
        if offsets is None:  # characters no token covers (a normalizer dropped them): fall back to offsets
            offsets = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)
        mask |= (offsets[:, 0] < b) & (offsets[:, 1] > a)
    return ids, _first_masked(mask)


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    padded = np.concatenate([[False], mask, [False]]).astype(np.int8)
    edges = np.flatnonzero(np.diff(padded))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2])]


def _special_id(tokenizer: PreTrainedTokenizerBase, token: str | None, what: str) -> int:
    if token is None:
        raise DataError(f"the tokenizer has no {what} token; pass {what.lower()}_token or disable add_{what.lower()}")
    token_id = tokenizer.convert_tokens_to_ids(token)
    if token_id is None or (tokenizer.unk_token_id is not None and token_id == tokenizer.unk_token_id):
        raise DataError(f"{what} token {token!r} is not in the tokenizer vocabulary")
    return int(token_id)
