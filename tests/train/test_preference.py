"""Preference optimization on packed pairs: per-response log-probabilities, the references (the precomputed table
included), normalization, refusals.

The TRL parity of the losses is in ``test_preference_trl.py``; the runs through ``xtl fit`` in
``test_preference_fit.py``.
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from xtl.callbacks import LoRA
from xtl.data import MicroBatch, Pack, SourceSpec, XTLDataModule, collate_pack
from xtl.data.packing import PackPlan
from xtl.data.sources import FileHashMemo
from xtl.errors import ConfigError
from xtl.train import PreferenceLoss, PreferenceModule
from xtl.train.preference import _pair_logps, pair_count, sequence_logps
from xtl.train.preference_loss import SequenceLogps
from xtl.train.reference_cache import (
    ReferenceTable,
    compute_reference_table,
    load_reference_table,
    pair_offsets,
    reference_key,
    reference_table_path,
    save_reference_table,
    weights_fingerprint,
)
from xtl.train.scorer import score_tokens
from xtl.utils import TINY_ASSETS_DIR

MODEL = {
    "model_type": "qwen3", "vocab_size": 97, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "attn_impl": "sdpa",
}  # fmt: skip
PROMPT = 4


def _pairs(lengths: list[int], seed: int = 0, index: int = 0):
    """A pack of pairs with the given document lengths (chosen, rejected, ...): each document starts with the same
    4 prompt tokens (unsupervised) as its partner; ``index``: the pack's index in its plan."""
    rng = np.random.default_rng(seed)
    ids, labels = [], []
    for k in range(0, len(lengths), 2):
        prompt = rng.integers(1, 97, PROMPT)
        for length in lengths[k : k + 2]:
            doc = np.concatenate([prompt, rng.integers(1, 97, length - PROMPT)])
            ids.append(doc)
            labels.append(np.where(np.arange(length) < PROMPT, -100, doc))
    return collate_pack(Pack(index, np.concatenate(ids), np.concatenate(labels), lengths))


def _module(callbacks: tuple = (), **kwargs) -> PreferenceModule:
    """A built module; ``callbacks``: the run's (model transforms such as LoRA)."""
    module = PreferenceModule(MODEL, **kwargs)
    module._trainer = SimpleNamespace(callbacks=list(callbacks), strategy=None, global_step=0, ckpt_path=None)
    module.configure_model()
    module._trainer = None
    return module


def _train_adapters(module: PreferenceModule, seed: int = 3) -> None:
    """Give every LoRA factor of ``module`` random values (a trained adapter)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)


class TestSequenceLogps:
    @pytest.mark.parametrize("lengths", [[9, 7, 12, 10], [6, 30, 5, 5, 17, 8]])
    def test_equal_the_log_softmax_of_each_response(self, lengths):
        """Summed log-probabilities of each response's supervised tokens, from the full logits (fp32, 1e-5)."""
        module = _module(objective=PreferenceLoss("simpo"))
        mb = _pairs(lengths)
        got, nll = sequence_logps(score_tokens(module.model, mb.seq_ctx, mb.labels), mb)
        logits = module.model(seq_ctx=mb.seq_ctx, labels=mb.labels, return_logits=True).logits
        targets = mb.labels[0]
        picked = torch.log_softmax(logits[0].float(), -1).gather(1, targets.clamp(min=0)[:, None])[:, 0]
        picked = torch.where(targets != -100, picked, 0.0)
        bounds = mb.seq_ctx.doc_bounds
        want = torch.stack([picked[bounds[i] : bounds[i + 1]].sum() for i in range(len(lengths))])
        counts = torch.tensor([float(n - PROMPT) for n in lengths])  # each response token is a target
        assert pair_count(mb) == len(lengths) // 2
        torch.testing.assert_close(got.chosen, want[0::2], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.rejected, want[1::2], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.chosen_tokens, counts[0::2])
        torch.testing.assert_close(got.rejected_tokens, counts[1::2])
        torch.testing.assert_close(nll, -want[0::2].sum(), rtol=1e-5, atol=1e-5)


