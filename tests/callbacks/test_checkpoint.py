"""``xtl.callbacks.TrainingCheckpoint``: ``last`` holds the final step of a fit that ends between two saves."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from tests.cli.test_cli import RECIPES, ROOT, _run_main, _tiny_args


class TestLastIsTheNewestState:
    def test_a_fit_ending_between_two_saves_writes_its_final_step_to_last(self, tmp_path, monkeypatch, data_cache):
        monkeypatch.chdir(tmp_path)
        every_two = tmp_path / "every_two.yaml"
        every_two.write_text(
            "trainer:\n  val_check_interval: null\n  callbacks:\n    - class_path: xtl.callbacks.TrainingCheckpoint\n"
            "      init_args: {dirpath: checkpoints, save_last: true, every_n_train_steps: 2, save_top_k: -1}\n"
            "data:\n  val_sources: null\n"
        )
        args = _tiny_args(ROOT / "configs/tiny_sft.yaml", data_cache, "--config", str(every_two))
        assert _run_main(["fit", *args, "--trainer.max_steps", "3"]) == 0
        checkpoints = Path("runs/tiny_sft/checkpoints")
        assert sorted(p.name for p in checkpoints.iterdir()) == ["epoch=0-step=2.ckpt", "last.ckpt"]
        assert torch.load(checkpoints / "last.ckpt", weights_only=False)["global_step"] == 3

    @pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
    def test_every_recipe_checkpoints_with_it_and_logs_to_csv(self, recipe):
        callbacks = yaml.safe_load(recipe.read_text())["trainer"].get("callbacks", [])
        paths = [c["class_path"] for c in callbacks if c["class_path"].endswith(("ModelCheckpoint", "Checkpoint"))]
        assert paths == ["xtl.callbacks.TrainingCheckpoint"]
        loggers = yaml.safe_load(recipe.read_text())["trainer"]["logger"]
        assert {
            "class_path": "lightning.pytorch.loggers.CSVLogger",
            "init_args": {"save_dir": ".", "name": "logs"},
        } in loggers
