"""The runtime parity engine on Qwen3-VL and Qwen3-VL-MoE: documents keep their images, the vision tower's rows are
compared with transformers' ``Qwen3VL(Moe)ForConditionalGeneration`` bitwise (``hf_impl``), and a 1e-6 fault in
one vision block is named.

Tolerance: ``bitwise`` (every row ``torch.equal``) in ``hf_impl`` mode, fp32 and bf16; the 1e-6 faults are injected
in fp32 (a bf16 weight cannot hold a 1e-6 relative change), which is what the check runs in for fp32 weights (a
``bf16-mixed`` run included). ``fast`` mode is held to the ``fp32`` preset (relative L2 1e-5 forward, 1e-4
gradients), which a 1e-6 fault stays under: it takes ``hf_impl`` to see one.
"""

from __future__ import annotations

import pytest
import torch

from xtl.batch import SequenceContext
from xtl.model.parity import DocumentImages, ParityDocuments, load_reference, run_parity_check
from xtl.ops.cross_entropy import IGNORE_INDEX

from .vlm import IMAGE, PATCH_DIM, VARIANTS, VISION_END, VISION_START, load_pair, save_tiny_vlm

VISION_ROWS = [
    "vision patch_embed",
    "vision block 0",
    "vision block 1",
    "vision merger",
    "vision deepstack 0",
    "vision deepstack 1",
]


@pytest.fixture(scope="module")
def tiny_vlm_dir(tmp_path_factory: pytest.TempPathFactory):
    """Factory: ``tiny_vlm_dir(variant) -> Path`` of a saved fp32 tiny HF VLM checkpoint."""
    root = tmp_path_factory.mktemp("hf_vlm_parity")
    return lambda variant: save_tiny_vlm(variant, torch.float32, root)


def xtl_vlm(path, dtype: torch.dtype = torch.float32):  # noqa: ANN001, ANN201
    """A fresh xtl model of the checkpoint at ``path`` (each test may hook or perturb it)."""
    return load_pair(path, dtype)[1]


def image_documents(seed: int = 3) -> ParityDocuments:
    """Image + text, text only, image + text + image + text (4x4 and 4x6 patches: 4 and 6 placeholders)."""
    g = torch.Generator().manual_seed(seed)
    vs, ve, img = VISION_START, VISION_END, IMAGE
    specs = [
        ([5, 6, vs, *[img] * 4, ve, 7, 8], [[1, 4, 4]]),
        ([9, 10, 11, 12, 13], []),
        ([14, vs, *[img] * 4, ve, 15, vs, *[img] * 6, ve, 16, 17], [[1, 4, 4], [1, 4, 6]]),
    ]
    ids, labels, images = [], [], []
    for tokens, grid in specs:
        doc = torch.tensor(tokens)
        ids.append(doc)
        labels.append(torch.cat([doc[1:], doc.new_full((1,), IGNORE_INDEX)]))
        rows = sum(t * h * w for t, h, w in grid)
        images.append(DocumentImages(torch.randn(rows, PATCH_DIM, generator=g), torch.tensor(grid)) if grid else None)
    return ParityDocuments(ids, labels, images)


def perturb_output(module: torch.nn.Module, relative: float = 1e-6) -> None:
    """A fault in xtl's model only: ``module``'s output is multiplied by ``1 + relative``."""
    module.register_forward_hook(lambda mod, args, out: out * (1 + relative))


class TestVLMDocuments:
    def _pack(self) -> tuple[SequenceContext, torch.Tensor]:
        """Image doc (8 tokens), text doc (3), two-image doc (16), 2 padding; pixels numbered by row."""
        vs, ve, img = VISION_START, VISION_END, IMAGE
        docs = [[5, vs, *[img] * 4, ve, 6], [7, 8, 9], [10, vs, *[img] * 4, ve, vs, *[img] * 6, ve, 11]]
        ids = torch.tensor([[t for d in docs for t in d] + [0, 0]])
        labels = torch.cat([ids[:, 1:], torch.full((1, 1), IGNORE_INDEX)], dim=1)
        ctx = SequenceContext.from_lengths(ids, [8, 3, 16, 2], num_padding=2)
        ctx.extras = {
            "pixel_values": torch.arange(56.0)[:, None].expand(56, 4).clone(),
            "image_grid_thw": torch.tensor([[1, 4, 4], [1, 4, 4], [1, 4, 6]]),
        }
        return ctx, labels

    def test_from_packed_gives_each_document_its_images(self):
        ctx, labels = self._pack()
        docs = ParityDocuments.from_packed(ctx, labels, image_token_id=IMAGE, spatial_merge_size=2)
        assert docs.lengths == [8, 3, 16] and docs.num_images == 3
        first, none, last = docs.images
        assert none is None
        assert first.grid_thw.tolist() == [[1, 4, 4]] and first.pixel_values[:, 0].tolist() == list(range(16))
        assert last.grid_thw.tolist() == [[1, 4, 4], [1, 4, 6]]
        assert last.pixel_values[:, 0].tolist() == list(range(16, 56))

    @pytest.mark.parametrize(
        "max_tokens,length,images", [(21, 8, [[1, 4, 4]]), (17, 6, [[1, 4, 4]]), (16, 2, None), (13, 2, None)]
    )
    def test_a_cut_never_splits_an_image(self, max_tokens, length, images):
        """A cut inside an image moves back to its first placeholder; one right after an image keeps it."""
        ctx, labels = self._pack()
        docs = ParityDocuments.from_packed(ctx, labels, max_tokens, image_token_id=IMAGE, spatial_merge_size=2)
        assert docs.lengths == [8, 3, length]
        got = docs.images[2]
        assert (None if got is None else got.grid_thw.tolist()) == images
        assert docs.labels[2][-1] == IGNORE_INDEX
        if got is not None:
            assert got.pixel_values[:, 0].tolist() == list(range(16, 32))

    def test_a_pack_with_images_needs_the_image_token(self):
        ctx, labels = self._pack()
        with pytest.raises(ValueError, match="pass its image_token_id"):
            ParityDocuments.from_packed(ctx, labels)
        ctx.extras["image_grid_thw"] = ctx.extras["image_grid_thw"][:2]
        with pytest.raises(ValueError, match="fewer images than"):
            ParityDocuments.from_packed(ctx, labels, image_token_id=IMAGE, spatial_merge_size=2)


