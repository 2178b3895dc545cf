"""``HFParityCheck``: tiny recipes pass, write the per-layer report and train as without the check; injected faults
raise (or warn) naming the first diverging layer; bitwise under FSDP on 2 processes. Vision-language models
(Qwen3-VL, Qwen3-VL-MoE) are checked with their images, vision tower included: bitwise, and a 1e-6 fault in a
vision block raises naming it (on one process and, for Qwen3-VL-MoE, under FSDP + expert parallelism)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch

from tests.cli.test_cli import ROOT, SMALL_MODEL, _run_main, _tiny_args
from tests.composition.matrix import FAMILIES, FEATURES, STRATEGIES, Cell
from tests.model.test_parity import (
    router_top_k_plus_one,
    swap_q_and_k_keys,
    tiny_model,
    wrong_norm_eps,
    wrong_rope_theta,
)
from tests.model.test_parity_vlm import VISION_ROWS, perturb_output
from tests.model.vlm import IMAGE, VARIANTS, VISION_END, VISION_START, load_pair, save_tiny_vlm
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


def _vision_micro_batch() -> MicroBatch:
    """A packed image + text document, a text document and a two-image document (4x4 and 4x6 patches), padding."""
    vs, ve, img = VISION_START, VISION_END, IMAGE
    docs = [[5, vs, *[img] * 4, ve, 6, 7], [8, 9, 10, 11], [12, vs, *[img] * 4, ve, vs, *[img] * 6, ve, 13, 14]]
    ids = torch.tensor([[t for doc in docs for t in doc] + [0, 0, 0]])
    labels = torch.full_like(ids, -100)
    start = 0
    for doc in docs:
        labels[0, start : start + len(doc) - 1] = ids[0, start + 1 : start + len(doc)]
        start += len(doc)
    ctx = SequenceContext.from_lengths(ids, [*map(len, docs), 3], num_padding=3)
    g = torch.Generator().manual_seed(0)
    ctx.extras = {
        "pixel_values": torch.randn(56, 3 * 2 * 14 * 14, generator=g),
        "image_grid_thw": torch.tensor([[1, 4, 4], [1, 4, 4], [1, 4, 6]]),
    }
    return MicroBatch(ctx, labels, int((labels != -100).sum()), start)


def _matrix_cell(family: str, strategy: str) -> Cell:
    """The composition matrix's ``parity_check`` cell of ``family`` under ``strategy`` (its model and layout)."""
    by_name = lambda items, name: next(item for item in items if item.name == name)  # noqa: E731
    return Cell(by_name(FAMILIES, family), by_name(FEATURES, "parity_check"), by_name(STRATEGIES, strategy))


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

    @pytest.mark.parametrize("variant", VARIANTS)
    def test_a_vision_language_batch_is_checked_with_its_images(self, variant, tmp_path):
        """Bitwise with transformers' Qwen3VL(Moe)ForConditionalGeneration on the batch's own images; a 1e-6
        relative fault in one vision block's output (xtl only) raises naming that block."""
        model = load_pair(save_tiny_vlm(variant, torch.float32, tmp_path / "hf"), torch.float32)[1]
        trainer, module = _single_process(tmp_path, model)
        report = HFParityCheck().check(trainer, module, _vision_micro_batch())
        assert report.ok and all(row.exact for row in report.rows), report.render()
        assert [row.name for row in report.rows][:7] == [*VISION_ROWS, "embed"]
        assert report.num_images == 3 and report.lengths == [9, 4, 17] and not report.notes
        perturb_output(model.visual.blocks[1])
        with pytest.raises(ParityCheckError, match="at step 3: first diverging layer: vision block 1 \\("):
            HFParityCheck().check(trainer, module, _vision_micro_batch())
        assert json.loads((tmp_path / "parity" / "step_3.json").read_text())["first_divergence"] == "vision block 1"

    def test_a_tiny_vision_language_run_is_checked_on_its_images(self, tmp_path, data_cache):
        """The matrix's Qwen3-VL cell (one process, bf16-mixed: the check runs in fp32) on the tiny shapes data."""
        configs = _matrix_cell("vlm", "single").configs(tmp_path, tmp_path / "run")
        assert _run_main(["fit", *configs, "--data.cache_dir", str(data_cache), "--trainer.max_steps", "1"]) == 0
        report = json.loads((tmp_path / "run" / "parity" / "step_0.json").read_text())
        assert report["ok"] and report["tolerance"]["name"] == "bitwise" and report["dtype"] == "float32"
        assert report["images"] > 0 and not report["notes"], "the run's own images, not the probe"
        assert [row["name"] for row in report["rows"]][:6] == VISION_ROWS[:5] + ["embed"]
        assert all(row["exact"] for row in report["rows"])

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

    def test_qwen3_vl_moe_under_expert_parallelism_catches_a_1e6_vision_fault(self, tmp_path, data_cache):
        """The matrix's Qwen3-VL-MoE cell on 2 ranks (FSDP2 + EP 2) with fp32 parameters (the check runs in fp32:
        bitwise but for the experts' gradients, within 1e-6), then the same run with a 1e-6 relative fault in one
        vision block's output on every rank."""
        fp32 = tmp_path / "fp32.yaml"
        fp32.write_text("trainer:\n  strategy:\n    class_path: xtl.strategies.FSDPStrategy\n    init_args:\n"
                        "      param_dtype: null\n")  # fmt: skip
        fault = tmp_path / "fault.yaml"
        fault.write_text(f"trainer:\n  callbacks+:\n    - class_path: {__name__}.PerturbVisionBlock\n")
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",  # see test_bitwise_on_two_fsdp_ranks
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        configs = [*_matrix_cell("vlm_moe", "ep").configs(tmp_path, tmp_path / "run"), "--config", str(fp32)]
        args = [*configs, "--data.cache_dir", str(data_cache), "--trainer.max_steps", "1"]
        for extra in ([], ["--config", str(fault)]):
            command = [sys.executable, "-m", "xtl", "fit", *args, *extra]
            proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
            rank0 = "\n".join(line for line in proc.stderr.splitlines() if not line.startswith("[rank1]"))
            report = json.loads((tmp_path / "run/parity/step_0.json").read_text())
            if not extra:
                assert proc.returncode == 0, rank0[-4000:]
                # bitwise but for the experts' gradients under EP (see HFParityCheck._tolerance)
                assert report["ok"] and report["tolerance"]["name"] == "bitwise_forward", rank0[-4000:]
                assert [row["name"] for row in report["rows"]][:6] == VISION_ROWS[:5] + ["embed"]
                assert report["images"] > 0 and not report["notes"]
                experts = [row for row in report["rows"] if ".mlp.experts." in row["name"]]
                assert len(experts) == 4 and all(row["error"] < 1e-6 for row in experts), experts
                assert all(row["exact"] for row in report["rows"] if row not in experts)
            else:
                assert proc.returncode != 0 and "first diverging layer: vision block 1 (" in rank0, rank0[-4000:]
                assert report["first_divergence"] == "vision block 1"


class PerturbVisionBlock(pl.Callback):
    """A fault in xtl's model only (for the 2-rank test): vision block 1's output times ``1 + 1e-6``."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        perturb_output(pl_module.model.visual.blocks[1])
