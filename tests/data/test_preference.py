"""Preference data: row layouts, bad rows, pairs kept whole by mixing and packing, the DataModule end to end."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import numpy as np
import pytest

import xtl.data.datamodule as datamodule_module
from xtl.data import (
    IGNORE_INDEX,
    ChatTokenizeFn,
    DataError,
    JsonlSource,
    MicroBatch,
    MixedDataset,
    PreferenceTokenizeFn,
    SourceSpec,
    TokenizedCache,
    XTLDataModule,
    best_fit_pack,
    build_cache,
    check_pair_plan,
    open_source,
    tiny_assets_dir,
)
from xtl.data.preference import dropped_rows

from .conftest import write_jsonl

SYSTEM = {"role": "system", "content": "Be brief."}
USER = {"role": "user", "content": "What is 37+45?"}
CHOSEN = {"role": "assistant", "content": "The answer is 82."}
REJECTED = {"role": "assistant", "content": "The answer is 81, I think."}


def _row(prompt=(SYSTEM, USER), chosen=(CHOSEN,), rejected=(REJECTED,)) -> dict:
    return {"prompt": list(prompt), "chosen": list(chosen), "rejected": list(rejected)}


def _good_rows(n: int, seed: int = 0) -> list[dict]:
    """Explicit-layout rows of varied length."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        words = " ".join(["alpha", "beta", "gamma"][int(k)] for k in rng.integers(0, 3, int(rng.integers(1, 30))))
        rows.append(
            _row(
                prompt=[{"role": "user", "content": f"Question {i}: {words}?"}],
                chosen=[{"role": "assistant", "content": f"Right {i}: {words[::-1]}"}],
                rejected=[{"role": "assistant", "content": f"Wrong {i}" + " delta" * int(rng.integers(0, 20))}],
            )
        )
    return rows


def _same(item: dict, reference: dict) -> bool:
    return item["input_ids"] == reference["input_ids"] and item["labels"] == reference["labels"]


def _fake_cache(lengths: list[int], rows: list[int]) -> TokenizedCache:
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    total = int(offsets[-1])
    return TokenizedCache(
        Path("/nonexistent/fake"),
        np.zeros(total, dtype=np.int32),
        np.zeros(total, dtype=np.uint8),
        offsets,
        np.asarray(rows, dtype=np.int64),
        {"num_rows": max(rows, default=-1) + 1},
    )


