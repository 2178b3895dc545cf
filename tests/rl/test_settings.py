"""GRPOModule's grouped settings: their checks, and where the flat keys of earlier releases went."""

from __future__ import annotations

import pytest

from xtl.errors import ConfigError
from xtl.rl import RolloutSettings, UpdateSettings
from xtl.rl.settings import MOVED_KEYS, moved_key


class TestRolloutSettings:
    @pytest.mark.parametrize(
        ("settings", "says"),
        [
            ({"prompts_per_step": 0}, "model.init_args.rollout.prompts_per_step must be >= 1, got 0"),
            ({"max_rounds": 0}, "model.init_args.rollout.max_rounds must be >= 1"),
            ({"oversample": 0.5}, "model.init_args.rollout.oversample must be >= 1, got 0.5"),
            ({"max_staleness": -1}, "model.init_args.rollout.max_staleness must be >= 0"),
            ({"overlong_buffer": 0}, "model.init_args.rollout.overlong_buffer must be >= 1"),
            ({"overlong_penalty": -1.0}, "model.init_args.rollout.overlong_penalty must be >= 0"),
        ],
    )
    def test_out_of_range(self, settings, says) -> None:
        with pytest.raises(ConfigError, match=says):
            RolloutSettings(**settings)


class TestUpdateSettings:
    def test_out_of_range_and_steps_per_batch(self) -> None:
        for name in ("mini_batches", "epochs", "micro_batches"):
            with pytest.raises(ConfigError, match=f"model.init_args.updates.{name} must be >= 1"):
                UpdateSettings(**{name: 0})
        assert UpdateSettings(mini_batches=2, epochs=3).steps_per_batch == 6


class TestMovedKeys:
    def test_every_flat_key_names_a_setting_of_its_group(self) -> None:
        from xtl.rl import EngineSettings

        groups = {"rollout": RolloutSettings(), "updates": UpdateSettings(), "engine": EngineSettings()}
        for old, new in MOVED_KEYS.items():
            group, name = new.split(".")
            assert hasattr(groups[group], name) and name == old, (old, new)

    def test_messages(self) -> None:
        assert moved_key("max_rounds") == (
            "model.init_args.max_rounds has moved to model.init_args.rollout.max_rounds (GRPOModule's settings are "
            "grouped under rollout:, updates: and engine:, see docs/configs.md)"
        )
        assert moved_key("engine", "ray", "--model.init_args.").startswith(
            "--model.init_args.engine: ray has moved to --model.init_args.engine.name"
        )
        assert moved_key("engine", {"name": "ray"}) is None and moved_key("engine", "{name: ray}") is None
        assert moved_key("optimizer") is None
