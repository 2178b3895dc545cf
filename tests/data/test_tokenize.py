"""Tokenize functions: pretraining text (BOS/EOS, chunking) and chat records."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from xtl.data import IGNORE_INDEX, ChatTokenizeFn, DataError, PretrainTokenizeFn
from xtl.data.tokenize import TokenBytes, _span_arrays

from .conftest import CORPUS, sft_records

TEXT = "The quick brown fox jumps over the lazy dog. " * 6


class TestPretrainTokenizeFn:
    def test_eos_policy_and_first_label(self, llama_tokenizer):
        fn = PretrainTokenizeFn(llama_tokenizer)
        (item,) = fn({"text": TEXT})
        body = llama_tokenizer(TEXT, add_special_tokens=False)["input_ids"]
        bos, eos = llama_tokenizer.bos_token_id, llama_tokenizer.eos_token_id
        assert item["input_ids"] == [bos] + body + [eos]
        assert item["labels"] == [IGNORE_INDEX] + body + [eos]
        assert item["num_tokens"] == len(body) + 2

    def test_no_bos_token_means_no_bos(self, qwen_tokenizer):
        fn = PretrainTokenizeFn(qwen_tokenizer, eos_token="<|endoftext|>")
        (item,) = fn({"text": "hello world"})
        body = qwen_tokenizer("hello world", add_special_tokens=False)["input_ids"]
        assert item["input_ids"] == body + [qwen_tokenizer.convert_tokens_to_ids("<|endoftext|>")]
        assert item["labels"][0] == IGNORE_INDEX and item["labels"][1:] == item["input_ids"][1:]

    def test_chunks_bos_first_eos_last_overlap_masked(self, llama_tokenizer):
        fn = PretrainTokenizeFn(llama_tokenizer, chunk_size=16, chunk_overlap=4)
        (full,) = PretrainTokenizeFn(llama_tokenizer)({"text": TEXT})
        chunks = fn({"text": TEXT})
        assert len(chunks) > 2
        bos, eos = llama_tokenizer.bos_token_id, llama_tokenizer.eos_token_id
        ids = full["input_ids"]
        rebuilt, supervised = list(chunks[0]["input_ids"]), list(chunks[0]["labels"])
        for chunk in chunks[1:]:
            assert chunk["input_ids"][:4] == rebuilt[-4:]
            assert chunk["labels"][:4] == [IGNORE_INDEX] * 4
            rebuilt += chunk["input_ids"][4:]
            supervised += chunk["labels"][4:]
        assert rebuilt == ids and supervised == full["labels"]  # every token trained exactly once
        assert all(len(c["input_ids"]) <= 16 for c in chunks)
        assert [c["input_ids"].count(bos) for c in chunks] == [1] + [0] * (len(chunks) - 1)
        assert [c["input_ids"].count(eos) for c in chunks] == [0] * (len(chunks) - 1) + [1]

    def test_missing_text_key(self, qwen_tokenizer):
        fn = PretrainTokenizeFn(qwen_tokenizer)
        with pytest.raises(DataError, match=r"c.jsonl:9: no 'text' key \(keys: \['content'\]\).*set `text_key`"):
            fn({"content": "x"}, "c.jsonl:9")

    def test_bad_chunk_arguments(self, qwen_tokenizer):
        with pytest.raises(DataError, match="chunk_overlap must be in"):
            PretrainTokenizeFn(qwen_tokenizer, chunk_size=8, chunk_overlap=7)

    def test_fingerprint_changes_with_arguments(self, qwen_tokenizer):
        a = PretrainTokenizeFn(qwen_tokenizer).fingerprint()
        assert PretrainTokenizeFn(qwen_tokenizer).fingerprint() == a
        assert PretrainTokenizeFn(qwen_tokenizer, chunk_size=64).fingerprint() != a
        assert ChatTokenizeFn(qwen_tokenizer).fingerprint() != a


class TestChatTokenizeFn:
    def test_batch_equals_single(self, qwen_tokenizer):
        fn = ChatTokenizeFn(qwen_tokenizer, template="qwen3")
        rows = [
            {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
            for i in range(5)
        ]
        batch = fn.batch([rows[0], None, *rows[1:]], lambda i: f"x:{i}")
        assert batch[1] == []
        assert [b for b in batch if b] == [fn(r) for r in rows]


def _offset_path(fn: ChatTokenizeFn, rendered) -> list:
    encodings = fn._backend.encode_batch([r.text for r in rendered], add_special_tokens=False)
    return [_span_arrays(enc, r.loss_spans) for enc, r in zip(encodings, rendered)]


class TestTokenBytes:
    def test_fast_path_equals_tokenizer_offsets(self, qwen_tokenizer):
        fn = ChatTokenizeFn(qwen_tokenizer, template="qwen3")
        table = fn._byte_table()
        assert table is not None, "a byte-level BPE takes the fast path"
        rows = sft_records(30) + [
            {"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": text[::-1]}]}
            for text in CORPUS  # CJK, accents, emoji, tabs: multi-byte characters on both sides of the spans
        ]
        rendered = [fn.render(r) for r in rows]
        for r, (ids, mask) in zip(rendered, fn._encode_rendered(rendered)):
            fast = table.span_arrays(ids, r.text, r.loss_spans)
            assert fast is not None, "the ids spell the text, so no fallback"
            assert np.array_equal(fast[1], mask)
        for (ids, mask), (ref_ids, ref_mask) in zip(fn._encode_rendered(rendered), _offset_path(fn, rendered)):
            assert np.array_equal(ids, ref_ids) and np.array_equal(mask, ref_mask)

    def test_text_changed_by_a_normalizer_falls_back_to_offsets(self, qwen_tokenizer):
        tok = copy.deepcopy(qwen_tokenizer)
        tok.backend_tokenizer.normalizer = normalizers.NFC()
        fn = ChatTokenizeFn(tok, template="qwen3")
        row = {
            "messages": [{"role": "user", "content": "cafe\u0301?"}, {"role": "assistant", "content": "cafe\u0301!"}]
        }
        rendered = fn.render(row)
        ids = np.asarray(fn._backend.encode_batch_fast([rendered.text], add_special_tokens=False)[0].ids)
        assert fn._byte_table().span_arrays(ids, rendered.text, rendered.loss_spans) is None
        (got,), (ref,) = fn._encode_rendered([rendered]), _offset_path(fn, [rendered])
        assert np.array_equal(got[0], ref[0]) and np.array_equal(got[1], ref[1]) and got[1].any()

    def test_only_plain_byte_level_bpe_gets_a_table(self, qwen_tokenizer):
        assert TokenBytes.from_tokenizer(qwen_tokenizer.backend_tokenizer) is not None
        lowercase = copy.deepcopy(qwen_tokenizer).backend_tokenizer
        lowercase.normalizer = normalizers.Lowercase()
        assert TokenBytes.from_tokenizer(lowercase) is None
        word_level = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
        word_level.pre_tokenizer = pre_tokenizers.Whitespace()
        assert TokenBytes.from_tokenizer(word_level) is None