class TestLayouts:
    def test_explicit_conversational_is_two_sft_samples(self, qwen_tokenizer):
        chat = ChatTokenizeFn(qwen_tokenizer)
        chosen, rejected = PreferenceTokenizeFn(qwen_tokenizer)(_row())
        assert _same(chosen, chat({"messages": [SYSTEM, USER, CHOSEN]})[0])
        assert _same(rejected, chat({"messages": [SYSTEM, USER, REJECTED]})[0])
        prompt_len = len(chat.encode({"messages": [SYSTEM, USER]}, add_generation_prompt=False)["input_ids"])
        for item in (chosen, rejected):  # only the response is supervised, and some of it is
            assert set(item["labels"][:prompt_len]) == {IGNORE_INDEX}
            assert any(t != IGNORE_INDEX for t in item["labels"][prompt_len:])

    def test_multi_turn_response(self, qwen_tokenizer):
        chosen_turns = [CHOSEN, {"role": "user", "content": "Sure?"}, {"role": "assistant", "content": "Yes, 82."}]
        chosen, rejected = PreferenceTokenizeFn(qwen_tokenizer)(_row(chosen=chosen_turns))
        chat = ChatTokenizeFn(qwen_tokenizer)
        assert _same(chosen, chat({"messages": [SYSTEM, USER, *chosen_turns]})[0])
        assert _same(rejected, chat({"messages": [SYSTEM, USER, REJECTED]})[0])

    def test_assistant_turns_of_the_prompt_are_not_supervised(self, qwen_tokenizer):
        prompt = [USER, {"role": "assistant", "content": "Let me think."}, {"role": "user", "content": "Well?"}]
        chosen, _ = PreferenceTokenizeFn(qwen_tokenizer)(_row(prompt=prompt))
        chat = ChatTokenizeFn(qwen_tokenizer)
        masked_prompt = [USER, {**prompt[1], "loss": False}, prompt[2]]
        assert _same(chosen, chat({"messages": [*masked_prompt, CHOSEN]})[0])
        as_sft = chat({"messages": [*prompt, CHOSEN]})[0]
        assert chosen["input_ids"] == as_sft["input_ids"] and chosen["labels"] != as_sft["labels"]

    def test_implicit_prompt_is_the_common_prefix(self, qwen_tokenizer):
        fn = PreferenceTokenizeFn(qwen_tokenizer)
        prompt = [SYSTEM, USER, {"role": "assistant", "content": "Hmm."}, {"role": "user", "content": "Well?"}]
        implicit = fn({"chosen": [*prompt, CHOSEN], "rejected": [*prompt, REJECTED]})
        explicit = fn(_row(prompt=prompt))
        assert len(implicit) == 2 and all(_same(a, b) for a, b in zip(implicit, explicit))
        sft = ChatTokenizeFn(qwen_tokenizer)({"messages": [*prompt, CHOSEN]})[0]
        assert implicit[0]["labels"] != sft["labels"], "the shared assistant turn belongs to the prompt"

    def test_string_layout(self, qwen_tokenizer):
        fn = PreferenceTokenizeFn(qwen_tokenizer)
        strings = fn({"prompt": USER["content"], "chosen": CHOSEN["content"], "rejected": REJECTED["content"]})
        assert len(strings) == 2 and all(_same(a, b) for a, b in zip(strings, fn(_row(prompt=[USER]))))

    def test_tools_reach_both_sides(self, qwen_tokenizer):
        tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
        chosen, rejected = PreferenceTokenizeFn(qwen_tokenizer)({**_row(), "tools": tools})
        chat = ChatTokenizeFn(qwen_tokenizer)
        assert _same(chosen, chat({"messages": [SYSTEM, USER, CHOSEN], "tools": tools})[0])
        assert _same(rejected, chat({"messages": [SYSTEM, USER, REJECTED], "tools": tools})[0])

    def test_hf_dataset_rows(self, qwen_tokenizer, tmp_path):
        import datasets

        rows = [_row(), {"prompt": "Hi?", "chosen": "Hello.", "rejected": "Go away."}]
        datasets.Dataset.from_list(rows[:1]).save_to_disk(tmp_path / "conv")
        datasets.Dataset.from_list(rows[1:]).save_to_disk(tmp_path / "str")
        fn = PreferenceTokenizeFn(qwen_tokenizer)
        for name, row in zip(["conv", "str"], rows):
            cache = build_cache(open_source(SourceSpec(str(tmp_path / name))), fn, tmp_path / "cache", progress=False)
            assert len(cache) == 2 and cache.rows.tolist() == [0, 0]
            assert all(_same(cache.item(i), item) for i, item in enumerate(fn(row)))


BAD_ROWS = [
    ({"prompt": [USER], "chosen": [CHOSEN]}, "no 'rejected'"),
    (_row(chosen=[]), "'chosen' is empty"),
    ({"prompt": "Hi?", "chosen": "Hello.", "rejected": ""}, "'rejected' is empty"),
    (_row(rejected=[CHOSEN]), "'chosen' and 'rejected' render to the same tokens"),
    ({"chosen": [USER, CHOSEN], "rejected": [USER, CHOSEN]}, "'chosen' and 'rejected' are identical"),
    ({"chosen": [USER, CHOSEN], "rejected": [USER, CHOSEN, USER]}, "'chosen' adds no message after the prompt"),
    (_row(chosen=[{**CHOSEN, "loss": False}]), "the 'chosen' response has no supervised token"),
    (_row(rejected=[{"role": "user", "content": "No."}]), "the 'rejected' response has no supervised token"),
]


