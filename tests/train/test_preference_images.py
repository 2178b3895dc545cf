"""DPO and KTO on a vision-language model with images in the prompts, against a hand computation.

The rows (tiny_vlm shape images, distinct per row) go through the whole data path: tokenization with the image
placeholders, the cache and its image sidecar, pair packing, the vision packs (each sample of a pair loads its own
copy of the prompt's images) and collation. :class:`~xtl.train.PreferenceModule` computes the loss on those packs.
The hand computation encodes each sample alone, processes its image alone with the HF image processor, runs the model
on that one sample (the HF-style forward: ``input_ids``, ``pixel_values``, ``image_grid_thw``; M-RoPE positions from
``get_rope_index``, not the packed path) and applies the loss formula. Loss, rewards and every parameter's gradient
(the vision tower's included) must agree within ``RTOL`` / ``ATOL`` (fp32: measured below 1e-6 relative on the
losses). Each test also checks that the images matter: the log-probabilities without pixel values differ by more than
``IMAGE_EFFECT`` somewhere, so a path that dropped the images (policy or reference) fails.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from xtl.data import XTLDataModule
from xtl.data.collate import collate_pack
from xtl.data.multimodal import ImageProcessorConfig, VisionChatTokenizeFn, load_image
from xtl.data.preference import unsupervised_prompt
from xtl.train import PreferenceLoss, PreferenceModule
from xtl.train.preference import _pair_logps, pair_count, sequence_logps, split_unpaired
from xtl.train.reference_cache import compute_reference_table, pair_offsets
from xtl.train.scorer import score_tokens
from xtl.utils import resolve_path

TINY_VLM = Path(resolve_path("tiny:../tiny_vlm"))
SETTINGS = dict(patch_size=8, merge_size=2, temporal_patch_size=2, min_pixels=4096, max_pixels=4096)
MODEL_VL = {
    "model_type": "qwen3_vl",
    "image_token_id": 1544,
    "vision_start_token_id": 1542,
    "vision_end_token_id": 1543,
    "video_token_id": 1545,
    "text_config": {
        "vocab_size": 1600,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "max_position_embeddings": 256,
        "attn_impl": "sdpa",
        "rope": {"rope_type": "default", "rope_theta": 10000.0, "params": {"mrope_section": [4, 2, 2]}},
    },
    "vision_config": {
        "depth": 2,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_heads": 2,
        "patch_size": 8,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": 32,
        "num_position_embeddings": 16,
        "deepstack_visual_indexes": [0],
    },
}
BETA = 0.5
RTOL, ATOL = 1e-5, 1e-6  # fp32, packed forward vs one forward per sample
IMAGE_EFFECT = 1e-3  # the images change some log-probability by more than this
QUESTIONS = [("What color are the shapes?", "red", "blue"), ("What shape are they?", "circle", "square"),
             ("How many shapes are there?", "2", "3"), ("What color are the shapes?", "green", "yellow"),
             ("What shape are they?", "triangle", "circle")]  # fmt: skip


def _prompt(k: int) -> list[dict]:
    """A user turn asking question ``k`` about image ``k`` (relative to the JSONL file's folder); the text names ``k``
    so that no two samples have the same token ids (they are told apart by their ids)."""
    question = f"Image {k}: {QUESTIONS[k][0]}"
    content = [{"type": "image", "image": f"images/{k:04d}.png"}, {"type": "text", "text": question}]
    return [{"role": "user", "content": content}]


def _answer(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _pairs_file(tmp_path: Path, n: int = 5) -> Path:
    """``n`` preference pairs with distinct images, written next to the tiny_vlm images (paths relative to it)."""
    rows = [{"prompt": _prompt(k), "chosen": _answer(c), "rejected": _answer(r)} for k, (_, c, r) in
            enumerate(QUESTIONS[:n])]  # fmt: skip
    return _write(tmp_path / "images_pairs.jsonl", rows)


def _unpaired_rows() -> list[dict]:
    """Four KTO rows, desirable and not in turn, each with its own image."""
    return [
        {"prompt": _prompt(k), "completion": _answer(c if k % 2 == 0 else r), "label": k % 2 == 0}
        for k, (_, c, r) in enumerate(QUESTIONS[:4])
    ]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TINY_VLM)


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    """A folder with the tiny_vlm images (linked) for rows with relative image paths."""
    (tmp_path / "images").symlink_to(TINY_VLM / "images")
    return tmp_path


def _module(**kwargs) -> PreferenceModule:
    module = PreferenceModule(MODEL_VL, **kwargs)
    module.configure_model()
    return module


def _move(model: torch.nn.Module, seed: int = 1) -> None:
    """Move a model's parameters (language and vision alike): the policy away from its reference, or back."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))


def _packs(module: PreferenceModule, source: Path, kind: str, cache: Path, pack_max_length: int) -> list:
    """The packed training set of ``source`` as the module's data module makes it (images included)."""
    datamodule = XTLDataModule(
        sources=[{"path": str(source), "kind": kind}],
        tokenizer=str(TINY_VLM),
        template="chatml",
        pack_max_length=pack_max_length,
        cache_dir=str(cache),
        image_processor=SETTINGS,
        progress=False,
    )
    datamodule.feed(module)
    datamodule.setup()
    return datamodule.train_split


class _HandSamples:
    """Each sample encoded alone, with its own image processed alone; keyed by its token ids."""

    def __init__(self, tokenizer, root: Path) -> None:
        self.fn = VisionChatTokenizeFn(tokenizer, ImageProcessorConfig(**SETTINGS), template="chatml")
        self.processor = ImageProcessorConfig(**SETTINGS).build()
        self.root = root
        self.samples: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor, dict]] = {}

    def add(self, prompt: list[dict], response: list[dict]) -> tuple[int, ...]:
        row = {"messages": unsupervised_prompt(prompt) + response}
        item = self.fn.encode(row, str(self.root / "rows.jsonl:1"))
        images = self.fn.image_index(row, str(self.root / "rows.jsonl:1")).images
        out = self.processor(images=[load_image(im.path, "hand") for im in images], return_tensors="pt")
        key = tuple(item["input_ids"])
        assert key not in self.samples, "samples are told apart by their ids"
        self.samples[key] = (torch.tensor(item["input_ids"]), torch.tensor(item["labels"]), dict(out))
        return key

    def logp(self, model: torch.nn.Module, key: tuple[int, ...], images: bool = True) -> torch.Tensor:
        """The summed log-probability of the sample's supervised tokens, the model run on this sample alone."""
        ids, labels, pixels = self.samples[key]
        extra = {"pixel_values": pixels["pixel_values"], "image_grid_thw": pixels["image_grid_thw"]} if images else {}
        logits = model(input_ids=ids[None], return_logits=True, **extra).logits[0]
        logps = torch.log_softmax(logits[:-1].float(), -1).gather(1, ids[1:, None])[:, 0]
        return logps[labels[1:] != -100].sum()


