"""Raw sources: JSONL offset table and errors, Hugging Face datasets on disk and parquet."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import xtl.data.sources as sources_module
from xtl.data import DataError, DataFileNotFoundError, HFSource, JsonlSource, SourceSpec, hash_file, open_source
from xtl.data.sources import FileHashMemo

from .conftest import write_jsonl


class TestJsonlSource:
    def test_rows_skip_blank_lines_and_keep_line_numbers(self, tmp_path):
        path = tmp_path / "a.jsonl"
        path.write_bytes(b'{"text": "one"}\n\n{"text": "tw\xc3\xb6"}\r\n\r\n{"text": "three"}')
        src = JsonlSource(path)
        assert len(src) == 3
        assert [r["text"] for r in src.rows(0, 3)] == ["one", "twö", "three"]
        assert [src.location(i) for i in range(3)] == [f"{path}:1", f"{path}:3", f"{path}:5"]

    def test_malformed_line_names_file_and_line(self, tmp_path):
        path = tmp_path / "bad.jsonl"
        path.write_text('{"text": "ok"}\n{"text": "unterminated}\n')
        src = JsonlSource(path)
        with pytest.raises(
            DataError, match=rf"{path}:2: malformed JSON \(Unterminated string .*column 10\).*fix or delete"
        ):
            src.row(1)

    def test_non_object_line(self, tmp_path):
        path = write_jsonl(tmp_path / "list.jsonl", [{"text": "a"}, ["not", "an", "object"]])
        with pytest.raises(DataError, match=rf"{path}:2: expected a JSON object per line, got list"):
            JsonlSource(path).row(1)

    def test_missing_file(self, tmp_path):
        with pytest.raises(DataFileNotFoundError, match=r"data source .*nope.jsonl does not exist .*fix the `path`"):
            open_source(SourceSpec(str(tmp_path / "nope.jsonl")))

    def test_fingerprint_follows_content(self, tmp_path):
        path = write_jsonl(tmp_path / "a.jsonl", [{"text": "a"}])
        first = JsonlSource(path).fingerprint()
        assert JsonlSource(path).fingerprint() == first
        write_jsonl(path, [{"text": "b"}])
        assert JsonlSource(path).fingerprint() != first

    def test_empty_file(self, tmp_path):
        path = tmp_path / "empty.jsonl"
        path.write_text("")
        assert len(JsonlSource(path)) == 0


class TestHFSource:
    def test_save_to_disk_and_parquet(self, tmp_path):
        import datasets

        records = [{"text": f"doc {i}"} for i in range(5)]
        ds = datasets.Dataset.from_list(records)
        ds.save_to_disk(str(tmp_path / "disk"))
        ds.to_parquet(str(tmp_path / "data.parquet"))
        for spec in (SourceSpec(str(tmp_path / "disk")), SourceSpec(str(tmp_path / "data.parquet"))):
            src = open_source(spec, hf_cache_dir=tmp_path / "hf")
            assert isinstance(src, HFSource)
            assert src.rows(0, 5) == records
            assert src.location(3).endswith("[row 3]")
            assert len(src.fingerprint()) == 32

    def test_dataset_dict_needs_split(self, tmp_path):
        import datasets

        dd = datasets.DatasetDict(
            {"train": datasets.Dataset.from_list([{"text": "a"}]), "test": datasets.Dataset.from_list([{"text": "b"}])}
        )
        dd.save_to_disk(str(tmp_path / "dd"))
        with pytest.raises(DataError, match=r"DatasetDict with splits \['test', 'train'\]; set `split`"):
            open_source(SourceSpec(str(tmp_path / "dd")))
        assert open_source(SourceSpec(str(tmp_path / "dd"), split="test")).rows(0, 1) == [{"text": "b"}]

    def test_unknown_suffix(self, tmp_path):
        (tmp_path / "x.txt").write_text("hi")
        with pytest.raises(DataError, match="cannot tell the format .* set `format`"):
            open_source(SourceSpec(str(tmp_path / "x.txt")))


def _shift_mtime(path: Path, seconds: int) -> None:
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + seconds * 10**9))


class TestFileHashMemo:
    def test_unchanged_file_is_not_read_again(self, tmp_path):
        path = write_jsonl(tmp_path / "a.jsonl", [{"text": f"row {i}"} for i in range(100)])
        first = FileHashMemo(tmp_path / "fp", settle_seconds=0)
        digest = first.hash(path)
        assert digest == hash_file(path) and first.full_hashes == 1
        warm = FileHashMemo(tmp_path / "fp", settle_seconds=0)  # a new run
        assert warm.hash(path) == digest and warm.full_hashes == 0

    def test_touched_file_is_hashed_in_full_and_keeps_its_fingerprint(self, tmp_path):
        path = write_jsonl(tmp_path / "a.jsonl", [{"text": "a"}])
        digest = FileHashMemo(tmp_path / "fp", settle_seconds=0).hash(path)
        _shift_mtime(path, -5)
        touched = FileHashMemo(tmp_path / "fp", settle_seconds=0)
        assert touched.hash(path) == digest and touched.full_hashes == 1
        again = FileHashMemo(tmp_path / "fp", settle_seconds=0)
        assert again.hash(path) == digest and again.full_hashes == 0, "the new signature was remembered"

    def test_same_size_edit_with_restored_mtime_is_detected(self, tmp_path):
        path = write_jsonl(tmp_path / "a.jsonl", [{"text": "aaaa"}])
        digest = FileHashMemo(tmp_path / "fp", settle_seconds=0).hash(path)
        st = path.stat()
        write_jsonl(path, [{"text": "bbbb"}])
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # size and mtime as before; ctime moved
        memo = FileHashMemo(tmp_path / "fp", settle_seconds=0)
        assert memo.hash(path) == hash_file(path) != digest and memo.full_hashes == 1

    def test_sampled_blocks_catch_a_change_the_signature_misses(self, tmp_path, monkeypatch):
        path = tmp_path / "big.jsonl"
        path.write_bytes(b"x" * (1 << 20))
        monkeypatch.setattr(sources_module, "_signature", lambda p: [1, 2, 3, 4])  # a file system that lies
        digest = FileHashMemo(tmp_path / "fp", settle_seconds=0).hash(path)
        data = bytearray(path.read_bytes())
        data[len(data) // 2] = ord("y")  # inside the middle block
        path.write_bytes(bytes(data))
        memo = FileHashMemo(tmp_path / "fp", settle_seconds=0)
        assert memo.hash(path) != digest and memo.full_hashes == 1

    def test_recent_change_is_not_remembered(self, tmp_path):
        path = write_jsonl(tmp_path / "a.jsonl", [{"text": "a"}])
        FileHashMemo(tmp_path / "fp", settle_seconds=3600).hash(path)
        memo = FileHashMemo(tmp_path / "fp", settle_seconds=3600)
        memo.hash(path)
        assert memo.full_hashes == 1 and not list((tmp_path / "fp").glob("*.json"))

    def test_jsonl_source_uses_the_memo(self, tmp_path):
        path = write_jsonl(tmp_path / "a.jsonl", [{"text": "a"}])
        memo = FileHashMemo(tmp_path / "fp", settle_seconds=0)
        assert JsonlSource(path, hash_memo=memo).fingerprint() == JsonlSource(path).fingerprint()
        assert JsonlSource(path, hash_memo=memo).fingerprint() and memo.full_hashes == 1
