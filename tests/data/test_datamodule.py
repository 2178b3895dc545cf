"""XTLDataModule: step batches, resume equality (1 and 2 ranks, workers, Lightning checkpoints), validation sets."""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch

import xtl.data.datamodule as datamodule_module
import xtl.data.sources as sources_module
from xtl.data import DataError, MicroBatch, SourceSpec, XTLDataModule, tiny_assets_dir
from xtl.data.tokenize import ChatTokenizeFn, PretrainTokenizeFn

from .conftest import sft_records, write_jsonl


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("dm")
    sft = write_jsonl(root / "sft.jsonl", sft_records(300))
    text = write_jsonl(root / "text.jsonl", [{"text": "lorem ipsum dolor " * (1 + i % 40)} for i in range(200)])
    val = write_jsonl(root / "val.jsonl", sft_records(40, seed=1))
    return root, sft, text, val


def _dm(corpus, tokenizer_dir, **overrides) -> XTLDataModule:
    root, sft, text, val = corpus
    kwargs = {
        "sources": [SourceSpec(str(sft)), SourceSpec(str(text), kind="text", sample_ratio=0.5)],
        "tokenizer": str(tokenizer_dir),
        "template": "qwen3",
        "pack_max_length": 256,
        "micro_batches_per_step": 2,
        "seed": 11,
        "cache_dir": str(root / "cache"),
        "val_sources": {"chat": [SourceSpec(str(val))], "text": [SourceSpec(str(text), kind="text")]},
        "progress": False,
    }
    kwargs.update(overrides)
    return XTLDataModule(**kwargs)


def _take(loader, n: int) -> list[list[MicroBatch]]:
    """n step batches, starting a new pass (epoch) whenever the loader is exhausted, as Lightning does."""
    out = []
    while len(out) < n:
        for batch in loader:
            out.append(batch)
            if len(out) == n:
                break
    return out


def _signature(steps: list[list[MicroBatch]]) -> list[list[tuple]]:
    return [
        [
            (mb.pack_index, mb.seq_ctx.input_ids.tolist(), mb.labels.tolist(), mb.seq_ctx.cu_seq_lens.tolist())
            for mb in s
        ]
        for s in steps
    ]


class TestStepBatches:
    def test_step_batch_shape(self, corpus, qwen_tokenizer_dir):
        dm = _dm(corpus, qwen_tokenizer_dir)
        dm.setup("fit")
        loader = dm.train_dataloader()
        step = next(iter(loader))
        assert isinstance(step, list) and len(step) == 2
        for mb in step:
            assert mb.seq_ctx.input_ids.shape == (1, 256) and mb.labels.shape == (1, 256)
            assert mb.num_tokens == int((mb.labels != -100).sum()) > 0
            assert mb.num_real_tokens == 256 - mb.seq_ctx.num_padding
        assert len(loader) == dm.train_split.plan.__len__() // 2
        report = dm.train_split.plan.report()
        assert report["fill_ratio"] > 0.9 and report["packs"] == len(dm.train_split.packs)

    def test_warm_start_does_not_tokenize(self, corpus, qwen_tokenizer_dir, monkeypatch):
        _dm(corpus, qwen_tokenizer_dir).setup("fit")

        def forbidden(self, rows, locate):
            raise AssertionError("tokenized on a warm start")

        monkeypatch.setattr(ChatTokenizeFn, "batch_arrays", forbidden)
        monkeypatch.setattr(PretrainTokenizeFn, "batch_arrays", forbidden)
        dm = _dm(corpus, qwen_tokenizer_dir)
        dm.prepare_data()
        dm.setup("fit")
        assert next(iter(dm.train_dataloader()))


class TestHardPackingModule:
    def test_pretraining_stream_is_cut_without_loss(self, corpus, qwen_tokenizer_dir):
        root, _, text, _ = corpus
        dm = _dm(corpus, qwen_tokenizer_dir, sources=[SourceSpec(str(text), kind="text")], packing="hard")
        dm.setup()
        split = dm.train_split
        packed = [split.packs[p] for p in range(len(split.packs))]
        assert all(sum(p.lengths) == 256 for p in packed[:-1])
        stream = np.concatenate([p.input_ids for p in packed])
        originals = np.concatenate([split.data.tokens(i)[0] for i in range(len(split.data))])
        assert np.array_equal(np.sort(stream), np.sort(originals))
        assert split.plan.report()["fill_ratio"] > 0.99


