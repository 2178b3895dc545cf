"""A model path that does not exist is named as such, with how to create it where it is a run's HF export."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch  # noqa: F401 - imported here, its log handler writes to the real stderr, not a test's capture
import pytest

from xtl.command import main
from xtl.errors import ConfigError
from xtl.train import resolve_model_config
from xtl.train.model_spec import SFT_EXPORT_COMMAND

ROOT = Path(__file__).resolve().parents[2]


class TestMissingModelPath:
    def test_the_sft_export_says_to_run_the_sft_recipe_first(self, tmp_path, monkeypatch):
        monkeypatch.chdir(tmp_path)
        with pytest.raises(ConfigError) as err:
            resolve_model_config("runs/tiny_sft_export/hf/final")
        message = str(err.value)
        assert message.startswith("model.init_args.model: model path 'runs/tiny_sft_export/hf/final' does not exist")
        assert f"create it first: it is the SFT recipe's export, `{SFT_EXPORT_COMMAND}`" in message
        assert "nor a known alias" not in message

    def test_the_sft_command_writes_that_path(self):
        """The hint's command exports where the tiny recipes read: ``<default_root_dir>/hf/final``."""
        words = SFT_EXPORT_COMMAND.split()
        root = words[words.index("--trainer.default_root_dir") + 1]
        assert f"{root}/hf/final" == "runs/tiny_sft_export/hf/final"
        export = (ROOT / "callbacks/hf_export.yaml").read_text()
        assert "HFExport" in export and (ROOT / "configs/tiny_sft.yaml").exists()
        for name in ("tiny_dpo", "tiny_kto", "tiny_grpo"):
            assert "model: runs/tiny_sft_export/hf/final" in (ROOT / f"configs/{name}.yaml").read_text()

    def test_another_runs_export_names_the_run_not_the_sft_recipe(self, tmp_path, monkeypatch):
        monkeypatch.chdir(tmp_path)
        with pytest.raises(ConfigError, match="does not exist") as err:
            resolve_model_config("runs/tiny_agent_sft_export/hf/final")
        assert "HF export of the run in runs/tiny_agent_sft_export" in str(err.value)
        assert "tiny_sft.yaml" not in str(err.value)

    @pytest.mark.parametrize("path", ["./nothere", "models/nothere/x", "~/nothere-xtl"])
    def test_any_missing_path(self, path, tmp_path, monkeypatch):
        monkeypatch.chdir(tmp_path)
        with pytest.raises(ConfigError, match=rf"model path '\S*{Path(path).name}' does not exist .*; fix the path$"):
            resolve_model_config(path)

    def test_an_unknown_alias_is_not_a_path(self):
        with pytest.raises(ConfigError, match="neither an HF model directory nor a known alias"):
            resolve_model_config("qwen3-8bb")

    def test_the_dpo_recipe_before_the_export(self, tmp_path, monkeypatch, capsys):
        monkeypatch.chdir(tmp_path)
        args = ["fit", "--config", str(ROOT / "configs/tiny_dpo.yaml"), "--trainer.max_steps", "1"]
        code = main(args)
        err = capsys.readouterr().err
        assert code == 2 and "Traceback" not in err, err
        assert "model path 'runs/tiny_sft_export/hf/final' does not exist" in err and SFT_EXPORT_COMMAND in err, err
