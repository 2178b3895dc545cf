"""Chat data with images: placeholder expansion, loss mask, sidecar, image loading in packs, errors."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer

import xtl.data.multimodal as mm
from xtl.data import DataConsumer, DataError, XTLDataModule
from xtl.data.collate import collate_pack
from xtl.data.multimodal import IMAGE_TOKEN, ImageProcessorConfig, VisionChatTokenizeFn
from xtl.data.tokenize_fn import build_tokenize_fn
from xtl.utils import resolve_path

TOKENIZER = resolve_path("tiny:../tiny_vlm")
SETTINGS = dict(patch_size=8, merge_size=2, temporal_patch_size=2, min_pixels=32 * 32, max_pixels=64 * 64)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TOKENIZER)


def _image(path: Path, size: tuple[int, int], color: tuple[int, int, int] = (200, 20, 20)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color).save(path)
    return path


def _record(*images: str, question: str = "What color?", answer: str = "red") -> dict:
    content = [*({"type": "image", "image": p} for p in images), {"type": "text", "text": question}]
    return {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]}


def _write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


class _Model(DataConsumer):
    """The module a data module feeds, as far as data is concerned."""

    def __init__(self, reads_images: bool) -> None:
        self._images = reads_images

    @property
    def reads_images(self) -> bool:
        return self._images


def _datamodule(path: Path, cache: Path, images: bool = True, **kwargs) -> XTLDataModule:
    args = dict(
        sources=[{"path": str(path)}],
        tokenizer=TOKENIZER,
        template="chatml",
        pack_max_length=256,
        cache_dir=str(cache),
        image_processor=SETTINGS,
        progress=False,
    )
    datamodule = XTLDataModule(**{**args, **kwargs})
    datamodule.feed(_Model(reads_images=images))
    return datamodule


class TestImageProcessorConfig:
    def test_grid_follows_min_max_pixels(self):
        s = ImageProcessorConfig(**SETTINGS)
        assert s.grid(64, 64) == (1, 8, 8)
        assert s.num_tokens((1, 8, 8)) == 16
        assert s.grid(128, 64)[1] * s.grid(128, 64)[2] * 64 <= 64 * 64  # max_pixels caps the area
        assert s.grid(16, 16)[1] * s.grid(16, 16)[2] * 64 >= 32 * 32  # min_pixels raises it

    def test_grid_matches_the_processor(self, tmp_path):
        s = ImageProcessorConfig(**SETTINGS)
        out = s.build()(images=[Image.new("RGB", (48, 80))], return_tensors="pt")
        assert tuple(out["image_grid_thw"][0].tolist()) == s.grid(80, 48)
        assert out["pixel_values"].shape[1] == 3 * 2 * 8 * 8

    def test_bad_fields_are_data_errors(self):
        with pytest.raises(DataError, match="min_pixels"):
            ImageProcessorConfig(min_pixels=10, max_pixels=5)
        with pytest.raises(DataError, match="patchsize"):
            ImageProcessorConfig.from_any({"patchsize": 8})


class TestVisionTokenize:
    def test_placeholders_and_loss_mask(self, tokenizer, tmp_path):
        _image(tmp_path / "a.png", (64, 64))
        _image(tmp_path / "b.png", (32, 64))
        fn = build_tokenize_fn("vlm_chat", tokenizer, template="chatml", image_processor=SETTINGS)
        item = fn(_record("a.png", "b.png"), f"{tmp_path / 'd.jsonl'}:1")[0]
        ids, labels = np.array(item["input_ids"]), np.array(item["labels"])
        image_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
        s = ImageProcessorConfig(**SETTINGS)
        assert (ids == image_id).sum() == s.num_tokens(s.grid(64, 64)) + s.num_tokens(s.grid(64, 32))
        start = tokenizer.convert_tokens_to_ids("<|vision_start|>")
        assert (ids == start).sum() == 2
        supervised = tokenizer.decode(ids[labels != -100])
        assert supervised == "red<|im_end|>"
        assert not np.isin(labels, [image_id, start]).any()

    def test_image_in_an_assistant_turn_is_not_supervised(self, tokenizer, tmp_path):
        _image(tmp_path / "a.png", (64, 64))
        row = _record("a.png")
        row["messages"][1]["content"] = [{"type": "image", "image": "a.png"}, {"type": "text", "text": "ok"}]
        fn = VisionChatTokenizeFn(tokenizer, ImageProcessorConfig(**SETTINGS), template="chatml")
        item = fn(row, f"{tmp_path / 'd.jsonl'}:1")[0]
        image_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
        assert image_id in item["input_ids"]
        assert image_id not in item["labels"]
        assert tokenizer.decode([t for t in item["labels"] if t != -100]) == "ok<|im_end|>"

    def test_settings_are_in_the_fingerprint(self, tokenizer):
        a = VisionChatTokenizeFn(tokenizer, ImageProcessorConfig(**SETTINGS), template="chatml")
        b = VisionChatTokenizeFn(tokenizer, ImageProcessorConfig(**{**SETTINGS, "max_pixels": 32 * 32}), "chatml")
        assert a.fingerprint() != b.fingerprint()

    def test_missing_image_names_file_line_and_path(self, tokenizer, tmp_path):
        fn = VisionChatTokenizeFn(tokenizer, ImageProcessorConfig(**SETTINGS), template="chatml")
        with pytest.raises(DataError, match=r"d\.jsonl:7: image .*nope\.png does not exist"):
            fn(_record("nope.png"), f"{tmp_path / 'd.jsonl'}:7")

    def test_unreadable_image_names_file_line_and_path(self, tokenizer, tmp_path):
        (tmp_path / "bad.png").write_bytes(b"not a png")
        fn = VisionChatTokenizeFn(tokenizer, ImageProcessorConfig(**SETTINGS), template="chatml")
        with pytest.raises(DataError, match=r"d\.jsonl:3: cannot read image .*bad\.png"):
            fn(_record("bad.png"), f"{tmp_path / 'd.jsonl'}:3")

    def test_bad_content_part(self, tokenizer, tmp_path):
        fn = VisionChatTokenizeFn(tokenizer, ImageProcessorConfig(**SETTINGS), template="chatml")
        row = _record()
        row["messages"][0]["content"].append({"type": "audio", "audio": "x.wav"})
        with pytest.raises(DataError, match="d.jsonl:2: content part"):
            fn(row, "d.jsonl:2")

    def test_tokenizer_without_vision_tokens(self, tmp_path):
        plain = AutoTokenizer.from_pretrained(resolve_path("tiny:"))
        with pytest.raises(DataError, match="vision tokens"):
            VisionChatTokenizeFn(plain, ImageProcessorConfig(**SETTINGS), template="chatml")


class TestVisionDataModule:
    def test_packs_carry_the_images_of_their_documents_in_order(self, tmp_path):
        colors = [(255, 0, 0), (0, 255, 0), (0, 0, 255)]
        for i, c in enumerate(colors):
            _image(tmp_path / "img" / f"{i}.png", (64, 64) if i != 1 else (32, 64), c)
        rows = [_record("img/0.png"), _record("img/1.png", "img/2.png"), _record(question="no image")]
        dm = _datamodule(_write(tmp_path / "d.jsonl", rows), tmp_path / "cache")
        dm.setup()
        packs = dm.train_split.packs
        assert len(packs) == 1
        mb = collate_pack(packs[0], 0, 256)
        grid, pixels = mb.seq_ctx.extras["image_grid_thw"], mb.seq_ctx.extras["pixel_values"]
        image_id = dm.load_tokenizer().convert_tokens_to_ids(IMAGE_TOKEN)
        s = ImageProcessorConfig(**SETTINGS)
        assert int((mb.seq_ctx.input_ids == image_id).sum()) == sum(s.num_tokens(g) for g in grid.tolist())
        assert pixels.shape[0] == int(grid.prod(-1).sum())
        # document order = image order: the blue image (index 2) follows the green one in the same document
        ids = mb.seq_ctx.input_ids[0]
        first_doc_images = []
        for a, b in zip(mb.seq_ctx.cu_seq_lens[:-1].tolist(), mb.seq_ctx.cu_seq_lens[1:].tolist()):
            first_doc_images.append(int((ids[a:b] == image_id).sum()))
        assert sorted(first_doc_images, reverse=True)[:2] == sorted([16 + 8, 16], reverse=True)
        moved = mb.to("cpu")
        assert moved.seq_ctx.extras["pixel_values"] is not None
        assert moved.seq_ctx.extras is not mb.seq_ctx.extras

    def test_each_image_of_a_pack_equals_that_image_processed_alone_in_document_order(self, tmp_path):
        """Catches images fed in another order inside a pack: same-size images of distinct colors, two in a
        document, compared one by one with the processor's output for each image alone."""
        colors = {"r": (255, 0, 0), "g": (0, 255, 0), "b": (0, 0, 255)}
        for name, color in colors.items():
            _image(tmp_path / "img" / f"{name}.png", (64, 64), color)
        rows = [_record("img/r.png", "img/g.png"), _record("img/b.png")]
        dm = _datamodule(_write(tmp_path / "d.jsonl", rows), tmp_path / "cache")
        dm.setup()
        (pack,) = dm.train_split.packs
        mb = collate_pack(pack, 0, 256)
        grid, pixels = mb.seq_ctx.extras["image_grid_thw"], mb.seq_ctx.extras["pixel_values"]
        processor = ImageProcessorConfig(**SETTINGS).build()
        plan, images_of = dm.train_split.plan, {0: ["r", "g"], 1: ["b"]}
        segments = range(int(plan.pack_offsets[0]), int(plan.pack_offsets[1]))
        order = [name for s in segments for name in images_of[int(plan.seg_sample[s])]]
        assert len(order) == 3 == len(grid)
        for i, (name, got) in enumerate(zip(order, pixels.split(grid.prod(-1).tolist()))):
            alone = processor(images=[mm.load_image(tmp_path / "img" / f"{name}.png", "t")], return_tensors="pt")
            assert torch.equal(got, alone["pixel_values"]), f"image {i} of the pack is not {name}.png"

    def test_warm_start_reads_the_sidecar_and_opens_no_image(self, tmp_path, monkeypatch):
        _image(tmp_path / "a.png", (64, 64))
        path = _write(tmp_path / "d.jsonl", [_record("a.png")] * 3)
        _datamodule(path, tmp_path / "cache").setup()
        assert list((tmp_path / "cache").glob(f"*/{mm.SIDECAR}"))

        def fail(*args):
            raise AssertionError("opened an image header on a warm start")

        monkeypatch.setattr(mm, "read_image_size", fail)
        dm = _datamodule(path, tmp_path / "cache")
        dm.setup()
        assert len(dm.train_split.packs[0].extras["image_grid_thw"]) == 3

    def test_image_deleted_after_caching_names_file_line(self, tmp_path):
        img = _image(tmp_path / "a.png", (64, 64))
        path = _write(tmp_path / "d.jsonl", [_record(question="x"), _record("a.png")])
        dm = _datamodule(path, tmp_path / "cache")
        dm.setup()
        img.unlink()
        with pytest.raises(DataError, match=rf"d\.jsonl:2: image {img} does not exist"):
            dm.train_split.packs[0]

    def test_missing_image_at_setup_names_file_line(self, tmp_path):
        path = _write(tmp_path / "d.jsonl", [_record(question="x"), _record("missing/z.png")])
        with pytest.raises(DataError, match=r"d\.jsonl:2: image .*missing/z\.png does not exist"):
            _datamodule(path, tmp_path / "cache").setup()

    def test_image_tokens_count_toward_pack_length_and_documents_stay_whole(self, tmp_path):
        _image(tmp_path / "a.png", (64, 64))  # 36 tokens per sample, 18 of them image tokens and markers
        path = _write(tmp_path / "d.jsonl", [_record("a.png")] * 10)
        dm = _datamodule(path, tmp_path / "cache", pack_max_length=72)
        dm.setup()
        plan = dm.train_split.plan
        assert (plan.seg_start == 0).all()
        assert (plan.seg_end == dm.train_split.data.num_tokens[plan.seg_sample]).all()
        assert (dm.train_split.data.num_tokens == 36).all()
        assert plan.pack_tokens().max() <= 72
        assert len(plan) == 5  # two samples per pack (three if image tokens did not count)

    def test_truncation_inside_an_image_is_refused(self, tmp_path):
        _image(tmp_path / "a.png", (64, 64))
        path = _write(tmp_path / "d.jsonl", [_record("a.png")])
        dm = _datamodule(path, tmp_path / "cache", pack_max_length=10, overlong="truncate")
        dm.setup()
        with pytest.raises(DataError, match=r"d\.jsonl:1: the sample is cut inside an image"):
            dm.train_split.packs[0]

    def test_the_model_fed_says_whether_packs_carry_images(self, tmp_path):
        """The data module asks the model (the trainer's module, or the one given to ``feed``), never its own
        ``image_processor`` setting."""
        _image(tmp_path / "a.png", (64, 64))
        path = _write(tmp_path / "d.jsonl", [_record("a.png")] * 2)
        alone = _datamodule(path, tmp_path / "cache", image_processor=None)
        alone.setup()  # fed a vision model, default image settings
        assert isinstance(alone.train_split.packs[0], mm.VisionPack)
        chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "red"}]
        text = XTLDataModule(
            sources=[{"path": str(_write(tmp_path / "t.jsonl", [{"messages": chat}]))}],
            tokenizer=TOKENIZER,
            template="chatml",
            cache_dir=str(tmp_path / "cache"),
            progress=False,
        )
        text.setup()  # no trainer, nothing fed: a text model
        assert not isinstance(text.train_split.packs[0], mm.VisionPack)
        trained = _datamodule(path, tmp_path / "cache", images=False)
        trained.trainer = SimpleNamespace(lightning_module=_Model(reads_images=True))  # the trainer's module wins
        assert trained.model_reads_images

    def test_image_settings_for_a_text_model_are_refused(self, tmp_path):
        path = _write(tmp_path / "d.jsonl", [_record(question="hi")] * 2)
        with pytest.raises(DataError, match="data.image_processor: the model reads no images"):
            _datamodule(path, tmp_path / "cache", images=False).setup()

    def test_text_only_packs_have_no_image_extras(self, tmp_path):
        path = _write(tmp_path / "d.jsonl", [_record(question="hi")] * 2)
        dm = _datamodule(path, tmp_path / "cache")
        dm.setup()
        mb = collate_pack(dm.train_split.packs[0], 0, 256)
        assert mb.seq_ctx.extras == {}
        assert mb.seq_ctx.lengths[:2] == [int(n) for n in dm.train_split.data.num_tokens[:2]]