class TestBadRows:
    @staticmethod
    def _file(tmp_path: Path, bad: dict) -> Path:
        good = _good_rows(3)
        path = tmp_path / "pairs.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in good[:2]) + "\n" + json.dumps(bad) + "\n")
        with path.open("a") as f:
            f.write(json.dumps(good[2]) + "\n")
        return path  # the bad row is line 4 (row 2: line 3 is blank)

    @pytest.mark.parametrize(("bad", "message"), BAD_ROWS)
    def test_error_names_file_and_line(self, qwen_tokenizer, tmp_path, bad, message):
        path = self._file(tmp_path, bad)
        with pytest.raises(DataError, match=re.escape(f"{path}:4: ") + ".*" + re.escape(message) + ".*bad_rows: drop"):
            build_cache(JsonlSource(path), PreferenceTokenizeFn(qwen_tokenizer), tmp_path / "cache", progress=False)

    @pytest.mark.parametrize(("bad", "message"), BAD_ROWS)
    def test_drop_skips_and_counts(self, qwen_tokenizer, tmp_path, bad, message):
        path = self._file(tmp_path, bad)
        fn = PreferenceTokenizeFn(qwen_tokenizer, bad_rows="drop")
        cache = build_cache(JsonlSource(path), fn, tmp_path / "cache", progress=False)
        assert cache.rows.tolist() == [0, 0, 1, 1, 3, 3] and dropped_rows(cache) == 1

    @pytest.mark.parametrize(
        ("row", "message"),
        [
            ({"prompt": "Hi?", "chosen": [CHOSEN], "rejected": [REJECTED]}, "a string 'prompt' needs string"),
            ({"chosen": "Hello.", "rejected": "Bye."}, "string 'chosen'/'rejected' need a 'prompt' string"),
            (_row(chosen=[{"role": "bot", "content": "x"}]), r"\(chosen\): message 2 has unknown role 'bot'"),
        ],
    )
    def test_malformed_rows_raise_even_with_drop(self, qwen_tokenizer, row, message):
        with pytest.raises(DataError, match=re.escape("p.jsonl:7") + ".*" + message):
            PreferenceTokenizeFn(qwen_tokenizer, bad_rows="drop")(row, "p.jsonl:7")

    def test_policy_is_part_of_the_cache_key(self, qwen_tokenizer):
        drop, error = PreferenceTokenizeFn(qwen_tokenizer, bad_rows="drop"), PreferenceTokenizeFn(qwen_tokenizer)
        assert drop.fingerprint() != error.fingerprint()
        with pytest.raises(DataError, match="bad_rows must be 'error' or 'drop'"):
            PreferenceTokenizeFn(qwen_tokenizer, bad_rows="skip")  # type: ignore[arg-type]


def _pair_lengths(n: int, seed: int = 0, high: int = 500) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(4.5, 0.8, 2 * n).astype(np.int64), 5, high)


def _assert_whole_pairs(plan, lengths: np.ndarray) -> None:
    """Independent of check_pair_plan: walk every pack."""
    for p in range(len(plan)):
        a, b = int(plan.pack_offsets[p]), int(plan.pack_offsets[p + 1])
        samples = plan.seg_sample[a:b].tolist()
        assert len(samples) % 2 == 0, f"pack {p} holds half a pair"
        for chosen, rejected in zip(samples[0::2], samples[1::2]):
            assert chosen % 2 == 0 and rejected == chosen + 1, f"pack {p}: {samples}"
        assert (plan.seg_start[a:b] == 0).all() and np.array_equal(plan.seg_end[a:b], lengths[samples])