@pytest.mark.parametrize("world_size", [1, 2])
class TestResume:
    def test_resumed_batches_equal_uninterrupted(self, corpus, qwen_tokenizer_dir, world_size):
        total, cut = 0, 5
        for rank in range(world_size):
            reference = _dm(corpus, qwen_tokenizer_dir, rank=rank, world_size=world_size)
            steps_per_epoch = len(reference.train_dataloader())
            total = steps_per_epoch + 4  # crosses an epoch boundary after the resume
            expected = _signature(_take(reference.train_dataloader(), total))

            first = _dm(corpus, qwen_tokenizer_dir, rank=rank, world_size=world_size)
            head = _take(first.train_dataloader(), cut)
            state = first.state_dict()
            assert state["consumed_samples"] == cut * 2 * world_size

            resumed = _dm(corpus, qwen_tokenizer_dir, rank=rank, world_size=world_size)
            resumed.load_state_dict(state)
            tail = _take(resumed.train_dataloader(), total - cut)
            assert _signature(head + tail) == expected

            via_loader = _dm(corpus, qwen_tokenizer_dir, rank=rank, world_size=world_size)
            loader = via_loader.train_dataloader()
            loader.load_state_dict(first.train_dataloader().state_dict())
            assert _signature(_take(loader, 3)) == expected[cut : cut + 3]

    def test_ranks_see_disjoint_packs(self, corpus, qwen_tokenizer_dir, world_size):
        seen = []
        for rank in range(world_size):
            dm = _dm(corpus, qwen_tokenizer_dir, rank=rank, world_size=world_size)
            seen += [mb.pack_index for step in _take(dm.train_dataloader(), 6) for mb in step]
        assert len(seen) == len(set(seen)) == 6 * 2 * world_size


class TestDataParallelRank:
    """The rank and size the loaders read: the constructor's overrides, else what the training module passed from
    its layout, else the trainer's processes, else one process; never the process group's own rank."""

    def test_the_ranks_the_module_passes_decide_the_share(self, corpus, qwen_tokenizer_dir):
        told = _dm(corpus, qwen_tokenizer_dir)
        assert told.data_parallel_rank() == (0, 1), "no trainer, nothing passed: one process reads everything"
        told.use_data_parallel(1, 2)
        assert told.data_parallel_rank() == (1, 2)
        share = _signature(_take(told.train_dataloader(), 3))
        assert share == _signature(_take(_dm(corpus, qwen_tokenizer_dir, rank=1, world_size=2).train_dataloader(), 3))
        overridden = _dm(corpus, qwen_tokenizer_dir, rank=0, world_size=4)
        overridden.use_data_parallel(1, 2)
        assert overridden.data_parallel_rank() == (0, 4), "the constructor's overrides win"


class TestResumeWithWorkers:
    def test_prefetching_workers_do_not_advance_state(self, corpus, qwen_tokenizer_dir):
        dm = _dm(corpus, qwen_tokenizer_dir, num_workers=2)
        loader = dm.train_dataloader()
        it = iter(loader)
        head = [next(it) for _ in range(3)]
        assert loader.state_dict()["consumed_samples"] == 6
        resumed = _dm(corpus, qwen_tokenizer_dir)
        resumed.load_state_dict(dm.state_dict())
        reference = _signature(_take(_dm(corpus, qwen_tokenizer_dir).train_dataloader(), 6))
        assert _signature(head + _take(resumed.train_dataloader(), 3)) == reference

    def test_persistent_workers_resume_exactly(self, corpus, qwen_tokenizer_dir):
        reference_loader = _dm(corpus, qwen_tokenizer_dir, val_sources=None).train_dataloader()
        total, cut = len(reference_loader) + 4, 5  # the resumed part crosses an epoch boundary
        expected = _signature(_take(reference_loader, total))

        first = _dm(corpus, qwen_tokenizer_dir, val_sources=None, num_workers=2, prefetch_factor=4)
        loader = first.train_dataloader()
        assert loader.num_workers == 2 and loader.persistent_workers and loader.prefetch_factor == 4
        head = _take(loader, cut)  # the workers have prefetched up to 8 step batches beyond this
        state = first.state_dict()
        assert state["consumed_samples"] == cut * 2 == loader.state_dict()["consumed_samples"]
        # The same persistent workers continue where the consumer stopped, not where they had prefetched to.
        assert _signature(_take(loader, 2)) == expected[cut : cut + 2]

        resumed = _dm(corpus, qwen_tokenizer_dir, val_sources=None, num_workers=2)
        resumed.load_state_dict(state)
        resumed_loader = resumed.train_dataloader()
        assert resumed_loader.persistent_workers
        assert _signature(head + _take(resumed_loader, total - cut)) == expected


