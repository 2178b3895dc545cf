"""Preference optimization on packed pairs: per-response log-probabilities, the references, normalization, refusals.

The TRL parity of the losses is in ``test_preference_trl.py``; the runs through ``xtl fit`` in
``test_preference_fit.py``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from xtl.data import Pack, collate_pack
from xtl.errors import ConfigError
from xtl.module.lora import adapters_disabled, add_lora
from xtl.train import PreferenceLoss, PreferenceModule
from xtl.train.preference import pair_count, sequence_logps

MODEL = {
    "model_type": "qwen3", "vocab_size": 97, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "attn_impl": "sdpa",
}  # fmt: skip
PROMPT = 4


def _pairs(lengths: list[int], seed: int = 0):
    """A pack of pairs with the given document lengths (chosen, rejected, ...): each document starts with the same
    4 prompt tokens (unsupervised) as its partner."""
    rng = np.random.default_rng(seed)
    ids, labels = [], []
    for k in range(0, len(lengths), 2):
        prompt = rng.integers(1, 97, PROMPT)
        for length in lengths[k : k + 2]:
            doc = np.concatenate([prompt, rng.integers(1, 97, length - PROMPT)])
            ids.append(doc)
            labels.append(np.where(np.arange(length) < PROMPT, -100, doc))
    return collate_pack(Pack(0, np.concatenate(ids), np.concatenate(labels), lengths))


def _module(**kwargs) -> PreferenceModule:
    module = PreferenceModule(MODEL, **kwargs)
    module.configure_model()
    return module


class TestSequenceLogps:
    @pytest.mark.parametrize("lengths", [[9, 7, 12, 10], [6, 30, 5, 5, 17, 8]])
    def test_equal_the_log_softmax_of_each_response(self, lengths):
        """Summed log-probabilities of each response's supervised tokens, from the full logits (fp32, 1e-5)."""
        module = _module(objective=PreferenceLoss("simpo"))
        mb = _pairs(lengths)
        out = module.model(seq_ctx=mb.seq_ctx, labels=mb.labels, return_logits=False, return_token_losses=True)
        got, nll = sequence_logps(out, mb)
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
        """Step 0: policy = reference, so rewards are 0 and the DPO loss is log 2 per pair; the reference is not a
        submodule (no optimizer state, not in checkpoints) and has no gradient."""
        module = _module()
        assert module.resolved_reference == "live"
        mb = _pairs([9, 7, 12, 10])
        _, terms = module._pair_terms(mb)
        assert terms.metric_sums["rewards/margins"] == 0
        assert math.isclose(float(terms.loss_sum.detach()), 2 * math.log(2), rel_tol=1e-6)
        names = {name for name, _ in module.named_parameters()}
        assert all(name.startswith("model.") for name in names)
        assert not any(p.requires_grad for p in module._reference[0].parameters())

    def test_the_reference_stays_while_the_policy_moves(self):
        module = _module()
        mb = _pairs([9, 7, 12, 10])
        with torch.no_grad():
            module.model.lm_head.weight.mul_(1.5)
        _, terms = module._pair_terms(mb)
        assert terms.metric_sums["rewards/chosen"] != 0

    def test_adapters_off_is_the_base_model(self):
        """Under LoRA, the reference is the same model with adapters off: equal to the model before adapters."""
        module = _module(reference="live")
        mb = _pairs([9, 7, 12, 10])
        base = module.model(seq_ctx=mb.seq_ctx, labels=mb.labels, return_logits=False).loss_sum
        add_lora(module.model.layers[0].self_attn.q_proj, rank=2, alpha=4)
        torch.nn.init.normal_(module.model.layers[0].self_attn.q_proj.lora_B.weight)
        adapted = module.model(seq_ctx=mb.seq_ctx, labels=mb.labels, return_logits=False).loss_sum
        with adapters_disabled(module.model):
            off = module.model(seq_ctx=mb.seq_ctx, labels=mb.labels, return_logits=False).loss_sum
        assert adapted != base and off == base
        module.reference_mode = "auto"
        assert module.resolved_reference == "adapters_off"

    def test_reference_free_losses_need_no_reference(self):
        assert _module(objective=PreferenceLoss("orpo")).resolved_reference == "none"


class TestRefusals:
    def test_no_reference_for_dpo(self):
        with pytest.raises(ConfigError, match="reference: none, but loss_type 'sigmoid'"):
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
        ],
    )
    def test_bad_settings(self, kwargs, message):
        with pytest.raises(ConfigError, match=message):
            PreferenceLoss(**kwargs)
