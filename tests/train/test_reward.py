"""Reward modelling (:class:`~xtl.train.RewardModule`): TRL parity of the Bradley-Terry loss and its metrics, gradients
against transformers, the ``*ForSequenceClassification`` export, the new head, normalization, refusals and a fit.

TRL parity: a tiny causal LM of each family is saved by transformers; xtl starts a reward model from it (a new scalar
head) and exports it; transformers loads the export with ``AutoModelForSequenceClassification`` and TRL's own
``RewardTrainer.compute_loss`` (its unbound function, on a stand-in for the trainer that holds what the function
reads) computes the loss and the logged ``accuracy`` and ``margin`` on a right-padded batch that
``DataCollatorForPreference`` collates from the same token ids xtl packs (one document per sequence, chosen then
rejected). Both sides run in fp32 with ``sdpa`` attention; the losses, metrics and every mapped parameter's gradient
are compared within 1e-5.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
from transformers import (
    AutoModelForSequenceClassification,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from trl.trainer.reward_trainer import DataCollatorForPreference, RewardTrainer

from tests.composition.matrix import FAMILIES as MATRIX_FAMILIES
from tests.strategies.test_context_parallel import averaged_over_ranks, join_one_group, spawned_results
from tests.train.conftest import TINY_MODEL
from tests.train.test_preference import MODEL as PREFERENCE_MODEL
from tests.train.test_preference import _pairs as _preference_pairs
from xtl.callbacks import HFExport, LoRA
from xtl.data import Pack, SourceSpec, XTLDataModule, collate_pack
from xtl.data.collate import MicroBatch, split_for_context_parallel
from xtl.data.item import DataError
from xtl.errors import ConfigError
from xtl.strategies import SingleDevice
from xtl.train import LanguageModule, PreferenceModule, RewardLoss, RewardModule
from xtl.train.preference import pair_count
from xtl.train.step import forward_backward

pytestmark = pytest.mark.filterwarnings("ignore:.*is deprecated and will be removed in v6:FutureWarning")

ATOL = 1e-5  # losses, metrics, gradients and exported scores, fp32 (measured: see each test)
PAD = 0
_COMMON = dict(
    vocab_size=1600, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=256, initializer_range=0.1, pad_token_id=PAD,
)  # fmt: skip
# family -> (HF config class, HF causal-LM class, config kwargs, extra from_pretrained kwargs)
FAMILIES = {
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(tie_word_embeddings=True), {}),
    "qwen3_moe": (
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True),
        {"experts_implementation": "eager"},
    ),
}
# (chosen, rejected) lengths: a shared 3-token prompt, then each response
LENGTHS = [(9, 5), (4, 12), (7, 7), (11, 3)]
MARGINS = [0.5, 0.0, 1.5, -0.25]


def _pairs(seed: int = 0) -> list[tuple[list[int], list[int]]]:
    rng = np.random.default_rng(seed)
    pairs = []
    for chosen, rejected in LENGTHS:
        prompt = rng.integers(1, 1600, 3).tolist()
        sides = [prompt + rng.integers(1, 1600, length - 3).tolist() for length in (chosen, rejected)]
        pairs.append((sides[0], sides[1]))
    return pairs


def _pack(pairs: list[tuple[list[int], list[int]]], pad_to: int | None = None) -> MicroBatch:
    """The pairs packed as xtl's preference data packs them: documents chosen, rejected, chosen, rejected, ..."""
    docs = [doc for pair in pairs for doc in pair]
    ids = np.concatenate([np.asarray(d, dtype=np.int64) for d in docs])
    return collate_pack(Pack(0, ids, ids.copy(), [len(d) for d in docs]), pad_token_id=PAD, pad_to=pad_to)