class TestReference:
    def test_a_live_reference_starts_equal_to_the_policy(self):
        """Step 0: policy = reference, so rewards are 0 and the DPO loss is log 2 per pair; only the policy trains
        and checkpoints leave the frozen copy out."""
        module = _module()
        assert module.reference.mode == "live" and module.reference.frozen is not None
        mb = _pairs([9, 7, 12, 10])
        _, terms, _ = module._pair_terms(mb)
        assert terms.metric_sums["rewards/margins"] == 0
        assert math.isclose(float(terms.loss_sum.detach()), 2 * math.log(2), rel_tol=1e-6)
        assert all(name.startswith("model.") for name, p in module.named_parameters() if p.requires_grad)
        assert not any(p.requires_grad for p in module.reference.parameters())
        assert not any(key.startswith("reference.") for key in module.state_dict())
        module.train()
        with module.reference.computing(module.model) as reference:
            assert not any(m.training for m in reference.modules()), "the reference computes in eval mode"
        assert module.model.training and module.reference.frozen.training

    def test_the_reference_stays_while_the_policy_moves(self):
        module = _module()
        mb = _pairs([9, 7, 12, 10])
        with torch.no_grad():
            module.model.lm_head.weight.mul_(1.5)
        _, terms, _ = module._pair_terms(mb)
        assert terms.metric_sums["rewards/chosen"] != 0

    def test_under_fresh_lora_the_reference_is_the_base_model(self):
        """Fresh adapters: ``auto`` resolves to ``adapters_off``, with no copy of the model; as the adapters train,
        the reference stays the base model."""
        module, base = _module(callbacks=(LoRA(rank=2),)), _module(reference="live")
        assert module.reference.mode == "adapters_off" and module.reference.frozen is None
        mb = _pairs([9, 7, 12, 10])
        _train_adapters(module)
        want = sequence_logps(score_tokens(base.model, mb.seq_ctx, mb.labels), mb)[0]
        with module.reference.computing(module.model) as reference:
            got = sequence_logps(score_tokens(reference, mb.seq_ctx, mb.labels), mb)[0]
        torch.testing.assert_close(got.chosen, want.chosen, rtol=0, atol=0)
        _, terms, _ = module._pair_terms(mb)
        assert terms.metric_sums["rewards/chosen"] != 0, "the trained adapters act on the policy"

    def test_reference_free_losses_need_no_reference(self):
        assert _module(objective=PreferenceLoss("orpo")).reference.mode == "none"


PACKS = [[9, 7, 12, 10], [6, 30], [5, 5, 17, 8, 11, 9]]  # three packs of 2, 1 and 3 pairs


def _plan(packs: list[list[int]]) -> PackPlan:
    """A preference plan whose packs hold documents of these lengths (only the segment counts matter here)."""
    counts = [len(p) for p in packs]
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    ends = np.concatenate([np.array(p, dtype=np.int64) for p in packs])
    zeros = np.zeros(len(ends), dtype=np.int64)
    return PackPlan(128, offsets, np.arange(len(ends)), zeros, ends, pairs=True)


def _table(module: PreferenceModule, packs: list[list[int]], moved: bool = False) -> ReferenceTable:
    """The precomputed table of these packs, computed from the module's starting policy on one rank."""
    batches = [_pairs(lengths, seed=i, index=i) for i, lengths in enumerate(packs)]
    with module.reference.starting_policy(module.model, moved) as (model, _):
        forward = lambda mb: _pair_logps(model, mb, None)  # noqa: E731
        return compute_reference_table(batches, pair_offsets(_plan(packs)), lambda mb: mb, forward)


