"""``HFParityCheck``: tiny recipes pass, write the per-layer report and train as without the check; injected faults
raise (or warn) naming the first diverging layer; bitwise under FSDP on 2 processes."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.cli.test_cli import ROOT, SMALL_MODEL, _run_main, _tiny_args
from tests.model.test_parity import (
    router_top_k_plus_one,
    swap_q_and_k_keys,
    tiny_model,
    wrong_norm_eps,
    wrong_rope_theta,
)
from xtl.batch import SequenceContext
from xtl.callbacks import HFParityCheck
from xtl.data.collate import MicroBatch
from xtl.model.parity import ParityCheckError
from xtl.strategies.parallelize import SingleDevice

FRAGMENT = ROOT / "callbacks/parity_check.yaml"


def _fit(recipe: str, data_cache: Path, *extra: str, steps: int = 2) -> int:
    args = _tiny_args(ROOT / "configs" / recipe, data_cache, *extra)
    return _run_main(["fit", *args, "--trainer.max_steps", str(steps)])


def _single_process(root: Path, model: torch.nn.Module) -> tuple[SimpleNamespace, SimpleNamespace]:
    """The parts of a one-process trainer at step 3 and of a module that the callback uses."""
    trainer = SimpleNamespace(
        is_global_zero=True,
        global_step=3,
        precision="32-true",
        precision_plugin=SimpleNamespace(forward_context=nullcontext),
        loggers=[],
        default_root_dir=str(root),
    )
    return trainer, SimpleNamespace(model=model, model_config=model.config, parallelizer=SingleDevice())


def _micro_batch() -> MicroBatch:
    """Three packed documents and a trailing padding pseudo-document, labels shifted per document."""
    lengths = [9, 12, 11]
    ids = torch.randint(0, 96, (1, 36), generator=torch.Generator().manual_seed(0))
    labels = torch.full((1, 36), -100)
    start = 0
    for n in lengths:
        labels[0, start : start + n - 1] = ids[0, start + 1 : start + n]
        start += n
    ctx = SequenceContext.from_lengths(ids, [*lengths, 4], num_padding=4)
    return MicroBatch(ctx, labels, int((labels != -100).sum()), sum(lengths))


def _losses(run: Path) -> list[str]:
    metrics = next(run.glob("logs/version_*/metrics.csv"))
    return [row["train/loss"] for row in csv.DictReader(metrics.open()) if row.get("train/loss")]


class TestHFParityCheck:
    @pytest.mark.parametrize("recipe", ["tiny_sft.yaml", "tiny_moe_sft.yaml"])
    def test_a_tiny_recipe_passes_writes_the_report_and_trains_as_without(
        self, recipe, tmp_path, monkeypatch, data_cache
    ):
        monkeypatch.chdir(tmp_path)
        assert _fit(recipe, data_cache, "--config", str(FRAGMENT)) == 0
        run = tmp_path / "runs" / recipe.removesuffix(".yaml")
        report = json.loads((run / "parity" / "step_0.json").read_text())
        assert report["ok"] and report["step"] == 0 and report["tolerance"]["name"] == "bitwise"
        rows = [row["name"] for row in report["rows"]]
        assert rows[:4] == ["embed", "layer 0", "layer 1", "norm"] and "logits" in rows and "loss" in rows
        assert all(row["exact"] for row in report["rows"])
        metrics = next(run.glob("logs/version_*/metrics.csv"))
        logged = [row for row in csv.DictReader(metrics.open()) if row.get("parity/max_abs_logits")]
        assert [(r["parity/max_abs_logits"], r["parity/max_rel_grad"], r["parity/loss_abs_diff"]) for r in logged] == [
            ("0.0", "0.0", "0.0")
        ]
        (tmp_path / "baseline").mkdir()
        monkeypatch.chdir(tmp_path / "baseline")
        assert _fit(recipe, data_cache) == 0
        baseline = _losses(Path("runs") / recipe.removesuffix(".yaml"))
        assert _losses(run) == baseline and len(baseline) == 2, "the check changes nothing in training"

    @pytest.mark.parametrize(
        "fault,model,layer",
        [
            (swap_q_and_k_keys, "llama_mha", "layer 0"),
            (wrong_rope_theta, "llama_gqa", "layer 0"),
            (wrong_norm_eps, "qwen3_tied", "layer 0"),
            (router_top_k_plus_one, "qwen3_moe", "layer 1"),  # layer 0 is dense (mlp_only_layers)
        ],
        ids=lambda v: v.__name__ if callable(v) else None,
    )
    def test_an_injected_fault_raises_naming_the_first_diverging_layer(
        self, fault, model, layer, tmp_path, monkeypatch
    ):
        fault(monkeypatch)
        trainer, module = _single_process(tmp_path, tiny_model(model))
        with pytest.raises(ParityCheckError, match=f"at step 3: first diverging layer: {layer} \\("):
            HFParityCheck().check(trainer, module, _micro_batch())
        report = json.loads((tmp_path / "parity" / "step_3.json").read_text())
        assert not report["ok"] and report["first_divergence"] == layer

    def test_on_fail_warn_continues_and_every_n_steps_checks_again(self, tmp_path, monkeypatch, data_cache):
        monkeypatch.chdir(tmp_path)
        wrong_norm_eps(monkeypatch)
        options = "{on_fail: warn, every_n_steps: 1}"
        warn = f"trainer:\n  callbacks+:\n    - {{class_path: xtl.callbacks.HFParityCheck, init_args: {options}}}\n"
        (tmp_path / "warn.yaml").write_text(warn)
        with pytest.warns(UserWarning, match="first diverging layer: layer 0") as caught:
            assert _fit("tiny_sft.yaml", data_cache, "--config", "warn.yaml") == 0
        assert sum("HF parity check failed" in str(w.message) for w in caught) == 2
        assert sorted(p.name for p in Path("runs/tiny_sft/parity").iterdir()) == ["step_0.json", "step_1.json"]
        assert len(_losses(Path("runs/tiny_sft"))) == 2

    @pytest.mark.parametrize(
        "kwargs,message",
        [
            ({"mode": "eager"}, "HFParityCheck.mode must be one of"),
            ({"tolerance": "fp4"}, "HFParityCheck.tolerance must be 'auto' or one of"),
            ({"tolerances": {"hiden": 1.0}}, "HFParityCheck.tolerances: unknown key 'hiden'"),
            ({"on_fail": "ignore"}, "HFParityCheck.on_fail must be one of"),
            ({"dtype": "fp8"}, "HFParityCheck.dtype must be one of"),
            ({"max_tokens": 0}, "HFParityCheck.max_tokens must be >= 1"),
            ({"every_n_steps": -1}, "HFParityCheck.every_n_steps must be >= 0"),
            ({"max_layers": 0}, "HFParityCheck.max_layers must be >= 1"),
        ],
    )
    def test_a_bad_option_names_its_key(self, kwargs, message):
        with pytest.raises(ValueError, match=message):
            HFParityCheck(**kwargs)


@pytest.mark.distributed
class TestHFParityCheckFSDP:
    def test_bitwise_on_two_fsdp_ranks(self, tmp_path, data_cache):
        fragment = tmp_path / "fsdp.yaml"
        fragment.write_text(
            "trainer:\n"
            "  devices: 2\n"
            "  strategy: {class_path: xtl.strategies.FSDPStrategy}\n"
            "  val_check_interval: null\n"
            "  enable_progress_bar: false\n"
            "data:\n"
            "  val_sources: null\n"
        )
        args = [
            *("fit", "--config", str(ROOT / "configs/tiny_sft.yaml"), "--config", str(fragment)),
            *("--config", str(FRAGMENT), "--trainer.max_steps", "1", "--data.cache_dir", str(data_cache)),
            *("--data.pack_max_length", "128", *SMALL_MODEL),
        ]
        # Lightning leaves the intra-op threads of the ranks it spawns at the default (rank 0: cores / processes): on
        # CPU the ranks' gradients then differ in the last bits and their average is not the single-rank gradient.
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
        proc = subprocess.run(
            [sys.executable, "-m", "xtl", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
        )
        rank0 = "\n".join(line for line in proc.stderr.splitlines() if not line.startswith("[rank1]"))
        assert proc.returncode == 0, rank0[-4000:]
        report = json.loads((tmp_path / "runs/tiny_sft/parity/step_0.json").read_text())
        assert report["ok"] and all(row["exact"] for row in report["rows"])
        assert any(row["name"] == "grad layers.0.self_attn.q_proj.weight" for row in report["rows"])