@pytest.fixture(scope="module")
def causal_lms(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny causal LM of each family, saved (fp32) by transformers."""
    root = tmp_path_factory.mktemp("reward_lm")
    paths = {}
    for family, (config_cls, model_cls, kwargs, _) in FAMILIES.items():
        torch.manual_seed(0)
        model = model_cls(config_cls(**_COMMON, **kwargs, attn_implementation="sdpa"))
        with torch.no_grad():  # routing margins far above rounding noise: no near-ties in the experts' top-k
            for name, param in model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    param.mul_(25.0)
        model.save_pretrained(root / family)
        paths[family] = root / family
    return paths


def _module(model: str | dict, callbacks: tuple = (), **kwargs) -> RewardModule:
    """A built reward module (``callbacks``: the run's model transforms)."""
    module = RewardModule(model, model_overrides={"attn_impl": "sdpa"}, **kwargs)
    module._trainer = SimpleNamespace(callbacks=list(callbacks), strategy=None, global_step=0, ckpt_path=None)
    module.configure_model()
    module._trainer = None
    return module


def _hf_reward(path: Path, family: str) -> torch.nn.Module:
    extra = FAMILIES[family][3]
    return AutoModelForSequenceClassification.from_pretrained(path, attn_implementation="sdpa", **extra).eval()


@pytest.fixture(scope="module")
def exported(causal_lms, tmp_path_factory) -> dict[str, tuple[RewardModule, Path]]:
    """Per family: the reward module started from the causal LM (a new head) and its HF export."""
    root = tmp_path_factory.mktemp("reward_export")
    out = {}
    for family, path in causal_lms.items():
        module = _module(str(path), seed=3)
        module.model.save_hf(root / family)
        out[family] = (module, root / family)
    return out


class _Gathered:
    """The accelerator calls ``RewardTrainer.compute_loss`` makes, on one process."""

    @staticmethod
    def gather(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    gather_for_metrics = gather


def _trl_loss(hf: torch.nn.Module, pairs, margins, coefficient) -> tuple[torch.Tensor, dict[str, float]]:
    """TRL's loss and logged metrics on its own collated batch of ``pairs``."""
    rows = [
        {"chosen_ids": c, "rejected_ids": r, **({} if margins is None else {"margin": m})}
        for (c, r), m in zip(pairs, margins or [None] * len(pairs))
    ]
    inputs = DataCollatorForPreference(pad_token_id=PAD)(rows)
    trainer = SimpleNamespace(
        model=hf,
        args=SimpleNamespace(center_rewards_coefficient=coefficient),
        accelerator=_Gathered(),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )
    loss = RewardTrainer.compute_loss(trainer, hf, inputs)
    metrics = trainer._metrics["eval"]
    return loss, {"accuracy": metrics["accuracy"][0], "margin": metrics["margin"][0]}


def _hf_grad(hf_params: dict[str, torch.nn.Parameter], key: str) -> torch.Tensor:
    """The gradient of the checkpoint tensor ``key`` in a transformers model: its parameter's, or for one expert's
    projection the slice of the experts' stacked parameter (``gate_up_proj[e]`` is gate rows, then up rows)."""
    if key in hf_params:
        return hf_params[key].grad
    prefix, expert, part = re.fullmatch(r"(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight", key).groups()
    if part == "down":
        return hf_params[f"{prefix}.down_proj"].grad[int(expert)]
    gate, up = hf_params[f"{prefix}.gate_up_proj"].grad[int(expert)].chunk(2, dim=0)
    return gate if part == "gate" else up


def _xtl_loss(module: RewardModule, pairs, margins, coefficient) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """xtl's step loss and metrics on the pairs packed in one micro-batch."""
    mb = _pack(pairs, pad_to=96)
    chosen, rejected, _ = module.pair_rewards(mb)
    margin = None if margins is None else torch.tensor(margins)
    terms = RewardLoss(coefficient).terms(chosen, rejected, margin)
    pairs_count = torch.tensor(float(pair_count(mb)))
    return terms.loss_sum / pairs_count, RewardLoss.metric_means(terms.metric_sums, pairs_count)


@pytest.mark.parametrize("family", sorted(FAMILIES))
class TestTRLParity:
    @pytest.mark.parametrize("margins", [None, MARGINS], ids=["no_margin", "margin"])
    @pytest.mark.parametrize("coefficient", [None, 0.5], ids=["plain", "centered"])
    def test_loss_and_metrics_equal_trl(self, exported, family, margins, coefficient):
        module, path = exported[family]
        pairs = _pairs()
        with torch.no_grad():
            want, want_metrics = _trl_loss(_hf_reward(path, family), pairs, margins, coefficient)
            got, got_metrics = _xtl_loss(module, pairs, margins, coefficient)
        assert 0 < want_metrics["accuracy"] < 1  # some pairs ranked right and some wrong
        torch.testing.assert_close(got, want, rtol=0, atol=ATOL)
        for key in ("accuracy", "margin"):
            torch.testing.assert_close(got_metrics[key].item(), want_metrics[key], rtol=0, atol=ATOL)

    def test_gradients_equal_trl(self, exported, family):
        module, path = exported[family]
        hf = _hf_reward(path, family)
        pairs = _pairs(seed=1)
        module.model.zero_grad(set_to_none=True)
        want, _ = _trl_loss(hf, pairs, MARGINS, 0.5)
        want.backward()
        got, _ = _xtl_loss(module, pairs, MARGINS, 0.5)
        got.backward()
        hf_params = dict(hf.named_parameters())
        compared = 0
        for name, param in module.model.named_parameters():
            for key, grad in zip(module.model.hf_keys(name), module.model.param_to_hf(name, param.grad)):
                torch.testing.assert_close(grad, _hf_grad(hf_params, key), rtol=0, atol=ATOL, msg=key)
                compared += 1
        module.model.zero_grad(set_to_none=True)
        assert compared >= len(hf_params)  # every parameter (the experts one checkpoint matrix at a time)
        assert hf_params["score.weight"].grad.abs().max() > 1e-3  # not vacuous


@pytest.mark.parametrize("family", sorted(FAMILIES))
class TestExport:
    def test_transformers_scores_as_xtl(self, exported, family):
        module, path = exported[family]
        config = json.loads((path / "config.json").read_text())
        assert config["architectures"] == [module.model_config.sequence_classification_architecture]
        assert config["architectures"][0].endswith("ForSequenceClassification")
        assert (len(config["id2label"]), config["pad_token_id"]) == (1, PAD)
        hf = _hf_reward(path, family)
        pairs = _pairs(seed=2)
        with torch.no_grad():
            chosen, rejected, _ = module.pair_rewards(_pack(pairs))
            rows = [{"chosen_ids": c, "rejected_ids": r} for c, r in pairs]
            inputs = DataCollatorForPreference(pad_token_id=PAD)(rows)
            logits = hf(**inputs).logits.squeeze(-1)
        torch.testing.assert_close(torch.cat([chosen, rejected]), logits, rtol=0, atol=ATOL)

    def test_a_reward_export_reloads_with_its_head(self, exported, family):
        module, path = exported[family]
        again = _module(str(path), seed=11)  # another seed: a new head would differ
        assert not again.head_is_new
        mb = _pack(_pairs(seed=4))
        with torch.no_grad():
            want, got = module.pair_rewards(mb)[:2], again.pair_rewards(mb)[:2]
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        with pytest.raises(ConfigError, match="sequence-classification model .num_labels 1.*RewardModule"):
            LanguageModule(str(path))


@pytest.mark.parametrize("family", [f for f in MATRIX_FAMILIES if not f.name.startswith("vlm")], ids=lambda f: f.name)
def test_every_text_family_exports_and_scores_in_transformers(family, tmp_path):
    """Each text family of the composition matrix (dense, MoE, MLA, attention sinks): a reward model from scratch,
    exported, scores in transformers' ``*ForSequenceClassification`` as in xtl."""
    module = _module(dict(family.model), seed=1)
    module.model.save_hf(tmp_path, token_ids={"pad_token_id": PAD})
    kwargs = {"experts_implementation": "eager"} if family.moe else {}
    hf = AutoModelForSequenceClassification.from_pretrained(tmp_path, attn_implementation="eager", **kwargs).eval()
    assert type(hf).__name__ == module.model_config.sequence_classification_architecture
    pairs = _pairs(seed=5)
    with torch.no_grad():
        chosen, rejected, _ = module.pair_rewards(_pack(pairs))
        rows = [{"chosen_ids": c, "rejected_ids": r} for c, r in pairs]
        logits = hf(**DataCollatorForPreference(pad_token_id=PAD)(rows)).logits.squeeze(-1)
    torch.testing.assert_close(torch.cat([chosen, rejected]), logits, rtol=0, atol=ATOL)


class TestHead:
    def test_a_new_head_is_initialized_from_the_seed(self, causal_lms):
        path = causal_lms["qwen3"]
        heads = [_module(str(path), seed=s).model.text_model().lm_head.weight.detach() for s in (5, 5, 6)]
        assert heads[0].shape == (1, _COMMON["hidden_size"])
        torch.testing.assert_close(heads[0], heads[1], rtol=0, atol=0)
        assert not torch.equal(heads[0], heads[2])
        assert 0.05 < heads[0].std().item() < 0.2  # normal(0, initializer_range = 0.1)

    def test_the_body_is_the_causal_lms(self, causal_lms):
        path = causal_lms["qwen3"]
        module = _module(str(path))
        lm = Qwen3ForCausalLM.from_pretrained(path)
        torch.testing.assert_close(
            module.model.embed_tokens.weight, lm.model.embed_tokens.weight, rtol=0, atol=0
        )  # a tied checkpoint: the embedding is loaded, the head is not tied to it
        assert module.model.lm_head.weight.data_ptr() != module.model.embed_tokens.weight.data_ptr()

    def test_each_document_is_scored_on_its_own(self, causal_lms):
        module = _module(str(causal_lms["qwen3"]))
        pairs = _pairs()
        with torch.no_grad():
            chosen, rejected, _ = module.pair_rewards(_pack(pairs, pad_to=96))
            alone = [module.pair_rewards(_pack([pair]))[:2] for pair in pairs]
        torch.testing.assert_close(chosen, torch.cat([c for c, _ in alone]), rtol=0, atol=1e-6)
        torch.testing.assert_close(rejected, torch.cat([r for _, r in alone]), rtol=0, atol=1e-6)


def _step(module: RewardModule, micro_batches: list, world: int = 1, group=None) -> tuple[torch.Tensor, dict, int]:
    """The step's loss (over every rank) and gradients (averaged over the ranks, as FSDP reduces them)."""
    module.model.zero_grad(set_to_none=True)
    forward, _ = module.step_objective(micro_batches)
    result = forward_backward(forward, micro_batches, pair_count, world, lambda loss: loss.backward(), "cpu", group)
    grads = {name: param.grad for name, param in module.model.named_parameters()}
    loss, grads = averaged_over_ranks(result.loss_sum, grads, group, world)
    return loss / result.global_tokens, grads, int(result.global_tokens)


class TestNormalization:
    def test_the_gradient_does_not_depend_on_the_micro_batches(self, causal_lms):
        """Two micro-batches of 1 and 3 pairs give the loss and gradient of one micro-batch of 4: the mean over the
        step's pairs (``forward_backward`` with :func:`pair_count`)."""
        module = _module(str(causal_lms["qwen3"]), objective=RewardLoss(0.1))
        pairs = _pairs()
        want_loss, want, _ = _step(module, [_pack(pairs)])
        loss, got, _ = _step(module, [_pack(pairs[:1]), _pack(pairs[1:], pad_to=64)])
        torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)
        for name, grad in want.items():
            torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-7, msg=name)


CP = 2
CP_LENGTHS = [9, 14, 12, 7, 20, 13]  # 75 tokens -> 76: pairs 1 and 2 cross the split at 38


@pytest.fixture(scope="module")
def cp_results(tmp_path_factory) -> list[dict]:
    return spawned_results(_cp_worker, tmp_path_factory.mktemp("reward_cp"))


@pytest.mark.distributed
class TestContextParallelism:
    def test_loss_and_every_gradient_equal_one_process(self, cp_results):
        """Two gloo ranks form one context-parallel group; each scores the last tokens its half of the pack holds
        (documents cross the split, the pack is padded) and the rewards are made whole over the group: loss and
        every gradient (averaged as FSDP averages them) equal one process's forward of the whole pack."""
        for rank, got in enumerate(cp_results):
            assert got["pairs"] == CP * (len(CP_LENGTHS) // 2), "every rank of the group counts the whole pack's pairs"
            torch.testing.assert_close(got["loss"], got["want_loss"], rtol=1e-6, atol=0, msg=f"rank {rank}")
            assert len(got["grads"]) == len(got["want_grads"])
            for name, grad in got["grads"].items():
                torch.testing.assert_close(grad, got["want_grads"][name], rtol=1e-5, atol=1e-6, msg=f"{rank} {name}")


def _cp_worker(rank: int, port: int, out_path: str) -> None:
    strategy = join_one_group(rank, port)
    group = strategy.meshes.cp.get_group()
    modules = []
    for parallelizer in (SingleDevice(), strategy):
        module = RewardModule(PREFERENCE_MODEL, objective=RewardLoss(0.1))
        module._trainer = SimpleNamespace(callbacks=[], strategy=parallelizer, global_step=0, ckpt_path=None)
        module.configure_model()
        modules.append(module)
    mb = _preference_pairs(CP_LENGTHS)
    want_loss, want_grads, _ = _step(modules[0], [mb])
    loss, grads, pairs = _step(modules[1], [split_for_context_parallel(mb, rank, CP)], CP, group)
    result = {"loss": loss, "grads": grads, "pairs": pairs, "want_loss": want_loss, "want_grads": want_grads}
    torch.save(result, f"{out_path}.{rank}")
    dist.destroy_process_group()


class TestRefusals:
    def test_a_vision_language_model(self):
        model = next(family.model for family in MATRIX_FAMILIES if family.name == "vlm")
        with pytest.raises(ConfigError, match="RewardModule trains text models; qwen3_vl is a vision-language"):
            RewardModule(dict(model))

    def test_a_classifier_with_more_labels(self, causal_lms, tmp_path):
        config = json.loads((causal_lms["qwen3"] / "config.json").read_text())
        config.update(architectures=["Qwen3ForSequenceClassification"], id2label={"0": "a", "1": "b"})
        (tmp_path / "config.json").write_text(json.dumps(config))
        with pytest.raises(ConfigError, match="classifier with num_labels 2"):
            RewardModule(str(tmp_path))

    def test_data_that_is_not_pairs(self, tmp_path):
        module = RewardModule({"model_type": "qwen3", "vocab_size": 1600, "hidden_size": 32, "num_hidden_layers": 1})
        data = XTLDataModule(
            sources=[SourceSpec("tiny:preference_train.jsonl", kind="preference")],
            val_sources={"held_out": [SourceSpec("tiny:sft_train.jsonl", kind="chat")]},
            tokenizer="tiny:",
            cache_dir=str(tmp_path),
        )
        with pytest.raises(ConfigError, match="data.val_sources.held_out has kind: chat; RewardModule trains on"):
            module._check_data_kinds(data)

    def test_a_frozen_head(self, causal_lms):
        with pytest.raises(ConfigError, match="the score head is frozen"):
            _module(str(causal_lms["qwen3"]), callbacks=(LoRA(rank=2),))


class TestFit:
    def test_trains_validates_and_exports(self, tmp_path, make_trainer, make_datamodule):
        """Two steps on the tiny pairs through Lightning: the metrics are logged, and the ``HFExport`` directory
        scores a held-out pack in transformers as xtl does."""
        module = RewardModule(dict(TINY_MODEL), objective=RewardLoss(0.01))
        data = make_datamodule(
            sources=[{"path": "tiny:preference_train.jsonl", "kind": "preference"}],
            val_sources={"heldout": [{"path": "tiny:preference_eval.jsonl", "kind": "preference"}]},
            pack_max_length=256,
        )
        trainer = make_trainer(
            2, callbacks=[HFExport()], limit_val_batches=2, val_check_interval=2, check_val_every_n_epoch=None
        )
        trainer.fit(module, datamodule=data)
        logged = trainer.callback_metrics
        for key in ("train/loss", "train/accuracy", "train/margin", "val/loss", "val/accuracy", "val/margin"):
            assert torch.isfinite(logged[key]), key
        export = tmp_path / "hf" / "final"
        hf = AutoModelForSequenceClassification.from_pretrained(export, attn_implementation="sdpa").eval()
        assert hf.config.pad_token_id is not None
        mb = next(iter(data.val_dataloader()[0]))[0]
        with torch.no_grad():
            chosen, rejected, _ = module.pair_rewards(mb)
            bounds = mb.seq_ctx.doc_bounds
            docs = [mb.seq_ctx.input_ids[0, bounds[k] : bounds[k + 1]].tolist() for k in range(2 * pair_count(mb))]
            assert all(doc[-1] != hf.config.pad_token_id for doc in docs)  # transformers reads the last token too
            rows = [{"chosen_ids": docs[k], "rejected_ids": docs[k + 1]} for k in range(0, len(docs), 2)]
            logits = hf(**DataCollatorForPreference(pad_token_id=hf.config.pad_token_id)(rows)).logits.squeeze(-1)
        torch.testing.assert_close(torch.cat([chosen, rejected]), logits, rtol=0, atol=ATOL)


def _margin_rows(path: Path, count: int = 24, skip: int | None = None) -> Path:
    """Preference rows whose chosen answer names its row (``yes k``) and whose ``margin`` is ``k / 4`` (row ``skip``
    has none)."""
    rows = [
        {"prompt": f"question {k}", "chosen": f"yes {k}", "rejected": f"no {k}"}
        | ({} if k == skip else {"margin": k / 4})
        for k in range(count)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


class TestMargins:
    def test_each_pair_carries_its_rows_margin_into_the_loss(self, tmp_path, make_datamodule):
        """``margin_key``: both documents of a pair carry the margin of their row (matched by the chosen answer's
        text), and the loss is the Bradley-Terry loss with those margins, not without."""
        source = {"path": str(_margin_rows(tmp_path / "pairs.jsonl")), "kind": "preference", "margin_key": "margin"}
        data = make_datamodule(sources=[source], micro_batches_per_step=1)
        data.setup("fit")
        tokenizer = data.load_tokenizer()
        module = RewardModule(dict(TINY_MODEL))
        module.configure_model()
        seen = 0
        for step in data.train_dataloader():
            for mb in step:
                bounds, tags = mb.seq_ctx.doc_bounds, mb.doc_tags
                assert tags is not None and tags[0::2] == tags[1::2]
                for k in range(pair_count(mb)):
                    text = tokenizer.decode(mb.seq_ctx.input_ids[0, bounds[2 * k] : bounds[2 * k + 1]].tolist())
                    row = int(re.search(r"yes (\d+)", text).group(1))
                    assert tags[2 * k] == row / 4, (text, tags[2 * k])
                    seen += 1
                with torch.no_grad():
                    chosen, rejected, _ = module.pair_rewards(mb)
                    terms, _ = module._terms(mb)
                margins = torch.tensor(tags[0 : 2 * pair_count(mb) : 2])
                want = RewardLoss().terms(chosen, rejected, margins).loss_sum
                torch.testing.assert_close(terms.loss_sum, want, rtol=0, atol=0)
                if margins.abs().sum() > 0:
                    assert not torch.equal(terms.loss_sum, RewardLoss().terms(chosen, rejected).loss_sum)
        assert seen == 24

    def test_a_row_without_its_margin_is_a_bad_row(self, tmp_path, make_datamodule):
        path = _margin_rows(tmp_path / "pairs.jsonl", skip=5)
        source = {"path": str(path), "kind": "preference", "margin_key": "margin"}
        with pytest.raises(DataError, match=r"pairs.jsonl:6: margin field 'margin' is None, not a number"):
            make_datamodule(sources=[source]).setup("fit")
        data = make_datamodule(sources=[{**source, "bad_rows": "drop"}])
        data.setup("fit")
        assert data.dropped_rows == {str(path): 1}

    def test_margin_key_is_for_preference_sources(self, make_datamodule):
        source = {"path": "tiny:sft_train.jsonl", "kind": "chat", "margin_key": "margin"}
        with pytest.raises(DataError, match="margin_key applies to kind: preference only"):
            make_datamodule(sources=[source]).setup("fit")

    def test_preference_optimization_refuses_margins(self, tmp_path):
        module = PreferenceModule(dict(PREFERENCE_MODEL))
        data = XTLDataModule(
            sources=[SourceSpec(str(_margin_rows(tmp_path / "p.jsonl")), kind="preference", margin_key="margin")],
            tokenizer="tiny:",
            cache_dir=str(tmp_path),
        )
        with pytest.raises(ConfigError, match=r"data.sources\[0\].margin_key: pair margins are read by reward"):
            module._check_data_kinds(data)