class TestPrecomputedReference:
    def test_equals_the_live_reference_without_a_second_model(self):
        """The table's log-probabilities are those a live reference computes; no second model is built; the table
        stays while the policy moves (the pair terms then equal live's, whose reference stays too)."""
        live, precomputed = _module(reference="live"), _module(reference="precomputed")
        assert precomputed.reference.frozen is None and live.reference.frozen is not None
        precomputed.precomputed.tables["train"] = _table(precomputed, PACKS)
        for _ in range(2):
            for i, lengths in enumerate(PACKS):
                mb = _pairs(lengths, seed=i, index=i)
                _, want, _ = live._pair_terms(mb)
                _, got, _ = precomputed._pair_terms(mb)
                for key in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
                    torch.testing.assert_close(got.metric_sums[key], want.metric_sums[key], rtol=1e-6, atol=1e-7)
                torch.testing.assert_close(got.loss_sum, want.loss_sum, rtol=1e-6, atol=0)
            with torch.no_grad():  # the policies move alike; their references must not
                for module in (live, precomputed):
                    module.model.lm_head.weight.mul_(1.5)
        assert got.metric_sums["rewards/margins"] != 0

    def test_a_table_of_other_packs_is_refused(self):
        module = _module(reference="precomputed")
        module.precomputed.tables["train"] = _table(module, PACKS)
        with pytest.raises(ValueError, match="pack 1 holds 2 pairs but the reference table has 1"):
            module._pair_terms(_pairs([9, 7, 12, 10], index=1))
        with pytest.raises(RuntimeError, match="no reference table was prepared for val/0"):
            module._pair_terms(_pairs([9, 7]), "val/0")

    def test_a_moved_policy_is_never_the_reference(self):
        """On a resumed run the policy has moved: the table comes from a fresh copy of the starting policy."""
        module = _module(reference="precomputed")
        want = _table(module, PACKS).logps
        with torch.no_grad():
            module.model.lm_head.weight.mul_(1.5)
        with module.reference.starting_policy(module.model, moved=True) as (_, source):
            assert "copy of the starting policy" in source
        torch.testing.assert_close(_table(module, PACKS, moved=True).logps, want, rtol=0, atol=0)
        assert module.model.training, "the policy's mode is kept"

    def test_under_lora_the_starting_adapters_compute_it(self):
        """Under LoRA the table is the starting policy's, on a fresh run and a resumed one alike: fresh adapters
        off; a loaded adapter as it was loaded."""
        module = _module(reference="precomputed", callbacks=(LoRA(rank=2),))
        want = _table(module, PACKS).logps
        _train_adapters(module)
        with module.reference.starting_policy(module.model, moved=True) as (_, source):
            assert source == "the model with its LoRA adapters off"
        torch.testing.assert_close(_table(module, PACKS, moved=True).logps, want, rtol=0, atol=0)
        mb = _pairs(PACKS[0])
        with torch.no_grad():
            chosen = sequence_logps(score_tokens(module.model, mb.seq_ctx, mb.labels), mb)[0].chosen
        assert not torch.equal(chosen, want[0, :2]), "the adapters are on again"

    def test_needs_the_xtl_data_module(self):
        module = _module(reference="precomputed")
        module._trainer = SimpleNamespace(datamodule=None)
        with pytest.raises(ConfigError, match="reference: precomputed reads the pairs from xtl.data.XTLDataModule"):
            module.precomputed.prepare()

    def test_a_reference_free_loss_refuses_it(self):
        with pytest.raises(ConfigError, match="reference: precomputed, but the objective uses no reference"):
            PreferenceModule(MODEL, objective=PreferenceLoss("simpo"), reference="precomputed")