class TestPairPacking:
    def test_pairs_are_units_chosen_then_rejected(self):
        lengths = _pair_lengths(600)
        plan = best_fit_pack(lengths, 1024, seed=3, overlong="error", pairs=True)
        _assert_whole_pairs(plan, lengths)
        check_pair_plan(plan, lengths)
        assert sorted(plan.seg_sample.tolist()) == list(range(len(lengths)))
        assert (plan.pack_tokens() <= 1024).all() and plan.fill_ratio() > 0.9
        assert np.diff(plan.pack_offsets).max() >= 6, "packs hold several pairs"
        assert plan.pairs and plan.report()["pairs"] == 600 and plan.report()["dropped_overlong_pairs"] == 0

    def test_sample_packing_would_split_pairs(self):
        lengths = _pair_lengths(600)
        with pytest.raises(DataError, match="packs hold whole pairs|stand where a pair"):
            check_pair_plan(best_fit_pack(lengths, 1024, seed=3), lengths)

    def test_deterministic_from_seed(self):
        lengths = _pair_lengths(300)
        a, b = (best_fit_pack(lengths, 512, seed=1, pairs=True) for _ in range(2))
        c = best_fit_pack(lengths, 512, seed=2, pairs=True)
        assert np.array_equal(a.seg_sample, b.seg_sample) and np.array_equal(a.pack_offsets, b.pack_offsets)
        assert not np.array_equal(a.seg_sample, c.seg_sample)

    def test_overlong_pair_errors_with_its_location(self):
        lengths = np.array([30, 40, 300, 250, 20, 10], dtype=np.int64)  # pair 1 fits side by side, not as a pair
        with pytest.raises(DataError, match=r"^rows.jsonl:11: preference pair of 550 tokens .*pack_max_length=512"):
            best_fit_pack(lengths, 512, overlong="error", pairs=True, locate=lambda k: f"rows.jsonl:{10 + k}")

    @pytest.mark.parametrize("overlong", ["drop", "truncate"])
    def test_overlong_pair_is_dropped_whole(self, overlong):
        lengths = np.array([30, 40, 300, 250, 20, 10], dtype=np.int64)
        plan = best_fit_pack(lengths, 512, overlong=overlong, pairs=True)
        assert sorted(plan.seg_sample.tolist()) == [0, 1, 4, 5] and plan.num_truncated == 0
        assert plan.report()["dropped_overlong_pairs"] == 1 and plan.num_dropped == 2
        _assert_whole_pairs(plan, lengths)

    def test_odd_sample_count(self):
        with pytest.raises(DataError, match="odd number of samples"):
            best_fit_pack(np.array([3, 4, 5]), 64, pairs=True)


class TestPairRatio:
    @pytest.mark.parametrize("ratio", [0.3, 0.5, 1.0, 1.7, 2.0])
    def test_ratio_keeps_whole_pairs(self, ratio):
        rng = np.random.default_rng(0)
        first = _fake_cache(rng.integers(1, 50, 100).tolist(), np.repeat(np.arange(50), 2).tolist())
        second = _fake_cache(rng.integers(1, 50, 40).tolist(), np.repeat(np.arange(20), 2).tolist())
        data = MixedDataset([first, second], [ratio, 0.5], seed=4, pairs=True)
        samples, sources = data.sample_ids, data.source_ids
        assert len(data) == 2 * (round(50 * ratio) + 10)
        assert (samples[0::2] % 2 == 0).all() and np.array_equal(samples[1::2], samples[0::2] + 1)
        assert np.array_equal(sources[0::2], sources[1::2])
        kept = samples[0::2][sources[0::2] == 0] // 2
        assert len(np.unique(kept)) == min(50, round(50 * ratio))

    def test_cache_without_pairs_is_refused(self):
        with pytest.raises(DataError, match="does not hold chosen/rejected pairs"):
            MixedDataset([_fake_cache([3, 4, 5, 6], [0, 1, 2, 3])], [1.0], pairs=True)