def _doc_keys(mb) -> list[tuple[int, ...]]:
    """The token ids of each non-padding document of a micro-batch."""
    ids, bounds = mb.seq_ctx.input_ids[0], mb.seq_ctx.doc_bounds
    return [tuple(ids[bounds[d] : bounds[d + 1]].tolist()) for d in range(2 * pair_count(mb))]


def _grads(module: PreferenceModule) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in module.model.named_parameters() if p.grad is not None}
    module.model.zero_grad(set_to_none=True)
    return grads


def _assert_grads_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys() and any(n.startswith("visual.") for n in got), sorted(got)[:3]
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")


class TestDPOWithImages:
    def test_packs_hold_a_copy_of_the_prompt_images_per_sample(self, tokenizer, data_dir):
        """Every document of a pair holds the prompt's 16 placeholders, and its pack one image per document, the
        pixels of each equal to that sample's image processed alone."""
        module = _module(objective=PreferenceLoss("sigmoid", beta=BETA))
        hand = _HandSamples(tokenizer, data_dir)
        keys = {}
        for k, (_, c, r) in enumerate(QUESTIONS):
            for response in (c, r):
                keys[hand.add(_prompt(k), _answer(response))] = k
        split = _packs(module, _pairs_file(data_dir), "preference", data_dir / "cache", 200)
        assert len(split.packs) == 3
        for index in range(len(split.packs)):
            mb = collate_pack(split.packs[index])
            docs = _doc_keys(mb)
            assert all(sum(t == 1544 for t in doc) == 16 for doc in docs)
            extras = mb.seq_ctx.extras
            assert extras["image_grid_thw"].tolist() == [[1, 8, 8]] * len(docs)
            want = torch.cat([hand.samples[doc][2]["pixel_values"] for doc in docs])
            torch.testing.assert_close(extras["pixel_values"], want, rtol=0, atol=0)
            assert [keys[d] for d in docs[0::2]] == [keys[d] for d in docs[1::2]], "a pair shares one prompt"

    @pytest.mark.parametrize("reference", ["live", {"mode": "live", "sync_every": 1}])
    def test_loss_and_gradients_equal_one_forward_per_sample(self, tokenizer, data_dir, reference):
        """The step's DPO loss over two packs (``sum of pair losses / pairs``), its rewards and the gradient of every
        parameter equal the hand computation; the reference (a frozen copy; synced or not) sees the images too."""
        module = _module(objective=PreferenceLoss("sigmoid", beta=BETA), reference=reference)
        hand = _HandSamples(tokenizer, data_dir)
        pairs = [(hand.add(_prompt(k), _answer(c)), hand.add(_prompt(k), _answer(r)))
                 for k, (_, c, r) in enumerate(QUESTIONS)]  # fmt: skip
        split = _packs(module, _pairs_file(data_dir), "preference", data_dir / "cache", 200)
        _move(module.model)
        if module.reference.synced:  # TR-DPO: the copy moved towards the policy (it is then neither of them)
            module.reference.after_optimizer_step(module.model, 1)
        batches = [collate_pack(split.packs[i]) for i in range(len(split.packs))]
        total = sum(pair_count(mb) for mb in batches)
        assert total == len(pairs) and len(batches) > 1
        loss, rewards = torch.zeros(()), torch.zeros(())
        for mb in batches:
            _, terms, _ = module._pair_terms(mb)
            loss = loss + terms.loss_sum / total
            rewards = rewards + terms.metric_sums["rewards/chosen"].detach()
        loss.backward()
        got = _grads(module)

        reference_model = module.reference.frozen
        want_loss, want_rewards = torch.zeros(()), torch.zeros(())
        for chosen, rejected in pairs:
            with torch.no_grad():
                ref_c, ref_r = hand.logp(reference_model, chosen), hand.logp(reference_model, rejected)
            pol_c, pol_r = hand.logp(module.model, chosen), hand.logp(module.model, rejected)
            want_loss = want_loss - F.logsigmoid(BETA * ((pol_c - ref_c) - (pol_r - ref_r))) / total
            want_rewards = want_rewards + BETA * (pol_c - ref_c).detach()
        want_loss.backward()
        want = _grads(module)
        torch.testing.assert_close(loss.detach(), want_loss.detach(), rtol=RTOL, atol=0)
        torch.testing.assert_close(rewards, want_rewards, rtol=RTOL, atol=ATOL)
        assert abs(float(want_rewards)) > 1e-3, "the policy moved away from its reference"
        _assert_grads_equal(got, want)

    def test_the_images_change_the_log_probabilities(self, tokenizer, data_dir):
        """The packed log-probabilities equal the per-sample ones with images and differ from those without pixel
        values (so dropping the images anywhere on the way fails the tests above)."""
        module = _module(objective=PreferenceLoss("sigmoid", beta=BETA))
        hand = _HandSamples(tokenizer, data_dir)
        for k, (_, c, r) in enumerate(QUESTIONS):
            hand.add(_prompt(k), _answer(c)), hand.add(_prompt(k), _answer(r))
        split = _packs(module, _pairs_file(data_dir), "preference", data_dir / "cache", 200)
        gaps = []
        with torch.no_grad():
            for i in range(len(split.packs)):
                mb = collate_pack(split.packs[i])
                got, _ = sequence_logps(score_tokens(module.model, mb.seq_ctx, mb.labels), mb)
                docs = _doc_keys(mb)
                with_images = torch.stack([hand.logp(module.model, d) for d in docs])
                without = torch.stack([hand.logp(module.model, d, images=False) for d in docs])
                torch.testing.assert_close(got.chosen, with_images[0::2], rtol=RTOL, atol=ATOL)
                torch.testing.assert_close(got.rejected, with_images[1::2], rtol=RTOL, atol=ATOL)
                gaps.append((with_images - without).abs().max())
        assert max(gaps) > IMAGE_EFFECT


