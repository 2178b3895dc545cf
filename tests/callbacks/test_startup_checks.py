"""Startup checks of the callbacks that read or write later in a run (:mod:`xtl.callbacks._startup`, ``load_tasks`` of
:mod:`xtl.callbacks.lm_eval_run`): an lm-eval dataset that cannot be loaded and a results folder that cannot be
written are refused in one line, exit 2, before the first training step, in ``xtl fit`` and ``xtl eval``."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import datasets
import huggingface_hub.constants
import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoTokenizer

from tests.cli.test_cli import ROOT, _run_main, _tiny_args
from tests.train.test_step import _free_port
from xtl.callbacks._startup import _unwritable, raise_on_every_rank
from xtl.callbacks.lm_eval_run import EvalSettings, load_tasks, resolve_tasks
from xtl.errors import ConfigError
from xtl.train.model_spec import resolve_model_config
from xtl.utils import TINY_ASSETS_DIR

HUB_TASK = """task: hub_choice
dataset_path: xtl-tests/no-such-dataset
test_split: test
output_type: multiple_choice
doc_to_text: "{{q}}"
doc_to_choice: "{{options}}"
doc_to_target: "{{label}}"
metric_list:
  - metric: acc
"""
LOAD_BOUND_S = 5.0  # the Hub client's retries take ~25 s per dataset without a network (1+2+4+8+8 s of backoff)


@pytest.fixture
def no_hub(tmp_path, monkeypatch):
    """The Hub at a closed port (refused at once, online or not) and empty Hub and datasets caches."""
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub_cache"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets_cache")


@pytest.fixture
def hub_task(tmp_path) -> Path:
    """A task YAML whose dataset is a Hub repository."""
    path = tmp_path / "hub_choice.yaml"
    path.write_text(HUB_TASK)
    return path


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    """A tiny random xtl model exported to an HF directory with the tiny tokenizer."""
    path = tmp_path_factory.mktemp("export") / "hf"
    config, _ = resolve_model_config(
        dict(model_type="qwen3", vocab_size=1600, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
             num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=128),
        None,
    )  # fmt: skip
    with torch.device("meta"):
        model = config.build()
    model.materialize("cpu")
    model.init_weights()
    model.save_hf(path, dtype=torch.float32)
    AutoTokenizer.from_pretrained(TINY_ASSETS_DIR).save_pretrained(path)
    return path


class StepRecorder(pl.Callback):
    """Touch ``step_started`` in the working directory when a training step starts."""

    def on_train_batch_start(self, *args: Any) -> None:
        """Record that a step started."""
        Path("step_started").touch()


def _fit(tmp_path: Path, data_cache: Path, fragment: str) -> None:
    """Run a one-step tiny fit with ``fragment`` in ``tmp_path``; assert it is refused before its first step."""
    fragment += "    - class_path: tests.callbacks.test_startup_checks.StepRecorder\n"
    (tmp_path / "fragment.yaml").write_text(fragment)
    args = _tiny_args(ROOT / "configs" / "tiny_sft.yaml", data_cache, "--config", str(tmp_path / "fragment.yaml"))
    assert _run_main(["fit", *args, "--trainer.max_steps", "1"]) == 2
    assert not (tmp_path / "step_started").exists(), "refused before the first step"
    assert not list(tmp_path.glob("runs/*/checkpoints/*")), "refused before the first step: no checkpoint"
    assert not list(tmp_path.glob("runs/*/logs/*/metrics.csv")), "refused before the first step: no step logged"


class TestLMEvalDatasets:
    def test_unreachable_hub_is_one_line_at_once(self, no_hub, hub_task):
        tasks, manager = resolve_tasks(EvalSettings(tasks=[str(hub_task)]))
        start = time.perf_counter()
        with pytest.raises(ConfigError) as info:
            load_tasks(tasks, manager)
        assert time.perf_counter() - start < LOAD_BOUND_S
        message = str(info.value)
        assert message.startswith(
            "tasks: lm-eval task hub_choice: its dataset (xtl-tests/no-such-dataset) cannot be loaded: the Hugging "
            "Face Hub (http://127.0.0.1:9) cannot be reached ("
        )
        assert "not in the datasets cache" in message and "run once with network access" in message
        assert "\n" not in message

    def test_offline_mode_names_it(self, no_hub, hub_task, monkeypatch):
        monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
        with pytest.raises(ConfigError, match=r"cannot be loaded: offline mode is on \(HF_HUB_OFFLINE\)"):
            load_tasks(*resolve_tasks(EvalSettings(tasks=[str(hub_task)])))

    def test_local_tasks_load_without_asking_the_hub(self, monkeypatch):
        def probe():
            raise AssertionError("local data needs no Hub")

        monkeypatch.setattr("xtl.callbacks.lm_eval_run._hub_unreachable", probe)
        built = load_tasks(*resolve_tasks(EvalSettings(tasks=["tiny_choice", "tiny_exact"])))
        assert [task.task_name for task in built] == ["tiny_choice", "tiny_exact"]
        assert [len(task.dataset["test"]) for task in built] == [200, 200]

    def test_xtl_eval_hellaswag_offline_exits_2_in_one_line(self, no_hub, export, capsys):
        from xtl.tools.eval import main

        start = time.perf_counter()
        assert main(["--model", str(export), "--tasks", "hellaswag", "--limit", "2"]) == 2
        seconds = time.perf_counter() - start
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "Traceback" not in err[0], err
        assert "--tasks: lm-eval task hellaswag: its dataset (Rowan/hellaswag) cannot be loaded: " in err[0]
        assert seconds < 60, f"{seconds:.0f} s: lm-eval's task index takes ~15 s on 2 busy cores, the check < 1 s"

    def test_fit_is_refused_before_its_first_step(self, no_hub, hub_task, tmp_path, data_cache, monkeypatch, capsys):
        monkeypatch.chdir(tmp_path)
        fragment = (
            "trainer:\n  callbacks+:\n    - class_path: xtl.callbacks.LMEval\n"
            f"      init_args: {{tasks: [{hub_task}], every_n_steps: 1}}\n"
        )
        _fit(tmp_path, data_cache, fragment)
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith(
            "xtl: error: LMEval.tasks: lm-eval task hub_choice: its dataset (xtl-tests/no-such-dataset) cannot be "
            "loaded: the Hugging Face Hub"
        ), err
        assert not any("Traceback" in line for line in err)


class TestWritableFolder:
    def test_a_file_on_the_path(self, tmp_path):
        (tmp_path / "file").write_text("")
        assert _unwritable(tmp_path / "file" / "hf") == f"{tmp_path / 'file'} is a file (Not a directory)"
        assert _unwritable(tmp_path / "file") == f"{tmp_path / 'file'} is a file (Not a directory)"

    def test_a_new_folder_is_not_created(self, tmp_path):
        assert _unwritable(tmp_path / "a" / "b") is None
        assert not (tmp_path / "a").exists()

    @pytest.mark.skipif(not hasattr(__import__("os"), "geteuid") or __import__("os").geteuid() == 0, reason="root")
    def test_a_read_only_folder(self, tmp_path):
        (tmp_path / "ro").mkdir(mode=0o555)
        assert _unwritable(tmp_path / "ro" / "hf") == f"{tmp_path / 'ro'}: Permission denied"

    @pytest.mark.parametrize(
        ("callback", "key"),
        [("HFExport", "HFExport.dirpath"), ("LMEval", "LMEval.dirpath"), ("HFParityCheck", "HFParityCheck.dirpath")],
    )
    def test_fit_is_refused_before_its_first_step(self, callback, key, tmp_path, data_cache, monkeypatch, capsys):
        """A relative dirpath is made relative to the run's folder by the config, hence an absolute one here."""
        monkeypatch.chdir(tmp_path)
        (tmp_path / "file").write_text("")
        args = "{tasks: [tiny_choice], apply_chat_template: true, " if callback == "LMEval" else "{"
        fragment = (
            f"trainer:\n  callbacks+:\n    - class_path: xtl.callbacks.{callback}\n"
            f"      init_args: {args}dirpath: {tmp_path}/file/out}}\n"
        )
        _fit(tmp_path, data_cache, fragment)
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1] == (
            f"xtl: error: {key} {tmp_path}/file/out: cannot be written: {tmp_path / 'file'} is a file "
            "(Not a directory); pick a folder that can be created there"
        ), err
        assert not any("Traceback" in line for line in err)


@pytest.mark.distributed
class TestEveryRank:
    def test_an_error_of_rank_1_stops_rank_0_with_its_message(self, tmp_path):
        mp.spawn(_raise_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
        assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == ["the data of rank 1 is missing"] * 2


def _raise_worker(rank: int, port: int, out: str) -> None:
    address = f"tcp://127.0.0.1:{port}"
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    try:
        with pytest.raises(ConfigError) as info:
            raise_on_every_rank(dist.group.WORLD, "the data of rank 1 is missing" if rank else None)
        Path(out, f"rank{rank}").write_text(str(info.value))
    finally:
        dist.destroy_process_group()


class TestGenerationEvalSet:
    def test_a_missing_eval_set_is_refused_before_the_first_step(self, tmp_path, data_cache, monkeypatch, capsys):
        monkeypatch.chdir(tmp_path)
        fragment = (
            "trainer:\n  callbacks+:\n    - class_path: xtl.callbacks.GenerationEval\n"
            f"      init_args: {{path: {tmp_path}/missing.jsonl, every_n_steps: 1}}\n"
        )
        _fit(tmp_path, data_cache, fragment)
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1] == f"xtl: error: GenerationEval: {tmp_path}/missing.jsonl does not exist", err