class TestMixingKinds:
    @pytest.mark.parametrize(
        ("settings", "message"),
        [
            ({"sources": [SourceSpec("p.jsonl", kind="preference"), SourceSpec("c.jsonl")]}, "data.sources mixes"),
            (
                {"val_sources": {"held": [SourceSpec("p.jsonl", kind="preference"), SourceSpec("t", kind="text")]}},
                r"data.val_sources.held mixes kind: preference with kind: text",
            ),
            (
                {"test_sources": {"t": [SourceSpec("c.jsonl"), SourceSpec("p.jsonl", kind="preference")]}},
                "data.test_sources.t mixes kind: preference with kind: chat",
            ),
            ({"packing": "hard"}, "data.sources holds kind: preference sources, but packing: hard"),
            ({"sources": [SourceSpec("c.jsonl", bad_rows="drop")]}, "bad_rows: drop applies to kind: preference"),
        ],
    )
    def test_refused_before_tokenizing(self, tmp_path, settings, message):
        kwargs = {
            "sources": [SourceSpec("p.jsonl", kind="preference")],
            "tokenizer": "tiny:",
            "cache_dir": str(tmp_path),
        }
        with pytest.raises(DataError, match=message):
            XTLDataModule(**{**kwargs, **settings})

    def test_separate_sets_of_each_kind_are_fine(self, tmp_path):
        dm = XTLDataModule(
            [SourceSpec("tiny:preference_train.jsonl", kind="preference")],
            tokenizer="tiny:",
            cache_dir=str(tmp_path),
            val_sources={"sft": [SourceSpec("tiny:sft_eval.jsonl")]},
        )
        assert dm.val_set_names == ["sft"]


def _dm(cache_dir: Path, **overrides) -> XTLDataModule:
    kwargs = {
        "sources": [SourceSpec("tiny:preference_train.jsonl", kind="preference", sample_ratio=0.1)],
        "tokenizer": "tiny:",
        "pack_max_length": 256,
        "micro_batches_per_step": 2,
        "seed": 5,
        "cache_dir": str(cache_dir),
        "val_sources": {"held_out": [SourceSpec("tiny:preference_eval.jsonl", kind="preference")]},
        "progress": False,
    }
    return XTLDataModule(**{**kwargs, **overrides})


def _documents(mb: MicroBatch) -> list[tuple[np.ndarray, np.ndarray]]:
    """(ids, shifted labels) of every real document of a micro-batch."""
    bounds = mb.seq_ctx.cu_seq_lens.tolist()
    docs = list(zip(bounds[:-1], bounds[1:]))
    if mb.seq_ctx.num_padding:
        docs = docs[:-1]
    ids, labels = mb.seq_ctx.input_ids[0].numpy(), mb.labels[0].numpy()
    return [(ids[a:b], labels[a:b]) for a, b in docs]


def _signature(steps: list[list[MicroBatch]]) -> list:
    return [[(mb.pack_index, mb.seq_ctx.input_ids.tolist(), mb.labels.tolist()) for mb in s] for s in steps]


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("pref_cache")