class TestPrecomputedWithImages:
    def test_the_table_holds_the_per_sample_reference_with_images(self, tokenizer, data_dir):
        """``reference: precomputed`` over the vision packs: each pair's row is the starting policy's log-probability
        of each sample run alone with its image; with the policy moved, the pair terms equal a live reference's."""
        objective = PreferenceLoss("sigmoid", beta=BETA)
        precomputed, live = _module(objective=objective, reference="precomputed"), _module(objective=objective)
        hand = _HandSamples(tokenizer, data_dir)
        for k, (_, c, r) in enumerate(QUESTIONS):
            hand.add(_prompt(k), _answer(c)), hand.add(_prompt(k), _answer(r))
        split = _packs(precomputed, _pairs_file(data_dir), "preference", data_dir / "cache", 200)
        with precomputed.reference.starting_policy(precomputed.model, moved=False) as (model, _):
            table = compute_reference_table(
                split.packs, pair_offsets(split.plan), collate_pack, lambda mb: _pair_logps(model, mb, None)
            )
            for index in range(len(split.packs)):
                docs = _doc_keys(collate_pack(split.packs[index]))
                chosen, rejected = table.lookup(index, len(docs) // 2)
                want = torch.stack([hand.logp(model, d) for d in docs])
                torch.testing.assert_close(chosen, want[0::2], rtol=RTOL, atol=ATOL)
                torch.testing.assert_close(rejected, want[1::2], rtol=RTOL, atol=ATOL)
        precomputed.precomputed.tables["train"] = table
        _move(precomputed.model), _move(live.model)
        for index in range(len(split.packs)):
            mb = collate_pack(split.packs[index])
            (_, got, _), (_, want, _) = precomputed._pair_terms(mb), live._pair_terms(mb)
            torch.testing.assert_close(got.loss_sum, want.loss_sum, rtol=RTOL, atol=0)
            for key in ("rewards/chosen", "rewards/rejected"):
                torch.testing.assert_close(got.metric_sums[key], want.metric_sums[key], rtol=RTOL, atol=ATOL)


class TestKTOWithImages:
    def test_loss_and_gradients_equal_one_forward_per_sample(self, tokenizer, data_dir):
        """KTO on four rows with images in one pack (the KL point is the pack's): each row's own and mismatched
        sample (its prompt, the previous row's completion; the first row takes the last's) carry the row's image;
        the loss and every gradient equal the hand computation. Training micro-batches with images are not cut
        apart (:func:`split_unpaired`): one forward, the mismatched documents adding no gradient."""
        objective = PreferenceLoss("kto", beta=BETA, desirable_weight=1.5)
        module = _module(objective=objective)
        rows = _unpaired_rows()
        hand = _HandSamples(tokenizer, data_dir)
        own = [hand.add(r["prompt"], r["completion"]) for r in rows]
        other = [hand.add(r["prompt"], rows[k - 1]["completion"]) for k, r in enumerate(rows)]
        split = _packs(module, _write(data_dir / "rows.jsonl", rows), "unpaired_preference", data_dir / "cache", 512)
        assert len(split.packs) == 1
        _move(module.reference.frozen)  # a reference below the policy: the KL point is positive, not clamped
        mb = collate_pack(split.packs[0])
        assert split_unpaired(mb) is mb
        docs = _doc_keys(mb)
        assert sorted(zip(docs[0::2], docs[1::2])) == sorted(zip(own, other))
        _, terms, _ = module._pair_terms(mb)
        (terms.loss_sum / len(rows)).backward()
        got = _grads(module)

        frozen = module.reference.frozen
        with torch.no_grad():
            ref_own = torch.stack([hand.logp(frozen, key) for key in own])
            ref_other = torch.stack([hand.logp(frozen, key) for key in other])
            pol_other = torch.stack([hand.logp(module.model, key) for key in other])
            without = torch.stack([hand.logp(frozen, key, images=False) for key in own])
        pol_own = torch.stack([hand.logp(module.model, key) for key in own])
        kl = (pol_other - ref_other).mean().clamp(min=0)
        ratio = pol_own - ref_own
        labels = torch.tensor([r["label"] for r in rows])
        losses = torch.where(
            labels, 1.5 * (1 - torch.sigmoid(BETA * (ratio - kl))), 1 - torch.sigmoid(BETA * (kl - ratio))
        )
        (losses.sum() / len(rows)).backward()
        want = _grads(module)
        torch.testing.assert_close(terms.loss_sum.detach(), losses.sum().detach(), rtol=RTOL, atol=0)
        torch.testing.assert_close(terms.metric_sums["kl"], kl * len(rows), rtol=RTOL, atol=ATOL)
        assert float(kl) > 0, "the reference point is not clamped here"
        assert (ref_own - without).abs().max() > IMAGE_EFFECT
        _assert_grads_equal(got, want)