class TestLoaderSettings:
    def test_cpu_defaults(self, corpus, qwen_tokenizer_dir):
        dm = _dm(corpus, qwen_tokenizer_dir)
        assert dm.loader_kwargs() == {"num_workers": 0, "persistent_workers": False, "pin_memory": False}
        loader = dm.train_dataloader()
        assert loader.num_workers == 0 and not loader.pin_memory

    def test_cuda_defaults_and_overrides(self, corpus, qwen_tokenizer_dir, monkeypatch):
        monkeypatch.setattr(XTLDataModule, "_on_cuda", lambda self: True)
        dm = _dm(corpus, qwen_tokenizer_dir)
        assert dm.loader_kwargs() == {"num_workers": 2, "persistent_workers": True, "pin_memory": True}
        dm = _dm(
            corpus, qwen_tokenizer_dir, num_workers=3, persistent_workers=False, prefetch_factor=6, pin_memory=False
        )
        assert dm.loader_kwargs() == {
            "num_workers": 3,
            "persistent_workers": False,
            "pin_memory": False,
            "prefetch_factor": 6,
        }
        val = dm.val_dataloader()
        assert [(v.num_workers, v.prefetch_factor, v.persistent_workers) for v in val] == [(3, 6, False)] * 2

    @pytest.mark.parametrize(
        ("setting", "message"),
        [
            ({"num_workers": -1}, "num_workers must be >= 0"),
            ({"prefetch_factor": 0}, "prefetch_factor must be >= 1"),
        ],
    )
    def test_bad_values(self, corpus, qwen_tokenizer_dir, setting, message):
        with pytest.raises(DataError, match=message):
            _dm(corpus, qwen_tokenizer_dir, **setting)


class TestStoredPackPlan:
    @pytest.fixture
    def setup_kwargs(self, tmp_path, qwen_tokenizer_dir):
        source = write_jsonl(tmp_path / "a.jsonl", sft_records(120))
        return {
            "sources": [SourceSpec(str(source))],
            "tokenizer": str(qwen_tokenizer_dir),
            "pack_max_length": 256,
            "cache_dir": str(tmp_path / "cache"),
            "progress": False,
        }

    @staticmethod
    def _forbid_packing(monkeypatch):
        def forbidden(*args, **kwargs):
            raise AssertionError("packed again")

        monkeypatch.setattr(datamodule_module, "best_fit_pack", forbidden)
        monkeypatch.setattr(datamodule_module, "hard_pack", forbidden)

    def test_warm_start_reuses_the_plan(self, setup_kwargs, monkeypatch):
        cold = XTLDataModule(**setup_kwargs)
        cold.setup()
        stored = list((Path(setup_kwargs["cache_dir"]) / "plans").iterdir())
        assert len(stored) == 1 and stored[0].suffix == ".npz"
        self._forbid_packing(monkeypatch)
        warm = XTLDataModule(**setup_kwargs)
        warm.setup()
        for name in ("pack_offsets", "seg_sample", "seg_start", "seg_end"):
            assert np.array_equal(getattr(warm.train_split.plan, name), getattr(cold.train_split.plan, name))
        assert warm.train_split.plan.report() == cold.train_split.plan.report()
        assert _signature(_take(warm.train_dataloader(), 3)) == _signature(_take(cold.train_dataloader(), 3))

    @pytest.mark.parametrize(
        "change", [{"pack_max_length": 512}, {"seed": 1}, {"overlong": "drop"}, {"packing": "hard"}]
    )
    def test_other_settings_pack_again(self, setup_kwargs, monkeypatch, change):
        XTLDataModule(**setup_kwargs).setup()
        self._forbid_packing(monkeypatch)
        with pytest.raises(AssertionError, match="packed again"):
            XTLDataModule(**{**setup_kwargs, **change}).setup()

    def test_changed_source_packs_again(self, setup_kwargs, monkeypatch):
        XTLDataModule(**setup_kwargs).setup()
        self._forbid_packing(monkeypatch)
        write_jsonl(Path(setup_kwargs["sources"][0].path), sft_records(121))
        with pytest.raises(AssertionError, match="packed again"):
            XTLDataModule(**setup_kwargs).setup()

    def test_damaged_plan_is_rebuilt(self, setup_kwargs):
        cold = XTLDataModule(**setup_kwargs)
        cold.setup()
        (stored,) = (Path(setup_kwargs["cache_dir"]) / "plans").iterdir()
        stored.write_bytes(b"not a plan")
        warm = XTLDataModule(**setup_kwargs)
        warm.setup()
        assert np.array_equal(warm.train_split.plan.seg_sample, cold.train_split.plan.seg_sample)
        assert stored.stat().st_size > 100, "rewritten"

    def test_prepare_data_and_setup_hash_the_source_once(self, setup_kwargs, monkeypatch):
        XTLDataModule(**setup_kwargs).setup()
        calls = []
        original = sources_module.JsonlSource.fingerprint
        monkeypatch.setattr(sources_module.JsonlSource, "fingerprint", lambda self: calls.append(1) or original(self))
        dm = XTLDataModule(**setup_kwargs)
        dm.prepare_data()
        dm.setup("fit")
        assert len(calls) == 1