@pytest.mark.parametrize("variant", VARIANTS)
class TestVLMParityCheck:
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
    def test_correct_models_are_bitwise_vision_tower_included(self, variant, dtype, tiny_vlm_dir):
        model = xtl_vlm(tiny_vlm_dir(variant), dtype)
        report = run_parity_check(model, image_documents(), hf_config=model.config.hf_config)
        assert report.ok, report.render()
        names = [r.name for r in report.rows]
        assert names[:8] == [*VISION_ROWS, "embed", "layer 0"] and {"logits", "loss"} <= set(names)
        assert "grad visual.blocks.0.attn.qkv.weight" in names and "grad visual.merger.linear_fc2.weight" in names
        assert all(r.exact for r in report.rows) and report.tolerance_name == "bitwise"
        assert report.num_images == 3 and report.to_dict()["images"] == 3 and "3 images" in report.render()

    def test_a_1e6_fault_in_a_vision_block_names_it(self, variant, tiny_vlm_dir):
        model = xtl_vlm(tiny_vlm_dir(variant))
        perturb_output(model.visual.blocks[1])
        report = run_parity_check(model, image_documents(), hf_config=model.config.hf_config, grad_params=[])
        assert report.first_divergence == "vision block 1", report.render()
        assert "first diverging layer: vision block 1 (" in report.failure_message()
        rows = {r.name: r for r in report.rows}
        assert rows["vision patch_embed"].exact and rows["vision block 0"].exact and rows["vision deepstack 0"].exact
        assert 0 < rows["vision block 1"].error < 1e-5, "a 1e-6 relative fault, seen bitwise"

    def test_a_1e6_weight_change_against_the_checkpoint_names_the_block(self, variant, tiny_vlm_dir):
        """The reference loaded from the HF directory, xtl's vision block 0 weight changed by 1e-6 relative."""
        path = tiny_vlm_dir(variant)
        model = xtl_vlm(path)
        with torch.no_grad():
            model.visual.blocks[0].mlp.linear_fc2.weight.mul_(1 + 1e-6)
        reference, errors = load_reference(path, model.config.hf_config, torch.float32)
        assert errors == []
        report = run_parity_check(model, image_documents(), reference=reference, grad_params=[])
        assert report.first_divergence == "vision block 0", report.render()
        assert report.rows[0].exact  # the patch embedding before it

    def test_a_fault_in_a_deepstack_merger_or_the_vision_backward_is_named(self, variant, tiny_vlm_dir):
        model = xtl_vlm(tiny_vlm_dir(variant))
        perturb_output(model.visual.deepstack_merger_list[1])
        report = run_parity_check(model, image_documents(), hf_config=model.config.hf_config, grad_params=[])
        assert report.first_divergence == "vision deepstack 1", report.render()
        model = xtl_vlm(tiny_vlm_dir(variant))
        model.visual.blocks[0].attn.qkv.weight.register_hook(lambda grad: grad * (1 + 1e-6))
        report = run_parity_check(model, image_documents(), hf_config=model.config.hf_config)
        assert [r.name for r in report.rows if not r.ok] == ["grad visual.blocks.0.attn.qkv.weight"], report.render()

    def test_text_only_documents_get_a_probe_image(self, variant, tiny_vlm_dir):
        model = xtl_vlm(tiny_vlm_dir(variant))
        text = ParityDocuments.random(150, 20, 2)
        report = run_parity_check(model, text, hf_config=model.config.hf_config, grad_params=[])
        assert report.ok and [r.name for r in report.rows][:6] == VISION_ROWS, report.render()
        assert report.num_images == 1 and len(report.lengths) == 3 and "probe document" in report.notes[0]
        perturb_output(model.visual.blocks[0])
        report = run_parity_check(model, text, hf_config=model.config.hf_config, grad_params=[])
        assert report.first_divergence == "vision block 0", report.render()

    def test_fast_mode_and_max_layers(self, variant, tiny_vlm_dir):
        model = xtl_vlm(tiny_vlm_dir(variant))
        report = run_parity_check(model, image_documents(), hf_config=model.config.hf_config, mode="fast")
        assert report.ok and report.tolerance_name == "fp32", report.render()
        assert not all(r.exact for r in report.rows), "SDPA and the linear patch embedding are not bitwise"
        report = run_parity_check(model, image_documents(), hf_config=model.config.hf_config, max_layers=1)
        assert report.ok and [r.name for r in report.rows] == [*VISION_ROWS, "embed", "layer 0"], report.render()
