"""Family records: the family of each config, model parts, freezing, per-part learning rates, router training."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import Qwen3VLForConditionalGeneration

from tests.model.test_mtp import initialized, tiny_config
from xtl.batch import SequenceContext
from xtl.data.collate import collate_pack
from xtl.data.packing import Pack
from xtl.errors import ConfigError
from xtl.model import get_model_config_from_hf
from xtl.module.mtp import mtp_target_counts
from xtl.train import AdamWConfig, LanguageModule, PreferenceModule, RouterTraining, family_of
from xtl.train.family import DataRanks, MTPLosses, RouterLosses, family_training
from xtl.train.step import StepResult, forward_backward

from .conftest import TINY_MODEL

PATCH_DIM = 3 * 2 * 8 * 8
TINY_VL = {
    "model_type": "qwen3_vl",
    "image_token_id": 60,
    "vision_start_token_id": 61,
    "vision_end_token_id": 62,
    "video_token_id": 63,
    "text_config": {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "max_position_embeddings": 128,
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
TINY_VL_MOE = {
    **TINY_VL,
    "model_type": "qwen3_vl_moe",
    "text_config": {**TINY_VL["text_config"], "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16},
}


def _module(spec=TINY_VL, **kwargs) -> LanguageModule:
    module = LanguageModule(spec, **kwargs)
    module.configure_model()
    return module


def _part_of(module: LanguageModule) -> dict[str, str]:
    """Parameter name -> part."""
    owner = module.model.parameter_part_of()
    return {name: owner[id(param)] for name, param in module.model.named_parameters()}


def _pack() -> tuple[SequenceContext, torch.Tensor]:
    """Two documents: one with a 4x4-patch image (4 tokens), one text only."""
    g = torch.Generator().manual_seed(0)
    doc1 = [5, 61, *[60] * 4, 62, 7, 8, 9]
    doc2 = [10, 11, 12, 13]
    ids = torch.tensor([doc1 + doc2])
    ctx = SequenceContext.from_lengths(ids, [len(doc1), len(doc2)])
    ctx.extras = {"pixel_values": torch.randn(16, PATCH_DIM, generator=g), "image_grid_thw": torch.tensor([[1, 4, 4]])}
    labels = torch.randint(0, 60, ids.shape, generator=g)
    return ctx, labels


class TestFamilyOf:
    @pytest.mark.parametrize(
        ("spec", "name"),
        [
            (TINY_MODEL, "dense"),
            ({**TINY_MODEL, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2}, "moe"),
            (TINY_VL, "vision"),
            (TINY_VL_MOE, "vision-moe"),
        ],
    )
    def test_the_config_decides_the_family(self, spec, name):
        module = LanguageModule(spec)
        assert module.family == family_of(module.model_config) and module.family.name == name
        assert bool(module.family_training) == module.family.routed_experts
        module.configure_model()
        assert module.family.parts == tuple(module.model.parameter_parts())

    def test_routing_is_refused_without_routed_experts(self):
        with pytest.raises(
            ConfigError, match=r"model.init_args.routing: qwen3 has no routed experts .*remove routing"
        ):
            LanguageModule(TINY_MODEL, routing=RouterTraining(z_loss_coef=0.1))


class TestParts:
    @pytest.mark.parametrize(
        ("name", "part"),
        [
            ("visual.blocks.0.attn.qkv.weight", "vision"),
            ("visual.patch_embed.proj.weight", "vision"),
            ("visual.pos_embed.weight", "vision"),
            ("visual.merger.linear_fc1.weight", "merger"),
            ("visual.deepstack_merger_list.0.norm.weight", "merger"),
            ("language_model.layers.0.mlp.down_proj.weight", "language"),
            ("language_model.embed_tokens.weight", "language"),
        ],
    )
    def test_part_of_a_parameter(self, name, part):
        assert _part_of(_module())[name] == part

    def test_every_parameter_is_in_exactly_one_part(self):
        module = _module()
        held = [id(p) for modules in module.model.parameter_parts().values() for m in modules for p in m.parameters()]
        assert sorted(held) == sorted(id(p) for p in module.model.parameters())
        assert set(_part_of(module).values()) == {"vision", "merger", "language"}

    def test_a_text_model_is_one_part(self):
        module = _module(TINY_MODEL)
        assert set(_part_of(module).values()) == {"language"}


class TestFreezeAndLearningRates:
    @pytest.mark.parametrize("frozen", ["vision", "merger", "language"])
    def test_freeze_one_part(self, frozen):
        module = _module(freeze=[frozen])
        for name, part in _part_of(module).items():
            assert module.model.get_parameter(name).requires_grad == (part != frozen), name
        counts = module.trainable_parameters()
        assert counts[frozen] == 0 and all(v > 0 for k, v in counts.items() if k != frozen)

    def test_frozen_parameters_do_not_change_in_a_step(self):
        module = _module(freeze=["vision"], optimizer=AdamWConfig(lr_scales={"language": 0.5, "merger": 2.0}))
        optimizer = module.configure_optimizers()["optimizer"]
        before = {n: p.detach().clone() for n, p in module.model.named_parameters()}
        ctx, labels = _pack()
        module.model(seq_ctx=ctx, labels=labels).loss.backward()
        optimizer.step()
        for name, part in _part_of(module).items():
            changed = not torch.equal(before[name], module.model.get_parameter(name))
            assert changed == (part != "vision"), name

    def test_learning_rate_per_part(self):
        module = _module(optimizer=AdamWConfig(lr_scales={"vision": 0.1, "merger": 2.0}))
        optimizer = module.configure_optimizers()["optimizer"]
        base = module.optimizer_config.lr
        lrs = {g["name"]: g["lr"] for g in optimizer.param_groups}
        assert lrs == pytest.approx({"vision": 0.1 * base, "merger": 2.0 * base, "language": base})
        grouped = sum(len(g["params"]) for g in optimizer.param_groups)
        assert grouped == sum(1 for p in module.model.parameters() if p.requires_grad)
        decays = {(g["name"], g["weight_decay"]) for g in optimizer.param_groups}
        assert ("language", 0.0) in decays and ("language", module.optimizer_config.weight_decay) in decays

    def test_bad_options(self):
        with pytest.raises(ConfigError, match="freezes every part"):
            LanguageModule(TINY_VL, freeze=["vision", "merger", "language"])
        with pytest.raises(ConfigError, match=r"a vision model has no part 'visoin' \(did you mean 'vision'\?\)"):
            LanguageModule(TINY_VL, freeze=["visoin"])
        with pytest.raises(ConfigError, match="optimizer.lr_scales.vision must be > 0"):
            _module(optimizer=AdamWConfig(lr_scales={"vision": 0.0})).configure_optimizers()
        with pytest.raises(ConfigError, match="optimizer.lr_scales: Dense has no part 'vision'"):
            _module(TINY_MODEL, optimizer=AdamWConfig(lr_scales={"vision": 0.5})).configure_optimizers()


class TestRouterTraining:
    def test_vision_moe_router_losses(self):
        module = _module(TINY_VL_MOE, routing=RouterTraining(balance_loss_coef=0.01))
        ctx, labels = _pack()
        out = module.model(seq_ctx=ctx, labels=labels)
        (losses,) = module.family_training
        losses.start_step(1, torch.device("cpu"))
        extra = module.extra_loss(out, torch.tensor(10))
        assert extra is not None and extra > 0
        assert losses.step_metrics()["balance_loss"] > 0

    def test_the_extra_loss_is_scaled_by_data_ranks_over_micro_batches(self):
        module = _module(TINY_VL_MOE, routing=RouterTraining(balance_loss_coef=0.01, z_loss_coef=0.0))
        ctx, labels = _pack()
        out = module.model(seq_ctx=ctx, labels=labels)
        losses = RouterLosses(RouterTraining(balance_loss_coef=0.01), module.model_config)
        losses.start_step(1, torch.device("cpu"))
        one = losses.extra_loss(out, DataRanks(1, lambda t: t))
        losses.start_step(4, torch.device("cpu"))
        scaled = losses.extra_loss(out, DataRanks(2, lambda t: t))
        torch.testing.assert_close(scaled, one * 2 / 4)

    @pytest.mark.parametrize(("applied", "moves"), [(1.0, True), (0.0, False)])
    def test_bias_update_after_the_step(self, applied, moves):
        spec = {
            **TINY_MODEL,
            "model_type": "deepseek_v3",
            "num_key_value_heads": TINY_MODEL["num_attention_heads"],
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "n_group": 2,
            "topk_group": 1,
            "first_k_dense_replace": 0,
            "kv_lora_rank": 16,
            "q_lora_rank": 16,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 8,
        }
        module = _module(spec, routing=RouterTraining(bias_update_lr=0.1))
        (block, *_) = module.model.moe_blocks()
        before = block.gate.e_score_correction_bias.clone()
        loads = [{"tokens_per_expert": torch.tensor([[9.0, 1.0, 1.0, 1.0]] * len(module.model.moe_blocks()))}]
        (losses,) = module.family_training
        losses.start_step(1, torch.device("cpu"))
        module.after_optimizer_step(StepResult(torch.zeros(()), torch.ones(()), loads), torch.tensor(applied))
        after = block.gate.e_score_correction_bias
        assert torch.equal(after, before) != moves
        if moves:  # the overloaded expert becomes less likely, the others more
            assert after[0] < before[0] and (after[1:] > before[1:]).all()
        assert losses.step_metrics()["maxvio"] == pytest.approx((9 - 3) / 3)

    def test_routers_without_a_correction_bias_are_left_alone(self):
        module = _module(TINY_VL_MOE)
        state = {k: v.clone() for k, v in module.model.state_dict().items()}
        blocks = module.model.moe_blocks()
        loads = [{"tokens_per_expert": torch.tensor([[5.0, 1.0, 1.0, 1.0]] * len(blocks))}]
        module.family_training[0].after_optimizer_step(
            module.model, loads, torch.tensor(1.0), DataRanks(1, lambda t: t)
        )
        assert all(torch.equal(v, module.model.state_dict()[k]) for k, v in state.items())


class TestMTPTraining:
    @staticmethod
    def _step(model, micro_batches: list) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list]:
        """One step's gradients, logged metrics and extra losses through the step machinery (one rank)."""
        model.zero_grad(set_to_none=True)
        losses, ranks, extra = MTPLosses(2, 0.3), DataRanks(1, lambda t: t), []
        losses.start_step(len(micro_batches), torch.device("cpu"))
        losses.count_step(micro_batches, ranks)

        def extra_loss(out, _):
            extra.append(losses.extra_loss(out, ranks))
            return extra[-1]

        forward_backward(
            forward=lambda mb: model(seq_ctx=mb.seq_ctx, labels=mb.labels, return_logits=False),
            micro_batches=micro_batches,
            num_tokens=lambda mb: mb.num_tokens,
            dp_world_size=1,
            backward=lambda loss: loss.backward(),
            device=torch.device("cpu"),
            group=None,
            extra_loss=extra_loss,
        )
        losses.after_optimizer_step(model, [], torch.ones(()), ranks)
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        return grads, losses.step_metrics(), extra

    def test_loss_is_normalized_over_the_step_not_the_micro_batch(self):
        """Two micro-batches with different MTP counts give the gradient of the same documents in one: each depth's
        loss is divided by its count over the whole step."""
        model = initialized(tiny_config(mtp_layers=2))
        one = [_mtp_pack([0, 1, 2, 3])]
        two = [_mtp_pack([0, 1]), _mtp_pack([2, 3])]
        grads_one, logged_one, extra_one = self._step(model, one)
        grads_two, logged_two, _ = self._step(model, two)
        assert grads_one.keys() == grads_two.keys() and "mtp.1.eh_proj.weight" in grads_one
        for key in grads_one:
            torch.testing.assert_close(grads_two[key], grads_one[key], rtol=1e-4, atol=1e-7)
        with torch.no_grad():
            extras = model(seq_ctx=one[0].seq_ctx, labels=one[0].labels).extras
        means = extras["mtp_loss_sum"] / extras["mtp_num_tokens"]
        torch.testing.assert_close(extra_one[0].detach(), 0.3 * means.mean())  # DeepSeek: weight x mean over depths
        for k in (1, 2):
            torch.testing.assert_close(logged_one[f"mtp_loss_{k}"], means[k - 1])
            torch.testing.assert_close(logged_two[f"mtp_loss_{k}"], means[k - 1])

    def test_two_data_ranks_average_to_one_rank_with_both_micro_batches(self):
        """Each rank divides its depths' losses by the positions of the whole step (its counts summed with the other
        rank's) and scales the term by the ranks, as the next-token loss, since the gradient reduction averages the
        ranks: the mean of two ranks' gradients is one rank's gradient with both micro-batches. The two ranks run in
        this process, each with a ``DataRanks`` of size 2 whose sum adds the other rank's counts."""
        model = initialized(tiny_config(mtp_layers=2))
        a, b = _mtp_pack([0, 1]), _mtp_pack([2, 3])  # different documents and counts on the two ranks

        def counts(mb) -> torch.Tensor:
            return mtp_target_counts(mb.labels, mb.seq_ctx.position_ids, 2).float()

        def mtp_grads(micro_batches: list, ranks: DataRanks) -> dict[str, torch.Tensor]:
            """The gradients of the step's MTP term alone (summed over the micro-batches, as backward does)."""
            model.zero_grad(set_to_none=True)
            losses = MTPLosses(2, 0.3)
            losses.start_step(len(micro_batches), torch.device("cpu"))
            losses.count_step(micro_batches, ranks)
            for mb in micro_batches:
                losses.extra_loss(model(seq_ctx=mb.seq_ctx, labels=mb.labels, return_logits=False), ranks).backward()
            return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

        assert not torch.equal(counts(a), counts(b))
        one = mtp_grads([a, b], DataRanks(1, lambda t: t))
        rank_a = mtp_grads([a], DataRanks(2, lambda t: t + counts(b)))
        rank_b = mtp_grads([b], DataRanks(2, lambda t: t + counts(a)))
        assert one.keys() == rank_a.keys() == rank_b.keys() and "mtp.1.eh_proj.weight" in one
        for key in one:
            mean = (rank_a[key] + rank_b[key]) / 2
            torch.testing.assert_close(mean, one[key], rtol=1e-5, atol=1e-8, msg=lambda m, key=key: f"{key}: {m}")

    def test_objectives_other_than_next_token_refuse_mtp(self):
        spec = {"model_type": "deepseek_v3", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 1,
                "num_attention_heads": 2, "mtp_layers": 1}  # fmt: skip
        assert [type(b) for b in family_training(LanguageModule(spec).model_config, None)] == [
            RouterLosses,
            MTPLosses,
        ]
        with pytest.raises(ConfigError, match="PreferenceModule does not train multi-token prediction"):
            PreferenceModule(spec)


def _mtp_pack(docs: list[int]):
    """A micro-batch of some of four fixed documents (document 2 has 3 fewer supervised tokens)."""
    rng = np.random.default_rng(3)
    tokens = [rng.integers(0, 160, n) for n in (9, 14, 5, 12)]
    labels = [d.copy() for d in tokens]
    labels[2][:3] = -100
    cat = np.concatenate
    return collate_pack(
        Pack(0, cat([tokens[i] for i in docs]), cat([labels[i] for i in docs]), [len(tokens[i]) for i in docs])
    )


class TestExport:
    def test_save_hf_loads_in_transformers_with_equal_logits(self, tmp_path):
        module = _module()
        module.model.save_hf(tmp_path / "hf")
        hf = Qwen3VLForConditionalGeneration.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
        ctx, _ = _pack()
        ids = ctx.input_ids[:, :10]
        with torch.no_grad():
            ours = module.model(input_ids=ids, **ctx.extras).logits
            theirs = hf(input_ids=ids, mm_token_type_ids=(ids == 60).int(), **ctx.extras).logits
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
        assert get_model_config_from_hf(tmp_path / "hf").vision_config.patch_size == 8