class _Recorder(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append([mb.pack_index for mb in batch])
        return (self.weight * sum(mb.num_tokens for mb in batch)).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


class TestLightningCheckpoint:
    @pytest.mark.parametrize("num_workers", [0, 2])
    def test_fit_resume_continues_the_data_stream(self, corpus, qwen_tokenizer_dir, tmp_path, num_workers):
        def trainer(max_steps: int) -> pl.Trainer:
            return pl.Trainer(
                max_steps=max_steps,
                accelerator="cpu",
                devices=1,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                limit_val_batches=0,
            )

        full = _Recorder()
        trainer(9).fit(full, datamodule=_dm(corpus, qwen_tokenizer_dir, val_sources=None, num_workers=num_workers))
        first = _Recorder()
        t1 = trainer(4)
        t1.fit(first, datamodule=_dm(corpus, qwen_tokenizer_dir, val_sources=None, num_workers=num_workers))
        t1.save_checkpoint(tmp_path / "mid.ckpt")
        checkpoint = torch.load(tmp_path / "mid.ckpt", weights_only=False)
        assert checkpoint["XTLDataModule"]["consumed_samples"] == 8
        loops = checkpoint["loops"]["fit_loop"]["state_dict"]
        assert loops["combined_loader"][0]["consumed_samples"] == 8
        second = _Recorder()
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*not resumable.*")
            trainer(9).fit(
                second,
                datamodule=_dm(corpus, qwen_tokenizer_dir, val_sources=None, num_workers=num_workers),
                ckpt_path=tmp_path / "mid.ckpt",
            )
        assert first.seen + second.seen == full.seen


class TestValidation:
    def test_named_sets_cover_every_pack_once_over_ranks(self, corpus, qwen_tokenizer_dir):
        per_rank = []
        for rank in range(2):
            dm = _dm(corpus, qwen_tokenizer_dir, rank=rank, world_size=2, val_micro_batches=3)
            assert dm.val_set_names == ["chat", "text"]
            per_rank.append([[[mb.pack_index for mb in step] for step in loader] for loader in dm.val_dataloader()])
        for k, name in enumerate(["chat", "text"]):
            steps0, steps1 = per_rank[0][k], per_rank[1][k]
            assert len(steps0) == len(steps1)
            ids = [i for step in steps0 + steps1 for i in step]
            assert sorted(ids) == list(range(len(dm.val_splits[name].packs)))


class TestConfigErrors:
    def test_unknown_template(self, corpus, qwen_tokenizer_dir):
        with pytest.raises(DataError, match="unknown chat template 'qwen4'"):
            _dm(corpus, qwen_tokenizer_dir, template="qwen4").setup()

    def test_missing_tokenizer(self, corpus, tmp_path):
        with pytest.raises(DataError, match="tokenizer .* does not exist"):
            _dm(corpus, tmp_path / "nothing").setup()

    def test_tiny_prefix(self, tmp_path):
        dm = XTLDataModule(
            [SourceSpec("tiny:sft_train.jsonl", sample_ratio=0.1)],
            tokenizer="tiny:",
            pack_max_length=512,
            cache_dir=str(tmp_path),
            progress=False,
        )
        dm.setup()
        assert dm.load_tokenizer().name_or_path == str(tiny_assets_dir() / "")
        assert len(dm.train_split.data) == 600


class TestYamlConfig:
    def test_jsonargparse_builds_the_datamodule(self):
        from jsonargparse import ArgumentParser

        parser = ArgumentParser()
        parser.add_class_arguments(XTLDataModule, "data")
        config = parser.parse_string(
            """
            data:
              tokenizer: "tiny:"
              sources:
                - {path: "tiny:sft_train.jsonl", sample_ratio: 0.5}
                - {path: "tiny:pretrain.jsonl", kind: text, chunk_size: 128}
              pack_max_length: 512
              micro_batches_per_step: 2
              val_sources:
                eval: [{path: "tiny:sft_eval.jsonl"}]
            """
        )
        dm = parser.instantiate_classes(config).data
        assert isinstance(dm, XTLDataModule)
        assert dm.sources == [
            SourceSpec("tiny:sft_train.jsonl", sample_ratio=0.5),
            SourceSpec("tiny:pretrain.jsonl", kind="text", chunk_size=128),
        ]
        assert dm.val_set_names == ["eval"] and dm.micro_batches_per_step == 2
