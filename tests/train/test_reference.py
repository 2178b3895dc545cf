"""The reference policy (:mod:`xtl.train.reference`): settings and their errors, the modes' resolution, a separate
reference model, and TR-DPO's periodic sync (equal to TRL's ``SyncRefModelCallback``).

Its equality with TRL's reference (a continued adapter, ``ref_model``) is in ``test_reference_trl.py``; runs through
``xtl fit`` (a synced reference resumes exactly) in ``test_preference_fit.py``.
"""

from __future__ import annotations

import pytest
import torch
from trl.trainer.callbacks import SyncRefModelCallback

from xtl.callbacks import LoRA
from xtl.errors import ConfigError
from xtl.rl import GRPOModule, PolicyLossConfig
from xtl.train import PreferenceModule
from xtl.train.reference import ReferenceConfig, ReferencePolicy, reference_config

from .test_preference import MODEL, _module


class TestSettings:
    def test_a_mode_name_is_short_for_the_config(self):
        assert reference_config("live") == ReferenceConfig(mode="live")
        assert reference_config({"mode": "model", "model": "qwen3-0.6b"}).model == "qwen3-0.6b"

    @pytest.mark.parametrize(
        ("kwargs", "message"),
        [
            ({"mode": "ref"}, "mode: 'ref' is not one of auto, live"),
            ({"mode": "model"}, "mode: model names the reference in model:"),
            ({"model": "x"}, "mode: model names the reference in model:"),
            ({"adapter": "a"}, "reference.adapter applies to mode: model"),
            ({"sync_every": 0}, "sync_every must be >= 1"),
            ({"mode": "precomputed", "sync_every": 4}, "mode: precomputed has none: use mode live or model"),
            ({"mixup_alpha": 0.0}, r"mixup_alpha must be in \(0, 1\]"),
        ],
    )
    def test_bad_settings(self, kwargs, message):
        with pytest.raises(ConfigError, match=message):
            ReferenceConfig(**kwargs)

    def test_modes_the_objective_cannot_use(self):
        with pytest.raises(ConfigError, match="reference: none, but the objective compares"):
            ReferencePolicy(ReferenceConfig("none"), needs_reference=True)
        with pytest.raises(ConfigError, match="reference: live, but the objective uses no reference"):
            ReferencePolicy(ReferenceConfig("live"), needs_reference=False)
        with pytest.raises(ConfigError, match="precomputed reads a table computed before training"):
            ReferencePolicy(ReferenceConfig("precomputed"), needs_reference=True, precomputable=False)
        with pytest.raises(ConfigError, match="precomputed reads a table computed before training"):
            GRPOModule(MODEL, reference="precomputed", objective=PolicyLossConfig(beta=0.1))


class TestModes:
    def test_adapters_off_without_lora_names_live(self):
        with pytest.raises(ConfigError, match="adapters_off needs LoRA adapters .* use live"):
            _module(reference="adapters_off")

    def test_sync_refused_under_lora(self):
        with pytest.raises(ConfigError, match="under LoRA the reference is the policy's own starting adapters"):
            _module(reference={"mode": "live", "sync_every": 2}, callbacks=(LoRA(rank=2),))

    def test_a_separate_model_must_read_the_policy_s_tokens(self):
        small = {**MODEL, "vocab_size": 64}
        with pytest.raises(ConfigError, match="vocab_size 64, smaller than the policy's 97"):
            _module(reference={"mode": "model", "model": small})

    def test_a_separate_model_of_the_same_config_is_the_policy_at_the_same_seed(self):
        """A from-scratch reference model (a config mapping) initializes from the run's seed: the policy's start."""
        module = _module(reference={"mode": "model", "model": MODEL})
        assert module.reference.mode == "model" and "separate model" in module.reference.describe()
        policy, reference = module.model.state_dict(), module.reference.frozen.state_dict()
        assert all(torch.equal(policy[name], reference[name]) for name in policy)

    def test_the_frozen_copy_is_out_of_checkpoints_unless_synced(self):
        plain, synced = _module(), _module(reference={"mode": "live", "sync_every": 3})
        assert not any(key.startswith("reference.") for key in plain.state_dict())
        assert any(key.startswith("reference.frozen.") for key in synced.state_dict())


class TestSync:
    def test_equals_trl_sync_every_n_steps(self):
        """``sync_every: 2``: steps 1 and 3 leave the reference alone, step 2 mixes it as TRL's callback does."""
        module = _module(reference={"mode": "live", "sync_every": 2, "mixup_alpha": 0.3})
        want = PreferenceModule(MODEL)
        want.configure_model()
        target = want.reference.frozen
        with torch.no_grad():
            for step in (1, 2, 3):
                for param in module.model.parameters():
                    param.add_(0.01 * step)
                module.reference.after_optimizer_step(module.model, step)
                if step % 2 == 0:
                    SyncRefModelCallback._sync_target_model(module.model, target, 0.3)
                frozen = dict(module.reference.frozen.named_parameters())
                for name, param in target.named_parameters():
                    torch.testing.assert_close(frozen[name], param, rtol=0, atol=0, msg=f"step {step} {name}")
        assert not torch.equal(frozen["lm_head.weight"], module.model.lm_head.weight)

    def test_frozen_parts_are_not_mixed(self):
        module = _module(reference={"mode": "live", "sync_every": 1, "mixup_alpha": 0.5})
        module.model.embed_tokens.weight.requires_grad_(False)
        with torch.no_grad():
            module.model.embed_tokens.weight.add_(1.0)  # (a frozen part never moves; here it did, to see it)
            module.model.lm_head.weight.add_(1.0)
        before = module.reference.frozen.embed_tokens.weight.clone()
        module.reference.after_optimizer_step(module.model, 1)
        assert torch.equal(module.reference.frozen.embed_tokens.weight, before)
        assert not torch.equal(module.reference.frozen.lm_head.weight, module.model.lm_head.weight - 1.0)
