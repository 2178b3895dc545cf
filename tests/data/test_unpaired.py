"""Unpaired preference data (KTO): row layouts, the mismatched completion, labels as tags, the DataModule."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from xtl.data import (
    IGNORE_INDEX,
    ChatTokenizeFn,
    DataError,
    JsonlSource,
    SourceSpec,
    UnpairedPreferenceTokenizeFn,
    XTLDataModule,
    build_cache,
    tiny_assets_dir,
)
from xtl.data.collate import split_for_context_parallel
from xtl.data.preference import dropped_rows

from .conftest import write_jsonl
from .test_preference import _documents

USER = {"role": "user", "content": "What is 37+45?"}
GOOD = {"role": "assistant", "content": "82"}
BAD = {"role": "assistant", "content": "3745"}


def _row(prompt=(USER,), completion=(GOOD,), label=True) -> dict:
    return {"prompt": list(prompt), "completion": list(completion), "label": label}


def _rows(n: int) -> list[dict]:
    return [
        _row(
            [{"role": "user", "content": f"Question {i}?"}],
            [{"role": "assistant", "content": f"Answer {i}"}],
            i % 3 == 0,
        )
        for i in range(n)
    ]


def _arrays(fn: UnpairedPreferenceTokenizeFn, rows: list[dict]) -> list[list[tuple]]:
    return fn.batch_arrays(rows, lambda i: f"rows.jsonl:{i + 1}")


def _chat(tokenizer, messages: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    ((ids, mask),) = ChatTokenizeFn(tokenizer).batch_arrays([{"messages": messages}], str)[0]
    return ids, mask


def _equal(sample: tuple, expected: tuple) -> bool:
    return np.array_equal(sample[0], expected[0]) and np.array_equal(sample[1], expected[1])


class TestLayouts:
    def test_each_row_is_its_sample_and_a_mismatched_one(self, qwen_tokenizer):
        rows = _rows(3)
        out = _arrays(UnpairedPreferenceTokenizeFn(qwen_tokenizer), rows)
        for i, row in enumerate(rows):
            (matched, mismatched) = out[i]
            previous = rows[i - 1]["completion"]  # row 0 takes the last row's completion
            assert _equal(matched, _chat(qwen_tokenizer, row["prompt"] + row["completion"]))
            assert _equal(mismatched, _chat(qwen_tokenizer, row["prompt"] + previous))
            assert matched[2] == mismatched[2] == int(row["label"])

    def test_string_layout(self, qwen_tokenizer):
        fn = UnpairedPreferenceTokenizeFn(qwen_tokenizer)
        strings = _arrays(fn, [{"prompt": USER["content"], "completion": GOOD["content"], "label": False}])
        (conversational,) = _arrays(fn, [_row(label=False)])
        assert all(_equal(a, b) and a[2] == b[2] == 0 for a, b in zip(strings[0], conversational))

    def test_a_preference_pair_is_unpaired(self, qwen_tokenizer):
        fn = UnpairedPreferenceTokenizeFn(qwen_tokenizer)
        (samples,) = _arrays(fn, [{"prompt": [USER], "chosen": [GOOD], "rejected": [BAD]}])
        good, good_kl, bad, bad_kl = samples
        assert [s[2] for s in samples] == [1, 1, 0, 0]
        assert _equal(good, _chat(qwen_tokenizer, [USER, GOOD])) and _equal(bad, _chat(qwen_tokenizer, [USER, BAD]))
        assert _equal(good_kl, bad) and _equal(bad_kl, good)  # each mismatched with the other row's completion

    def test_prompt_assistant_turns_are_not_supervised(self, qwen_tokenizer):
        prompt = [USER, {"role": "assistant", "content": "Let me think."}, {"role": "user", "content": "Well?"}]
        ((matched, _),) = _arrays(UnpairedPreferenceTokenizeFn(qwen_tokenizer), [_row(prompt)])
        masked = [USER, {**prompt[1], "loss": False}, prompt[2], GOOD]
        assert _equal(matched[:2], _chat(qwen_tokenizer, masked))


BAD_ROWS = [
    ({"prompt": [USER], "completion": [GOOD]}, "no 'label'"),
    (_row(label="yes"), "'label' is 'yes'; it must be true"),
    (_row(label=1), "'label' is 1; it must be true"),
    (_row(completion=[]), "'completion' is empty"),
    ({"completion": [GOOD], "label": True}, "no 'prompt'"),
    (_row(completion=[{"role": "user", "content": "Hm?"}]), "has no supervised token"),
]


class TestBadRows:
    @staticmethod
    def _file(tmp_path: Path, bad: dict) -> Path:
        return write_jsonl(tmp_path / "rows.jsonl", [*_rows(2), bad, *_rows(1)])  # the bad row is line 3

    @pytest.mark.parametrize(("bad", "message"), BAD_ROWS)
    def test_error_names_file_and_line(self, qwen_tokenizer, tmp_path, bad, message):
        path = self._file(tmp_path, bad)
        fn = UnpairedPreferenceTokenizeFn(qwen_tokenizer)
        with pytest.raises(DataError, match=re.escape(f"{path}:3: ") + ".*" + re.escape(message) + ".*bad_rows: drop"):
            build_cache(JsonlSource(path), fn, tmp_path / "cache", progress=False)

    @pytest.mark.parametrize(("bad", "message"), BAD_ROWS)
    def test_drop_skips_and_counts(self, qwen_tokenizer, tmp_path, bad, message):
        fn = UnpairedPreferenceTokenizeFn(qwen_tokenizer, bad_rows="drop")
        cache = build_cache(JsonlSource(self._file(tmp_path, bad)), fn, tmp_path / "cache", progress=False)
        assert cache.rows.tolist() == [0, 0, 1, 1, 3, 3] and dropped_rows(cache) == 1
        assert cache.tags.tolist() == [1, 1, 0, 0, 1, 1]

    def test_malformed_rows_raise_even_with_drop(self, qwen_tokenizer):
        with pytest.raises(DataError, match=re.escape("k.jsonl:7: 'prompt' is a str and 'completion' a list")):
            UnpairedPreferenceTokenizeFn(qwen_tokenizer, bad_rows="drop")({**_row(), "prompt": "Hi?"}, "k.jsonl:7")


class TestCache:
    def test_tags_are_stored_and_read_back(self, qwen_tokenizer, tmp_path):
        path = write_jsonl(tmp_path / "rows.jsonl", _rows(7))
        fn = UnpairedPreferenceTokenizeFn(qwen_tokenizer)
        built = build_cache(JsonlSource(path), fn, tmp_path / "cache", progress=False)
        warm = build_cache(JsonlSource(path), fn, tmp_path / "cache", progress=False)
        expected = [int(i % 3 == 0) for i in range(7) for _ in range(2)]
        assert built.tags.tolist() == warm.tags.tolist() == expected
        (built.directory / "tags.npy").write_bytes(b"broken")  # an entry with a damaged tag file is rebuilt
        assert build_cache(JsonlSource(path), fn, tmp_path / "cache", progress=False).tags.tolist() == expected

    def test_untagged_kinds_have_no_tags(self, qwen_tokenizer, tmp_path):
        path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [USER, GOOD]}])
        cache = build_cache(JsonlSource(path), ChatTokenizeFn(qwen_tokenizer), tmp_path / "cache", progress=False)
        assert cache.tags is None and not (cache.directory / "tags.npy").exists()


def _dm(cache_dir: Path, **overrides) -> XTLDataModule:
    kwargs = {
        "sources": [SourceSpec("tiny:kto_train.jsonl", kind="unpaired_preference", sample_ratio=0.1)],
        "tokenizer": "tiny:",
        "pack_max_length": 256,
        "micro_batches_per_step": 2,
        "seed": 5,
        "cache_dir": str(cache_dir),
        "progress": False,
    }
    return XTLDataModule(**{**kwargs, **overrides})


class TestDataModule:
    def test_documents_carry_their_rows_labels(self, tmp_path):
        dm = _dm(tmp_path)
        dm.setup("fit")
        rows = [json.loads(x) for x in (tiny_assets_dir() / "kto_train.jsonl").read_text().splitlines()]
        label_of = {(r["prompt"][-1]["content"], r["completion"][0]["content"]): r["label"] for r in rows}
        tokenizer, labels, same = dm.load_tokenizer(), [], 0
        for mb in (mb for step in dm.train_dataloader() for mb in step):
            docs = _documents(mb)
            assert mb.doc_tags is not None and len(mb.doc_tags) == len(docs) and len(docs) % 2 == 0
            assert split_for_context_parallel(mb, 1, 2).doc_tags == mb.doc_tags
            for j in range(0, len(docs), 2):
                (ids, targets), (kl_ids, _) = docs[j], docs[j + 1]
                start = int(np.flatnonzero(targets != IGNORE_INDEX)[0])
                assert np.array_equal(ids[: start + 1], kl_ids[: start + 1])  # one prompt, two completions
                user = re.findall(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", tokenizer.decode(ids[:start].tolist()))
                answer = tokenizer.decode(targets[targets != IGNORE_INDEX].tolist())
                answer = answer.removesuffix("<|im_end|>").split("</think>\n\n")[-1]
                assert label_of[user[-1], answer] == bool(mb.doc_tags[j]) == bool(mb.doc_tags[j + 1])
                same += np.array_equal(ids, kl_ids)  # the previous row's completion may be the same text
                labels.append(mb.doc_tags[j])
        assert len(labels) == 600 and 0 < sum(labels) < 600 and same < 60

    def test_a_set_is_one_kind(self, tmp_path):
        mixed = [
            SourceSpec("tiny:kto_train.jsonl", kind="unpaired_preference"),
            SourceSpec("tiny:preference_train.jsonl", kind="preference"),
        ]
        with pytest.raises(DataError, match="data.sources mixes kind: preference with kind: unpaired_preference"):
            _dm(tmp_path, sources=mixed).setup()
        with pytest.raises(DataError, match="packing: hard cuts documents"):
            _dm(tmp_path, packing="hard").setup()