class TestReferenceTable:
    @pytest.mark.parametrize("world", [2, 3, 4])
    def test_sharded_like_the_data_with_equal_forwards(self, world):
        """Rank ``r`` computes packs ``r, r + R, ...``; every rank runs ``ceil(packs / R)`` forwards (a sharded
        forward is a collective); the ranks' shares add up to the one-rank table."""
        packs = [[4, 4]] * 5  # one pair each
        offsets = pair_offsets(_plan(packs))

        def table(rank: int, size: int, seen: list[int]) -> torch.Tensor:
            def forward(pack_index: int) -> tuple[torch.Tensor, torch.Tensor]:
                seen.append(pack_index)
                return torch.tensor([-1.0 - pack_index]), torch.tensor([-10.0 - pack_index])

            return compute_reference_table(list(range(5)), offsets, lambda i: SimpleNamespace(to=lambda d: i),
                                           forward, rank=rank, world_size=size).logps  # fmt: skip

        whole = table(0, 1, [])
        torch.testing.assert_close(whole, torch.tensor([[-1.0, -2, -3, -4, -5], [-10.0, -11, -12, -13, -14]]))
        shares, counts = torch.zeros_like(whole), []
        for rank in range(world):
            seen: list[int] = []
            shares += table(rank, world, seen)
            counts.append(len(seen))
            assert set(seen) <= set(range(5)) and set(range(rank, 5, world)) <= set(seen)
        assert counts == [-(-5 // world)] * world
        torch.testing.assert_close(shares, whole, rtol=0, atol=0)

    def test_lookup(self):
        table = ReferenceTable(pair_offsets(_plan(PACKS)), torch.arange(12.0).view(2, 6))
        chosen, rejected = table.lookup(2, 3)
        assert chosen.tolist() == [3.0, 4.0, 5.0] and rejected.tolist() == [9.0, 10.0, 11.0]
        with pytest.raises(ValueError, match="pack 3 is outside the reference table"):
            table.lookup(3, 1)

    def test_stored_atomically_and_read_only_for_its_key_and_packs(self, tmp_path):
        offsets = pair_offsets(_plan(PACKS))
        table = ReferenceTable(offsets, torch.randn(2, 6))
        path = reference_table_path(tmp_path, "ab" * 16)
        save_reference_table(path, table, "ab" * 16, {"set": "train"})
        assert [p.name for p in path.parent.iterdir()] == [path.name], "no temporary file left"
        got = load_reference_table(path, "ab" * 16, offsets)
        torch.testing.assert_close(got.logps, table.logps, rtol=0, atol=0)
        assert load_reference_table(path, "cd" * 16, offsets) is None
        assert load_reference_table(path, "ab" * 16, pair_offsets(_plan(PACKS[:2]))) is None
        path.write_bytes(path.read_bytes()[:100])  # a torn file
        assert load_reference_table(path, "ab" * 16, offsets) is None
        assert load_reference_table(tmp_path / "missing.npz", "ab" * 16, offsets) is None

    def test_the_key_follows_the_weights_and_the_data(self, tmp_path):
        memo = FileHashMemo(tmp_path / "fingerprints")
        hf = tmp_path / "hf"
        hf.mkdir()
        (hf / "model.safetensors").write_bytes(b"weights v1")
        first = weights_fingerprint(hf, 0, memo)
        assert weights_fingerprint(hf, 1, memo) == first, "the seed does not matter for loaded weights"
        (hf / "model.safetensors").write_bytes(b"weights v2")
        assert weights_fingerprint(hf, 0, memo) != first
        assert weights_fingerprint(None, 0, memo) != weights_fingerprint(None, 1, memo)
        parts = {"weights": first, "model": {"hidden_size": 32}, "data": "plan-a"}
        key = reference_key(parts)
        assert reference_key(dict(parts)) == key
        for change in ({"weights": weights_fingerprint(hf, 0, memo)}, {"model": {"hidden_size": 64}},
                       {"data": "plan-b"}):  # fmt: skip
            assert reference_key({**parts, **change}) != key
        assert reference_key(parts, code=(sequence_logps,)) != key


class TestTableKey:
    def test_the_key_follows_the_compute_dtypes(self, tmp_path):
        """A table computed under FSDP's bf16 compute dtype is not read by a run that computes in fp32 (or under
        another precision): the strategy's compute dtype and the trainer's precision are part of the key."""
        from xtl.train.reference_tables import PrecomputedReference

        def keys(gathered, precision="32-true") -> dict[str, str]:
            module = SimpleNamespace(
                model_transforms=[], global_rank=0, hf_dir=None,
                hparams=SimpleNamespace(seed=0, param_dtype="float32"),
                trainer=SimpleNamespace(strategy=SimpleNamespace(broadcast=lambda x, src: x), precision=precision),
                model_config=_module().model_config, device=torch.device("cpu"),
                parallelizer=SimpleNamespace(gathered_dtype=gathered),
            )  # fmt: skip
            data = SimpleNamespace(cache_dir=tmp_path, pack_max_length=128, pad_to_max_length=True)
            return PrecomputedReference(module, _pair_logps, ())._keys(data, {"train": SimpleNamespace(key="k")})

        fp32 = keys(None)
        assert keys(None) == fp32 and keys(torch.bfloat16) != fp32 and keys(None, "bf16-mixed") != fp32


class TestSetFingerprint:
    """The data side of the table's key: every packed set carries the fingerprint of what its packs hold."""

    def _split(self, tmp_path, **overrides):
        rows = (TINY_ASSETS_DIR / "preference_train.jsonl").read_text().splitlines(keepends=True)[:24]
        (tmp_path / "pairs.jsonl").write_text("".join(rows))
        kwargs = dict(sources=[{"path": str(tmp_path / "pairs.jsonl"), "kind": "preference"}], tokenizer="tiny:",
                      pack_max_length=128, cache_dir=str(tmp_path / "cache"), progress=False)  # fmt: skip
        datamodule = XTLDataModule(**{**kwargs, **overrides})
        datamodule.setup()
        return datamodule

    def test_the_key_follows_the_packs(self, tmp_path):
        datamodule = self._split(tmp_path)
        split = datamodule.train_split
        assert split.pairs and self._split(tmp_path).train_split.key == split.key
        assert (tmp_path / "cache/plans" / f"best_fit-128-{split.key[:20]}.npz").is_file(), "the stored plan's key"
        assert self._split(tmp_path, seed=1).train_split.key != split.key
        assert self._split(tmp_path, pack_max_length=96).train_split.key != split.key
        plan = split.plan
        table = np.stack([np.repeat(np.arange(len(plan)), np.diff(plan.pack_offsets)), plan.seg_sample,
                          plan.seg_start, plan.seg_end], axis=1)  # fmt: skip
        np.save(tmp_path / "preset.npy", table)
        preset = self._split(tmp_path, packing="preset", pack_preset=str(tmp_path / "preset.npy")).train_split
        assert preset.key and preset.key != split.key
        np.save(tmp_path / "preset.npy", table[:-2])  # the last pair left out
        assert self._split(
            tmp_path, packing="preset", pack_preset=str(tmp_path / "preset.npy")
        ).train_split.key not in (preset.key, split.key)

    def test_the_collator_keeps_the_pack_index(self, tmp_path):
        datamodule = self._split(tmp_path)
        (mb,) = datamodule.collator()([datamodule.train_split.packs[3]])
        offsets = pair_offsets(datamodule.train_split.plan)
        assert mb.pack_index == 3 and pair_count(mb) == offsets[4] - offsets[3] > 0
        assert mb.seq_ctx.seq_len == 128, "padded as the loaders pad"


class TestRefusals:
    def test_no_reference_for_dpo(self):
        with pytest.raises(ConfigError, match="reference: none, but the objective compares with a reference"):
            PreferenceModule(MODEL, reference="none")

    def test_adapters_off_without_lora(self):
        with pytest.raises(ConfigError, match="adapters_off needs LoRA adapters"):
            _module(reference="adapters_off")

    @pytest.mark.parametrize(
        ("kwargs", "message"),
        [
            ({"loss_type": "dpo"}, "loss_type: 'dpo' is not one of"),
            ({"beta": 0.0}, "beta must be > 0"),
            ({"label_smoothing": 0.5}, r"label_smoothing must be in \[0, 0.5\)"),
            ({"loss_type": "ipo", "label_smoothing": 0.1}, "label_smoothing applies to sigmoid, robust and simpo"),
            ({"loss_type": "kto", "rpo_alpha": 0.5}, "rpo_alpha applies to paired losses, not kto"),
            ({"loss_type": "kto", "undesirable_weight": 0.0}, "undesirable_weight must be > 0"),
            ({"desirable_weight": 2.0}, "desirable_weight applies to kto and apo_zero_unpaired, not sigmoid"),
        ],
    )
    def test_bad_settings(self, kwargs, message):
        with pytest.raises(ConfigError, match=message):
            PreferenceLoss(**kwargs)


def _unpaired(lengths: list[int], labels: list[int], seed: int = 0, index: int = 0) -> MicroBatch:
    """A pack of rows (own, mismatched document of each) carrying ``labels``."""
    mb = _pairs(lengths, seed, index)
    return dataclasses.replace(mb, doc_tags=tuple(t for label in labels for t in (label, label)))


class TestUnpaired:
    def test_kto_terms_by_label(self):
        """Rewards and losses follow each row's label; the reference point is the mean of the mismatched
        log-ratios, clamped at 0; the metric means divide by the desirable and undesirable counts."""
        own, other = torch.tensor([-3.0, -5.0, -2.0]), torch.tensor([-4.0, -6.0, -1.0])
        tokens = torch.ones(3)
        policy = SequenceLogps(own, other, tokens, tokens)
        reference = SequenceLogps(
            own - torch.tensor([1.0, -2.0, 0.5]), other - torch.tensor([0.3, 0.6, -0.3]), tokens, tokens
        )
        objective = PreferenceLoss("kto", beta=0.5, desirable_weight=2.0)
        kl = objective.kl_point(policy, reference)
        assert kl.item() == pytest.approx(0.2)
        labels = torch.tensor([True, False, True])
        terms = objective.terms(policy, reference, torch.zeros(()), labels, kl)
        ratio = torch.tensor([1.0, -2.0, 0.5])
        losses = [2 * (1 - torch.sigmoid(0.5 * (ratio[0] - 0.2))), 1 - torch.sigmoid(0.5 * (0.2 - ratio[1])),
                  2 * (1 - torch.sigmoid(0.5 * (ratio[2] - 0.2)))]  # fmt: skip
        assert terms.loss_sum.item() == pytest.approx(sum(losses).item())
        means = objective.metric_means(terms.metric_sums, torch.tensor(3.0))
        assert means["rewards/chosen"].item() == pytest.approx(0.5 * (1.0 + 0.5) / 2)
        assert means["rewards/rejected"].item() == pytest.approx(0.5 * -2.0)
        assert means["rewards/margins"].item() == pytest.approx(0.375 + 1.0)
        assert means["logps/rejected"].item() == pytest.approx(-5.0) and means["kl"].item() == pytest.approx(0.2)
        below = SequenceLogps(own, other, tokens, tokens)  # the policy below the reference: the point is 0
        assert objective.kl_point(below, SequenceLogps(own, other + 1, tokens, tokens)).item() == 0

    def test_step_zero_loss_is_one_half(self):
        module = _module(objective=PreferenceLoss("kto", beta=0.1))
        _, terms, _ = module._pair_terms(_unpaired([9, 7, 12, 10], [1, 0]))
        assert terms.loss_sum.item() == pytest.approx(2 * 0.5)  # policy == reference: 1 - sigmoid(0) per row
        assert terms.metric_sums["count/chosen"].item() == terms.metric_sums["count/rejected"].item() == 1

    def test_a_precomputed_reference_equals_the_live_one(self):
        """The table's columns are each row's own and mismatched log-probabilities: with the policy moved, KTO's
        loss, rewards and KL reference point equal a live reference's."""
        kto = PreferenceLoss("kto", beta=0.5)
        live, precomputed = _module(reference="live", objective=kto), _module(reference="precomputed", objective=kto)
        precomputed.precomputed.tables["train"] = _table(precomputed, PACKS)
        with torch.no_grad():  # flatter logits
            for module in (live, precomputed):
                module.model.lm_head.weight.mul_(0.25)
        points = []
        for i, lengths in enumerate(PACKS):
            mb = _unpaired(lengths, [k % 2 for k in range(len(lengths) // 2)], seed=i, index=i)
            (_, want, _), (_, got, _) = live._pair_terms(mb), precomputed._pair_terms(mb)
            for key in ("rewards/chosen", "rewards/rejected", "kl"):
                torch.testing.assert_close(got.metric_sums[key], want.metric_sums[key], rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(got.loss_sum, want.loss_sum, rtol=1e-6, atol=0)
            points.append(float(got.metric_sums["kl"]))
        assert max(points) > 0, "the moved policy's reference point is off 0 somewhere"

    def test_under_lora_the_adapters_off_model_is_the_reference(self):
        """KTO with ``adapters_off``: the adapted policy's rewards and KL point are measured against the base model,
        the same as a live copy of the base gives."""
        kto = PreferenceLoss("kto", beta=0.5)
        live = _module(reference="live", objective=kto)
        lora = _module(reference="adapters_off", objective=kto, callbacks=(LoRA(rank=2),))
        _train_adapters(lora)
        live.model.load_state_dict({k: v for k, v in lora.model.state_dict().items() if "lora_" not in k})
        mb = _unpaired([9, 7, 12, 10], [1, 0])
        with torch.no_grad():
            want_policy = sequence_logps(score_tokens(lora.model, mb.seq_ctx, mb.labels), mb)[0]
        _, got, _ = lora._pair_terms(mb)
        live_ref = sequence_logps(score_tokens(live.reference.frozen, mb.seq_ctx, mb.labels), mb)[0]
        want = kto.terms(want_policy, live_ref, torch.zeros(()), torch.tensor([True, False]),
                         kto.kl_point(want_policy, live_ref))  # fmt: skip
        assert got.metric_sums["rewards/chosen"] != 0
        for key in ("rewards/chosen", "rewards/rejected", "kl"):
            torch.testing.assert_close(got.metric_sums[key], want.metric_sums[key], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(got.loss_sum, want.loss_sum, rtol=1e-6, atol=0)

    def test_the_data_kind_must_match_the_objective(self):
        module = _module(objective=PreferenceLoss("kto"))
        with pytest.raises(ConfigError, match="loss_type: kto trains on rows labeled desirable or not"):
            module._pair_terms(_pairs([9, 7]))
        with pytest.raises(ConfigError, match="loss_type: sigmoid trains on chosen/rejected pairs"):
            _module()._pair_terms(_unpaired([9, 7], [1]))

    def test_setup_refuses_sets_of_the_other_kind(self, tmp_path):
        module = PreferenceModule(MODEL, objective=PreferenceLoss("kto"))
        data = XTLDataModule(
            sources=[SourceSpec("tiny:kto_train.jsonl", kind="unpaired_preference")],
            val_sources={"held_out": [SourceSpec("tiny:preference_eval.jsonl", kind="preference")]},
            tokenizer="tiny:",
            cache_dir=str(tmp_path),
        )
        with pytest.raises(ConfigError, match="data.val_sources.held_out has kind: preference"):
            module._check_data_kinds(data)
        PreferenceModule(MODEL)._check_data_kinds(  # a DPO run on pairs
            XTLDataModule(sources=[SourceSpec("tiny:preference_train.jsonl", kind="preference")], tokenizer="tiny:")
        )
