"""Logger fragments append to the recipe's CSV logger; the TensorBoard one writes ``train/loss`` events."""

from __future__ import annotations

from pathlib import Path

import pytest

from xtl.command import main

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--model.init_args.model.hidden_size", "32", "--model.init_args.model.intermediate_size", "64",
         "--model.init_args.model.num_hidden_layers", "2", "--model.init_args.model.head_dim", "8",
         "--data.pack_max_length", "128", "--trainer.enable_progress_bar", "false"]  # fmt: skip


class TestTensorBoardFragment:
    def test_writes_train_loss_events_next_to_the_csv_metrics(self, tmp_path, data_cache):
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        fragment = ROOT / "callbacks/tensorboard.yaml"
        args = ["fit", "--config", str(ROOT / "configs/tiny_sft.yaml"), "--config", str(fragment), *SMALL,
                "--data.cache_dir", str(data_cache), "--trainer.default_root_dir", str(tmp_path),
                "--trainer.max_steps", "3", "--trainer.val_check_interval", "null"]  # fmt: skip
        assert main(args) == 0
        (events,) = tmp_path.glob("tensorboard/version_0/events.out.tfevents.*")
        accumulator = EventAccumulator(str(events.parent))
        accumulator.Reload()
        assert [event.step for event in accumulator.Scalars("train/loss")] == [0, 1, 2]
        assert next(tmp_path.glob("logs/version_0/metrics.csv")).is_file(), "the CSV logger is still there"


class TestFragmentsParse:
    @pytest.mark.parametrize("fragment", ["wandb.yaml", "throughput.yaml", "tensorboard.yaml"])
    def test_appends_to_the_recipe(self, fragment, capsys):
        args = ["fit", "--config", str(ROOT / "configs/tiny_sft.yaml"), "--config", str(ROOT / "callbacks" / fragment),
                "--print_config"]  # fmt: skip
        with pytest.raises(SystemExit) as exit_:  # --print_config exits after printing
            main(args)
        assert exit_.value.code in (0, None)
        out = capsys.readouterr().out
        assert "CSVLogger" in out and "TrainingCheckpoint" in out, "a fragment appends, it does not replace"
        expected = {
            "wandb.yaml": "WandbLogger",
            "throughput.yaml": "Throughput",
            "tensorboard.yaml": "TensorBoardLogger",
        }
        assert expected[fragment] in out
