"""``--ckpt_path`` refuses a checkpoint another objective saved (an SFT checkpoint given to a DPO run would silently
train SFT), and ``--ckpt_path last`` without a last checkpoint is an error naming the folder."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from jsonargparse import Namespace

from tests.cli.test_cli import ROOT, _run_main
from xtl.cli import _refuse_foreign_checkpoint
from xtl.errors import ConfigError

DPO = ["--config", str(ROOT / "configs/tiny_dpo.yaml"), "--trainer.enable_progress_bar", "false"]
SFT_HPARAMS = {"_class_path": "xtl.train.LanguageModule", "model": {"model_type": "qwen3"}}


def _sft_checkpoint(path: Path, dcp_dir: bool = False) -> Path:
    """A checkpoint as an SFT fit saves it: a file, or a DCP directory with its ``meta.pt``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"global_step": 5, "hyper_parameters": dict(SFT_HPARAMS)}
    if dcp_dir:
        dcp.save({"w": torch.zeros(8)}, checkpoint_id=path, no_dist=True)
        torch.save(meta, path / "meta.pt")
    else:
        torch.save({**meta, "state_dict": {"w": torch.zeros(8)}}, path)
    return path


def _refusal(given: str, path: Path) -> str:
    return (
        f"xtl: error: checkpoint {path}{'' if given == str(path) else f' (--ckpt_path {given})'} was saved by a "
        "SFT/pretraining run (xtl.train.LanguageModule), but this config trains preference (DPO, KTO, ...) "
        "(model.class_path xtl.train.PreferenceModule): --ckpt_path resumes or evaluates a run of the same objective "
        "only. To start from that run's weights, set model.init_args.model to its HF export (<run>/hf/final, written "
        "by a fit with --config callbacks/hf_export.yaml) and leave --ckpt_path out"
    )


class TestForeignCheckpoint:
    @pytest.fixture(autouse=True)
    def _in_tmp(self, tmp_path, monkeypatch):
        monkeypatch.chdir(tmp_path)
        for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):
            monkeypatch.delenv(name, raising=False)

    @pytest.mark.parametrize("dcp_dir", [False, True], ids=["file", "dcp"])
    def test_an_sft_checkpoint_given_to_a_dpo_run_is_refused(self, tmp_path, capsys, dcp_dir):
        ckpt = _sft_checkpoint(tmp_path / "sft/epoch=0-step=5.ckpt", dcp_dir)
        for command in ("fit", "validate"):
            assert _run_main([command, *DPO, "--ckpt_path", str(ckpt)]) == 2
            err = capsys.readouterr().err
            assert _refusal(str(ckpt), ckpt) in err, err
            assert "callbacks/hf_export.yaml" in err and "model.init_args.model" in err
            assert len(err.strip().splitlines()) == 1

    @pytest.mark.parametrize("keyword", ["last", "auto"])
    def test_last_and_auto_finding_a_foreign_checkpoint_are_refused(self, tmp_path, capsys, keyword):
        """The DPO run's own folder holds an SFT ``last.ckpt`` (e.g. copied there)."""
        ckpt = _sft_checkpoint(tmp_path / "runs/tiny_dpo/checkpoints/last.ckpt")
        assert _run_main(["fit", *DPO, "--ckpt_path", keyword]) == 2
        err = capsys.readouterr().err
        assert _refusal(keyword, ckpt) in err, err

    def test_last_without_a_last_checkpoint_is_an_error_naming_the_folder(self, tmp_path, capsys):
        folder = tmp_path / "runs/tiny_dpo/checkpoints"
        assert _run_main(["fit", *DPO, "--ckpt_path", "last"]) == 2
        err = capsys.readouterr().err
        assert f"xtl: error: --ckpt_path last found no last checkpoint in {folder}: pass --ckpt_path auto" in err
        # a periodic checkpoint is not a last one: still an error (auto would take it)
        _sft_checkpoint(folder / "epoch=0-step=5.ckpt")
        assert _run_main(["fit", *DPO, "--ckpt_path", "last"]) == 2
        assert "found no last checkpoint" in capsys.readouterr().err


class TestRefuseForeignCheckpoint:
    def test_the_same_class_by_another_path_and_a_config_without_a_class_pass(self, tmp_path):
        path = str(tmp_path / "x.ckpt")
        config = Namespace(class_path="xtl.train.base.LanguageModule")
        _refuse_foreign_checkpoint(path, SFT_HPARAMS, config, path)  # the same class, spelled by its module
        _refuse_foreign_checkpoint(path, SFT_HPARAMS, None, path)  # no model class in the config: the checkpoint's
        _refuse_foreign_checkpoint(path, {}, Namespace(class_path="xtl.train.PreferenceModule"), path)  # none saved
        with pytest.raises(ConfigError, match=r"saved by a SFT/pretraining run .* this config trains GRPO"):
            _refuse_foreign_checkpoint(path, SFT_HPARAMS, Namespace(class_path="xtl.rl.GRPOModule"), path)
        # a subclass is another objective (online DPO is a GRPOModule)
        online = {"_class_path": "xtl.rl.OnlineDPOModule"}
        with pytest.raises(ConfigError, match=r"saved by a online DPO run"):
            _refuse_foreign_checkpoint(path, online, Namespace(class_path="xtl.rl.GRPOModule"), path)