class TestDataModule:
    def _check_pairs(self, dm: XTLDataModule, split, batches, rows: list[dict]) -> int:
        tokenizer = dm.load_tokenizer()
        pairs = 0
        for mb in batches:
            docs = _documents(mb)
            assert len(docs) % 2 == 0 and len(docs) > 0
            plan = split.plan
            a = int(plan.pack_offsets[mb.pack_index])
            for j in range(0, len(docs), 2):
                (c_ids, c_labels), (r_ids, r_labels) = docs[j], docs[j + 1]
                chosen, rejected = int(plan.seg_sample[a + j]), int(plan.seg_sample[a + j + 1])
                assert split.data.sample_ids[chosen] % 2 == 0 and split.data.sample_ids[rejected] % 2 == 1
                cache = split.data.caches[int(split.data.source_ids[chosen])]
                row = int(cache.rows[split.data.sample_ids[chosen]])
                assert row == int(cache.rows[split.data.sample_ids[rejected]])
                # The prompt (everything before the first target) is the same tokens on both sides.
                start = int(np.flatnonzero(c_labels != IGNORE_INDEX)[0])
                assert start == int(np.flatnonzero(r_labels != IGNORE_INDEX)[0])
                assert np.array_equal(c_ids[: start + 1], r_ids[: start + 1])
                targets = [tokenizer.decode(lab[lab != IGNORE_INDEX].tolist()) for lab in (c_labels, r_labels)]
                assert targets[0].endswith(rows[row]["chosen"][-1]["content"] + "<|im_end|>")
                assert targets[1].endswith(rows[row]["rejected"][-1]["content"] + "<|im_end|>")
                assert c_labels[-1] == r_labels[-1] == IGNORE_INDEX  # shifted per document
                pairs += 1
        return pairs

    def test_micro_batches_alternate_chosen_and_rejected(self, tiny_cache):
        dm = _dm(tiny_cache)
        dm.setup("fit")
        rows = [json.loads(x) for x in (tiny_assets_dir() / "preference_train.jsonl").read_text().splitlines()]
        loader = dm.train_dataloader()
        batches = [mb for step in loader for mb in step]
        assert len(batches) == 2 * len(loader) >= 2 * 50
        assert self._check_pairs(dm, dm.train_split, batches, rows) > 500
        assert len(dm.train_split.data) == 2 * 600 and dm.train_split.dropped_rows == 0
        assert dm.dropped_rows[str(tiny_assets_dir() / "preference_train.jsonl")] == 0
        assert dm.train_split.pairs and dm.train_split.plan.report()["pairs"] == 600

    def test_validation_set_of_pairs(self, tiny_cache):
        dm = _dm(tiny_cache, val_micro_batches=4)
        rows = [json.loads(x) for x in (tiny_assets_dir() / "preference_eval.jsonl").read_text().splitlines()]
        (loader,) = dm.val_dataloader()
        batches = [mb for step in loader for mb in step]
        assert self._check_pairs(dm, dm.val_splits["held_out"], batches, rows) == 200

    def test_warm_start_reuses_cache_and_plan(self, tiny_cache, monkeypatch):
        cold = _dm(tiny_cache)
        cold.setup()

        def forbidden(*args, **kwargs):
            raise AssertionError("tokenized or packed again on a warm start")

        monkeypatch.setattr(PreferenceTokenizeFn, "batch_arrays", forbidden)
        monkeypatch.setattr(datamodule_module, "best_fit_pack", forbidden)
        warm = _dm(tiny_cache)
        warm.prepare_data()
        warm.setup()
        for name in ("pack_offsets", "seg_sample", "seg_start", "seg_end"):
            assert np.array_equal(getattr(warm.train_split.plan, name), getattr(cold.train_split.plan, name))
        assert warm.train_split.plan.pairs
        take = [next(iter(dm.train_dataloader())) for dm in (cold, warm)]
        assert _signature([take[0]]) == _signature([take[1]])
        with pytest.raises(AssertionError, match="packed again"):
            _dm(tiny_cache, sources=[SourceSpec("tiny:preference_train.jsonl", kind="preference")]).setup()

    def test_resume_continues_the_stream(self, tiny_cache):
        def take(dm: XTLDataModule, n: int) -> list:
            it = iter(dm.train_dataloader())
            return [next(it) for _ in range(n)]

        reference = _signature(take(_dm(tiny_cache, val_sources=None), 5))
        first = _dm(tiny_cache, val_sources=None)
        head = take(first, 3)
        resumed = _dm(tiny_cache, val_sources=None)
        resumed.load_state_dict(first.state_dict())
        assert _signature(head + take(resumed, 2)) == reference


