"""Preference pairs and unpaired (KTO) rows with images in their prompts: tokenization, the image index, packs,
refusals, and the tiny vision-language preference assets.

The training side (loss and gradients against a per-sample hand computation) is in
``tests/train/test_preference_images.py``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer

import xtl.data.multimodal as mm
from xtl.data import DataConsumer, DataError, XTLDataModule
from xtl.data.collate import collate_pack
from xtl.data.multimodal import IMAGE_TOKEN, ImageProcessorConfig
from xtl.data.preference import PreferenceTokenizeFn
from xtl.data.tokenize_fn import build_tokenize_fn
from xtl.utils import resolve_path

TINY_VLM = Path(resolve_path("tiny:../tiny_vlm"))
SETTINGS = dict(patch_size=8, merge_size=2, temporal_patch_size=2, min_pixels=4096, max_pixels=4096)
REPO = Path(__file__).resolve().parents[2]
TOKENS_PER_IMAGE = 16  # 64x64 -> 8x8 patches -> 16 merged tokens


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TINY_VLM)


class _Model(DataConsumer):
    """The module a data module feeds, as far as data is concerned."""

    def __init__(self, reads_images: bool) -> None:
        self._images = reads_images

    @property
    def reads_images(self) -> bool:
        return self._images


def _image(path: Path, color: tuple[int, int, int]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (64, 64), color).save(path)
    return path.name


def _user(*images: str, text: str = "What color?") -> dict:
    return {
        "role": "user",
        "content": [*({"type": "image", "image": p} for p in images), {"type": "text", "text": text}],
    }


def _assistant(content) -> list[dict]:
    return [{"role": "assistant", "content": content}]


def _pair(*images: str, chosen: str = "red", rejected: str = "blue", text: str = "What color?") -> dict:
    return {"prompt": [_user(*images, text=text)], "chosen": _assistant(chosen), "rejected": _assistant(rejected)}


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _fn(tokenizer, kind: str = "preference", **kwargs):
    return build_tokenize_fn(kind, tokenizer, template="chatml", image_processor=SETTINGS, images=True, **kwargs)


def _datamodule(path: Path, cache: Path, kind: str, images: bool = True, **kwargs) -> XTLDataModule:
    args = dict(
        sources=[{"path": str(path), "kind": kind}],
        tokenizer=str(TINY_VLM),
        template="chatml",
        pack_max_length=512,
        cache_dir=str(cache),
        image_processor=SETTINGS if images else None,
        progress=False,
    )
    datamodule = XTLDataModule(**{**args, **kwargs})
    datamodule.feed(_Model(reads_images=images))
    return datamodule


class TestTokenize:
    def test_each_sample_of_a_pair_holds_the_prompt_images(self, tokenizer, tmp_path):
        """Chosen and rejected each hold every prompt image's placeholders (two images here), unsupervised; only the
        response is supervised."""
        _image(tmp_path / "a.png", (200, 20, 20)), _image(tmp_path / "b.png", (20, 20, 200))
        chosen, rejected = _fn(tokenizer)(_pair("a.png", "b.png"), f"{tmp_path / 'p.jsonl'}:1")
        image_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
        vision = [tokenizer.convert_tokens_to_ids(t) for t in (mm.VISION_START, IMAGE_TOKEN, mm.VISION_END)]
        for item, answer in ((chosen, "red"), (rejected, "blue")):
            ids, labels = np.array(item["input_ids"]), np.array(item["labels"])
            assert (ids == image_id).sum() == 2 * TOKENS_PER_IMAGE
            assert not np.isin(labels, vision).any()
            assert tokenizer.decode(ids[labels != -100]) == f"{answer}<|im_end|>"

    def test_text_rows_tokenize_as_without_images(self, tokenizer, tmp_path):
        """A vision-language model's text-only pairs get the same ids and masks as a text model's."""
        row = {"prompt": "Uppercase: a b", "chosen": "A B", "rejected": "a b"}
        with_images = _fn(tokenizer)(row, "p.jsonl:1")
        text = build_tokenize_fn("preference", tokenizer, template="chatml")(row, "p.jsonl:1")
        assert with_images == text

    def test_image_settings_are_in_the_key_and_text_keys_are_unchanged(self, tokenizer):
        text = PreferenceTokenizeFn(tokenizer, template="chatml")
        assert "image_processor" not in json.dumps(text.config())
        other = build_tokenize_fn(
            "preference", tokenizer, template="chatml", image_processor={**SETTINGS, "max_pixels": 8192}, images=True
        )
        assert len({text.fingerprint(), _fn(tokenizer).fingerprint(), other.fingerprint()}) == 3
        assert "xtl.data.multimodal" in _fn(tokenizer)._extra_modules(), "the expansion's code keys image caches"
        assert "xtl.data.multimodal" not in text._extra_modules()

    @pytest.mark.parametrize("layout", ["explicit", "implicit"])
    def test_the_image_index_is_the_prompts(self, tokenizer, tmp_path, layout):
        _image(tmp_path / "a.png", (200, 20, 20))
        row = _pair("a.png")
        if layout == "implicit":
            row = {"chosen": row["prompt"] + row["chosen"], "rejected": row["prompt"] + row["rejected"]}
        images = _fn(tokenizer).image_index(row, f"{tmp_path / 'p.jsonl'}:4")
        assert images.where.endswith("p.jsonl:4")
        assert [(im.path, im.grid) for im in images.images] == [(str(tmp_path / "a.png"), (1, 8, 8))]

    @pytest.mark.parametrize("kind", ["preference", "unpaired_preference"])
    def test_an_image_in_a_response_is_refused(self, tokenizer, tmp_path, kind):
        """Even under ``bad_rows: drop``: a response image is a format the pairs do not carry."""
        _image(tmp_path / "a.png", (200, 20, 20))
        row = _pair(chosen=[{"type": "image", "image": "a.png"}, {"type": "text", "text": "this"}])
        if kind == "unpaired_preference":
            row = {"prompt": row["prompt"], "completion": _assistant(row["chosen"][0]["content"]), "label": True}
        name = "chosen" if kind == "preference" else "completion"
        with pytest.raises(DataError, match=rf"p\.jsonl:2: the '{name}' response holds an image part; images go in"):
            _fn(tokenizer, kind, bad_rows="drop")(row, f"{tmp_path / 'p.jsonl'}:2")

    def test_a_missing_image_names_file_line(self, tokenizer, tmp_path):
        with pytest.raises(DataError, match=r"p\.jsonl:3 \(chosen\): image .*nope\.png does not exist"):
            _fn(tokenizer)(_pair("nope.png"), f"{tmp_path / 'p.jsonl'}:3")

    def test_a_text_model_refuses_image_parts(self, tokenizer, tmp_path):
        """Without images (a text model) an image part cannot be rendered, and says so."""
        fn = build_tokenize_fn("preference", tokenizer, template="chatml")
        with pytest.raises(DataError, match="content must be a string"):
            fn(_pair("a.png"), f"{tmp_path / 'p.jsonl'}:1")
        with pytest.raises(DataError, match="image index of a text-only preference tokenize function"):
            fn.image_index(_pair("a.png"), "p.jsonl:1")


class TestPacks:
    def test_pairs_carry_one_image_copy_per_sample(self, tmp_path):
        """A pack of three pairs holds six images, each document's own, in document order; a warm start reads the
        sidecar and opens no image."""
        colors = {"r.png": (200, 20, 20), "g.png": (20, 200, 20), "b.png": (20, 20, 200)}
        for name, color in colors.items():
            _image(tmp_path / name, color)
        rows = [_pair(name, text=f"Color of {name}?") for name in colors]
        path = _write(tmp_path / "p.jsonl", rows)
        datamodule = _datamodule(path, tmp_path / "cache", "preference")
        datamodule.setup()
        (pack,) = [datamodule.train_split.packs[i] for i in range(len(datamodule.train_split.packs))]
        mb = collate_pack(pack)
        assert pack.extras["image_grid_thw"].tolist() == [[1, 8, 8]] * 6
        processor = ImageProcessorConfig(**SETTINGS).build()
        ids, bounds = mb.seq_ctx.input_ids[0], mb.seq_ctx.doc_bounds
        for d in range(6):
            text = datamodule.load_tokenizer().decode(ids[bounds[d] : bounds[d + 1]])
            name = next(n for n in colors if f"Color of {n}?" in text)
            alone = processor(images=[Image.open(tmp_path / name).convert("RGB")], return_tensors="pt")["pixel_values"]
            torch.testing.assert_close(pack.extras["pixel_values"][64 * d : 64 * (d + 1)], alone, rtol=0, atol=0)

        def fail(*args):
            raise AssertionError("opened an image header on a warm start")

        mm_read = mm.read_image_size
        try:
            mm.read_image_size = fail
            warm = _datamodule(path, tmp_path / "cache", "preference")
            warm.setup()
            assert len(warm.train_split.packs[0].extras["image_grid_thw"]) == 6
        finally:
            mm.read_image_size = mm_read

    def test_unpaired_rows_and_their_mismatched_samples_carry_the_rows_image(self, tmp_path):
        """KTO: each row's own and mismatched document (its prompt, another row's completion) hold the row's image,
        with the row's label as the documents' tag."""
        colors = {"r.png": ((200, 20, 20), "red", True), "g.png": ((20, 200, 20), "blue", False)}
        rows = []
        for name, (color, answer, label) in colors.items():
            _image(tmp_path / name, color)
            rows.append({"prompt": [_user(name, text=f"Color of {name}?")], "completion": _assistant(answer),
                         "label": label})  # fmt: skip
        datamodule = _datamodule(_write(tmp_path / "k.jsonl", rows), tmp_path / "cache", "unpaired_preference")
        datamodule.setup()
        mb = collate_pack(datamodule.train_split.packs[0])
        tokenizer = datamodule.load_tokenizer()
        ids, bounds = mb.seq_ctx.input_ids[0], mb.seq_ctx.doc_bounds
        texts = [tokenizer.decode(ids[bounds[d] : bounds[d + 1]]) for d in range(4)]
        processor = ImageProcessorConfig(**SETTINGS).build()
        pixels = mb.seq_ctx.extras["pixel_values"]
        for d, text in enumerate(texts):
            name = next(n for n in colors if f"Color of {n}?" in text)
            own = d % 2 == 0
            answer = colors[name][1] if own else next(a for n, (_, a, _) in colors.items() if n != name)
            assert text.endswith(f"{answer}<|im_end|>\n") or text.endswith(f"{answer}<|im_end|>")
            assert mb.doc_tags[d] == int(colors[name][2])
            alone = processor(images=[Image.open(tmp_path / name).convert("RGB")], return_tensors="pt")["pixel_values"]
            torch.testing.assert_close(pixels[64 * d : 64 * (d + 1)], alone, rtol=0, atol=0)

    def test_a_text_model_refuses_image_rows_at_setup(self, tmp_path):
        _image(tmp_path / "a.png", (200, 20, 20))
        path = _write(tmp_path / "p.jsonl", [_pair("a.png")])
        with pytest.raises(DataError, match=r"p\.jsonl:1 \(chosen\): message 0 \(user\) content must be a string"):
            _datamodule(path, tmp_path / "cache", "preference", images=False).setup()


def _rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (TINY_VLM / name).read_text().splitlines()]


class TestTinyVLMPreferenceAssets:
    FILES = ("preference_train.jsonl", "preference_eval.jsonl", "kto_train.jsonl", "kto_eval.jsonl")

    def test_pairs_follow_the_sft_rows(self):
        """The SFT row's question (its image) is the prompt, its answer chosen, a wrong answer of the same question
        kind rejected; the KTO rows are the same prompts, chosen labeled true on even rows, rejected false on odd."""
        kinds = {
            "What color are the shapes?": {"red", "green", "blue", "yellow"},
            "What shape are they?": {"circle", "square", "triangle"},
            "How many shapes are there?": {"1", "2", "3"},
        }
        for split, sft_name, size in (("train", "train.jsonl", 600), ("eval", "eval.jsonl", 150)):
            pairs, sft, kto = _rows(f"preference_{split}.jsonl"), _rows(sft_name), _rows(f"kto_{split}.jsonl")
            assert len(pairs) == len(kto) == size
            for pair, row, unpaired, k in zip(pairs, sft, kto, range(size)):
                user, assistant = row["messages"]
                assert pair["prompt"] == [user] and pair["chosen"] == [assistant]
                question = user["content"][1]["text"]
                (rejected,) = pair["rejected"]
                assert rejected["content"] in kinds[question] - {assistant["content"]}
                assert unpaired == {"prompt": [user], "completion": pair["chosen" if k % 2 == 0 else "rejected"],
                                    "label": k % 2 == 0}  # fmt: skip
            assert {p["rejected"][0]["content"] for p in pairs} > {"red", "circle", "1"}

    def test_generator_reproduces_committed_files(self, tmp_path):
        for name in ("train.jsonl", "eval.jsonl"):
            shutil.copy(TINY_VLM / name, tmp_path / name)
        script = REPO / "scripts" / "make_tiny_vlm_preference.py"
        subprocess.run([sys.executable, str(script), "--out", str(tmp_path)], check=True, capture_output=True)
        for name in self.FILES:
            assert (tmp_path / name).read_bytes() == (TINY_VLM / name).read_bytes(), name

    @pytest.mark.parametrize(
        "kind, name", [("preference", "preference_eval.jsonl"), ("unpaired_preference", "kto_eval.jsonl")]
    )
    def test_the_assets_pack_with_their_images(self, tmp_path, kind, name):
        """The held-out sets load for a vision-language model: every document holds one image."""
        datamodule = _datamodule(TINY_VLM / name, tmp_path / "cache", kind, pack_max_length=256)
        datamodule.setup()
        packs = datamodule.train_split.packs
        assert datamodule.train_split.plan.report()["documents"] == 300
        for i in range(0, len(packs), 10):
            mb = collate_pack(packs[i])
            docs = mb.seq_ctx.num_docs - (1 if mb.seq_ctx.num_padding else 0)
            assert len(mb.seq_ctx.extras["image_grid_thw"]) == docs
            assert int((mb.seq_ctx.input_ids == 1544).sum()) == TOKENS_PER_IMAGE * docs