class TestDataModuleRows:
    @pytest.fixture
    def pairs_file(self, tmp_path) -> Path:
        rows = _good_rows(40, seed=1)
        rows[2]["chosen"][0]["content"] = "long " * 300  # line 3: a pair longer than a pack (the others fit)
        rows[5]["rejected"] = rows[5]["chosen"]  # line 6: identical sides
        rows[9]["rejected"] = []  # line 10: an empty side
        return write_jsonl(tmp_path / "pairs.jsonl", rows)

    def _dm(self, path: Path, tmp_path: Path, qwen_tokenizer_dir: Path, **overrides) -> XTLDataModule:
        kwargs = {
            "sources": [SourceSpec(str(path), kind="preference", bad_rows="drop")],
            "tokenizer": str(qwen_tokenizer_dir),
            "pack_max_length": 1024,
            "cache_dir": str(tmp_path / "cache"),
            "progress": False,
        }
        return XTLDataModule(**{**kwargs, **overrides})

    def test_bad_rows_error_names_the_line(self, pairs_file, tmp_path, qwen_tokenizer_dir):
        source = SourceSpec(str(pairs_file), kind="preference")
        with pytest.raises(DataError, match=re.escape(f"{pairs_file}:6: ") + ".*same tokens"):
            self._dm(pairs_file, tmp_path, qwen_tokenizer_dir, sources=[source]).setup()

    def test_dropped_rows_are_counted_and_logged(self, pairs_file, tmp_path, qwen_tokenizer_dir, caplog, capsys):
        dm = self._dm(pairs_file, tmp_path, qwen_tokenizer_dir, overlong="drop")
        with caplog.at_level(logging.INFO, logger="xtl.data.datamodule"):
            dm.setup()
        assert dm.dropped_rows == {str(pairs_file): 2} and dm.train_split.dropped_rows == 2
        assert "2 bad preference rows dropped" in caplog.text
        assert "2 bad preference rows dropped, 1 pairs longer than pack_max_length dropped" in capsys.readouterr().out
        report = dm.train_split.plan.report()
        assert report["pairs"] == 37 and report["dropped_overlong_pairs"] == 1

    @pytest.mark.parametrize("overlong", ["drop", "truncate"])
    def test_overlong_pair_dropped(self, pairs_file, tmp_path, qwen_tokenizer_dir, overlong):
        dm = self._dm(pairs_file, tmp_path, qwen_tokenizer_dir, overlong=overlong)
        dm.setup()
        split = dm.train_split
        kept = {int(split.data.caches[0].rows[s]) for s in split.data.sample_ids[split.plan.seg_sample]}
        assert 2 not in kept and len(kept) == 37 and split.plan.num_truncated == 0
        check_pair_plan(split.plan, split.data.num_tokens)

    def test_overlong_pair_error_names_the_line(self, pairs_file, tmp_path, qwen_tokenizer_dir):
        with pytest.raises(DataError, match=re.escape(f"{pairs_file}:3: preference pair of ")):
            self._dm(pairs_file, tmp_path, qwen_tokenizer_dir, overlong="error").setup()

    def test_preset_table_must_keep_pairs(self, pairs_file, tmp_path, qwen_tokenizer_dir):
        lengths = self._dm(pairs_file, tmp_path, qwen_tokenizer_dir, overlong="drop")
        lengths.setup()
        n = lengths.train_split.data.num_tokens
        for name, order in (("good", [0, 1, 2, 3]), ("swapped", [0, 1, 3, 2])):
            table = np.array([[p // 2, s, 0, n[s]] for p, s in enumerate(order)], dtype=np.int64)
            np.save(tmp_path / f"{name}.npy", table)
        dm = self._dm(
            pairs_file, tmp_path, qwen_tokenizer_dir, packing="preset", pack_preset=str(tmp_path / "good.npy")
        )
        dm.setup()
        assert dm.train_split.plan.pairs and dm.train_split.plan.seg_sample.tolist() == [0, 1, 2, 3]
        bad = self._dm(
            pairs_file, tmp_path, qwen_tokenizer_dir, packing="preset", pack_preset=str(tmp_path / "swapped.npy")
        )
        with pytest.raises(DataError, match=r"data.sources: pack preset .*swapped.npy: documents 3, 2 stand where"):
            bad.setup()


class TestYamlConfig:
    def test_preference_source_fields_parse(self):
        from jsonargparse import ArgumentParser

        parser = ArgumentParser(exit_on_error=False)
        parser.add_class_arguments(XTLDataModule, "data")
        config = parser.parse_string(
            """
            data:
              tokenizer: "tiny:"
              sources:
                - {path: "tiny:preference_train.jsonl", kind: preference, bad_rows: drop, sample_ratio: 0.5}
              val_sources:
                held_out: [{path: "tiny:preference_eval.jsonl", kind: preference}]
            """
        )
        dm = parser.instantiate_classes(config).data
        assert dm.sources == [
            SourceSpec("tiny:preference_train.jsonl", kind="preference", sample_ratio=0.5, bad_rows="drop")
        ]
        with pytest.raises(Exception, match="bad_rows"):
            parser.parse_string('data: {tokenizer: "tiny:", sources: [{path: p.jsonl, bad_rows: skip}]}')
