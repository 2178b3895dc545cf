"""The composition matrix (:mod:`tests.composition.matrix`): every family x feature x strategy trains two steps and
keeps its feature's claim, or is refused at startup with a short message; ``docs/configs.md`` shows the matrix."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from tests.composition.matrix import (
    CLOSE_RTOL,
    GPU_RECIPES,
    RECIPE_STEPS,
    ROOT,
    STEPS,
    STRATEGIES,
    Cell,
    cells,
    recipe_runs,
    render_markdown,
)
from tests.train.test_step import _free_port

TIMEOUT = 1500
# a Python warning, a torch/glog warning or error line ("W1201 12:00:00.0 ..."), or a library's load failure
NOISE = re.compile(r"Warning|warn\(|^(\[rank\d+\]:)?[WE]\d{4} |Failed to load", re.IGNORECASE)


def _cells(strategy: str) -> list:
    return [
        pytest.param(c, id=c.id, marks=[pytest.mark.distributed] if c.strategy.world_size > 1 else [])
        for c in cells(strategy)
    ]


def check_cell(cell: Cell, matrix_results) -> None:
    """A cell trained two steps and kept its feature's claim, or was refused at startup with its message."""
    result = matrix_results(cell.strategy.name)[cell.id]
    assert result["traceback"] is None, result["traceback"]
    if cell.refusal is not None:
        assert result["rc"] == 2, result["stderr"]
        lines = [line for line in result["stderr"].splitlines() if line.startswith("xtl: error:")]
        assert lines and cell.refusal in lines[0], result["stderr"]
        assert "Traceback" not in result["stderr"]
        return
    assert result["rc"] == 0, result["stderr"]
    noise = [line for line in result["stderr"].splitlines() if NOISE.search(line)]
    assert not noise, "warnings a user cannot act on:\n" + "\n".join(noise)
    losses = [float(result["losses"][str(step)]) for step in range(STEPS)]
    assert all(math.isfinite(loss) for loss in losses), losses
    plain = matrix_results(cell.strategy.name)[cell.id.replace(f"-{cell.feature.name}-", "-plain-")]
    _check_claim(cell, result, plain)
    _check_feature_acts(cell, result, plain)


# One class per strategy: the test workers (pytest-xdist, by class) share the matrix out, a strategy's cells on one.
class TestMatrixSingle:
    @pytest.mark.parametrize("cell", _cells("single"))
    def test_cell(self, cell: Cell, matrix_results):
        check_cell(cell, matrix_results)


class TestMatrixFSDP:
    @pytest.mark.parametrize("cell", _cells("fsdp"))
    def test_cell(self, cell: Cell, matrix_results):
        check_cell(cell, matrix_results)


class TestMatrixCP:
    @pytest.mark.parametrize("cell", _cells("cp"))
    def test_cell(self, cell: Cell, matrix_results):
        check_cell(cell, matrix_results)


class TestMatrixEP:
    @pytest.mark.parametrize("cell", _cells("ep"))
    def test_cell(self, cell: Cell, matrix_results):
        check_cell(cell, matrix_results)

    @pytest.mark.distributed
    @pytest.mark.parametrize("recipe", GPU_RECIPES)
    def test_gpu_recipe_trains_three_steps_on_two_cpu_ranks(self, recipe, matrix_results):
        """The recipe's FSDP settings (``param_dtype: bfloat16``, its checkpointing callbacks; EP where it sets
        EP), with a tiny model and data, on 2 gloo ranks (in the expert-parallel cells' process group: it has the
        fewest cells)."""
        result = matrix_results("ep")[f"recipe-{recipe.removesuffix('.yaml')}"]
        assert result["traceback"] is None, result["traceback"]
        assert result["rc"] == 0, result["stderr"]
        losses = [float(result["losses"][str(step)]) for step in range(RECIPE_STEPS)]
        assert all(math.isfinite(loss) for loss in losses), losses
        assert "checkpoints/last.ckpt/.metadata" in result["probe"]["files"]

    def test_every_strategy_has_its_class(self):
        assert {s.name for s in STRATEGIES} == {"single", "fsdp", "cp", "ep"}

    def test_docs_show_the_matrix(self):
        docs = (ROOT / "docs" / "configs.md").read_text()
        assert render_markdown() in docs, "docs/configs.md is stale: run python -m tests.composition.matrix"


def _check_claim(cell: Cell, result: dict, plain: dict) -> None:
    got, ref = result["losses"], plain["losses"]
    claim = cell.feature.claim
    if claim == "bitwise":
        assert got == ref, f"{cell.feature.name} changed the losses: {got} vs plain {ref}"
    elif claim == "objective":
        return  # another objective: its own first-step value is checked by _check_feature_acts
    elif claim == "first_step":
        assert got["0"] == ref["0"], f"{cell.feature.name} changed the first loss: {got} vs plain {ref}"
    else:
        assert math.isclose(float(got["0"]), float(ref["0"]), rel_tol=CLOSE_RTOL), (got, ref)


def _check_feature_acts(cell: Cell, result: dict, plain: dict) -> None:
    """The feature really acted: what it does shows in the probe, the logged metrics or the files."""
    probe, name = result["probe"], cell.feature.name
    if any(source in cell.feature.inline for source, _ in cell.family.sources):
        # the feature trained on the family's rows with images: the vision tower ran on them
        assert all(probe["calls"]["vision"]), f"the vision blocks never ran: {probe['calls']}"
    if name.startswith("checkpointing"):
        for part, calls in probe["calls"].items():
            assert all(c == 2 * p for c, p in zip(calls, plain["probe"]["calls"][part])), (part, calls)
    elif name == "offload":
        assert probe["offloaded_bytes"] > 0 and "train/offloaded_gib" in result["logged"]
    elif name in ("compile", "compile_model"):
        assert probe["compiled_frames"] > 0 and "train/recompiles" in result["logged"]
    elif name == "fp8":
        assert probe["float8"] > 0
    elif name == "fused":
        assert probe["fused"] > 0 and not plain["probe"]["fused"], (probe["fused"], plain["probe"]["fused"])
    elif name in ("lora", "qlora"):
        assert 0 < probe["trainable"] < probe["total"]
        if name == "qlora":
            assert probe["nf4"] > 0
    elif name == "parity_check":
        assert "parity/step_0.json" in probe["files"]
        assert "parity/ok" in result["logged"]
    elif name == "throughput":
        assert "train/tflops_per_device" in result["logged"]
    elif name.startswith("dpo"):  # step 0: the policy is its reference, every margin 0, the loss log 2
        assert math.isclose(float(result["losses"]["0"]), math.log(2), rel_tol=1e-6), result["losses"]
        assert {"train/rewards/accuracies", "train/rewards/margins", "train/logps/chosen"} <= set(result["logged"])
        reference = probe["reference"]
        if name == "dpo_precomputed":  # no reference model, the training set's table
            assert reference["mode"] == "precomputed" and not reference["frozen"] and "train" in reference["tables"]
        elif name == "dpo_synced":  # a frozen copy that moved with the policy
            assert reference["frozen"] and reference["moved"], reference
        else:
            assert reference["mode"] == "live" and reference["frozen"] and not reference["moved"], reference
    elif name == "kto":  # step 0: every reward and the reference point 0, each row's loss 1 - sigmoid(0)
        assert math.isclose(float(result["losses"]["0"]), 0.5, rel_tol=1e-6), result["losses"]
        assert {"train/kl", "train/rewards/chosen", "train/rewards/rejected"} <= set(result["logged"])
    elif name == "online_dpo":  # step 0: the policy is its reference, every pair's logit 0, the loss log 2
        assert math.isclose(float(result["losses"]["0"]), math.log(2), rel_tol=1e-6), result["losses"]
        assert {"train/rewards/accuracies", "train/objective/kl", "train/logps/chosen", "train/pairs"} <= set(
            result["logged"]
        )
        reference = probe["reference"]
        assert reference["mode"] == "live" and reference["frozen"] and not reference["moved"], reference
    elif name == "reward":  # a new scalar head: small random rewards, so the first loss is near log 2
        assert probe["head_outputs"] == 1 and plain["probe"]["head_outputs"] > 1, probe["head_outputs"]
        assert abs(float(result["losses"]["0"]) - math.log(2)) < 0.25, result["losses"]
        assert {"train/accuracy", "train/margin", "train/rewards/chosen"} <= set(result["logged"])
    elif name == "distill":  # a frozen separate teacher; every step sampled by the student
        reference = probe["reference"]
        assert reference["mode"] == "model" and reference["frozen"] and not reference["moved"], reference
        assert float(result["losses"]["0"]) > 0 and "train/on_policy" in result["logged"], result["losses"]
        assert probe["on_policy_steps"] == STEPS, probe["on_policy_steps"]
    elif name == "grpo_tools":  # as grpo, through the tool loop: its turns are logged
        assert abs(float(result["losses"]["0"])) < 1e-6, result["losses"]
        assert {"train/ratio", "rollout/turns", "rollout/tool_calls", "rollout/malformed_calls"} <= set(
            result["logged"]
        )
    elif name == "grpo_partial":  # as grpo; paused completions are accounted, and the trace says where it is
        assert abs(float(result["losses"]["0"])) < 1e-6, result["losses"]
        assert {"rollout/resumed", "rollout/partial_groups", "rollout/staleness_max"} <= set(result["logged"])
        assert "xtl trace: rollout spans in" in result["stderr"], result["stderr"][-2000:]
    elif name == "grpo":  # step 0: every ratio 1, so the loss is minus the mean advantage, 0 in every group
        assert abs(float(result["losses"]["0"])) < 1e-6, result["losses"]
        assert {"train/ratio", "train/reward", "train/clip_ratio/region_mean", "rollout/samples"} <= set(
            result["logged"]
        )
    elif name == "mtp":  # the depth trained: its loss is logged, and it changed the update
        assert "train/mtp_loss_1" in result["logged"] and result["losses"]["1"] != plain["losses"]["1"]
        assert probe["calls"]["mtp"] == probe["calls"]["language"][-1:], probe["calls"]  # ran with every forward
    elif name == "lm_eval":  # scored at step 2 (every rank took part), logged and written by rank 0
        assert "lm_eval/step_2.json" in probe["files"]
        assert {"eval/tiny_choice/acc", "eval/tiny_exact/exact_match"} <= set(result["logged"])
    elif name in ("muon", "fused_muon"):  # the optimizer is Muon, with matrices in Muon groups; it changed the update
        optimizer = probe["optimizer"]
        assert optimizer["class"] == "Muon" and optimizer["muon_params"] > 0, optimizer
        assert result["losses"]["1"] != plain["losses"]["1"], (result["losses"], plain["losses"])
        if name == "fused_muon":  # each fused weight is orthogonalized per HF matrix
            assert probe["fused"] > 0 and optimizer["split_matrices"] > 0, (probe["fused"], optimizer)
    elif name == "streaming":  # the step batches came from the stream
        assert probe["loader"] == "StreamingLoader" and plain["probe"]["loader"] != "StreamingLoader", probe["loader"]
    elif name == "remote_checkpoint":  # committed in the URL folder (keep_last 1: one periodic and last), no staging
        files = probe["files"]
        manifests = sorted(f for f in files if f.startswith("remote/") and f.endswith("/manifest.json"))
        assert len(manifests) == 2 and any(f.startswith("remote/last.ckpt/") for f in manifests), manifests
        assert not [f for f in files if f.startswith(".staging/") and ".ckpt" in f], files
    elif name == "hf_export":
        files = set(probe["files"])
        assert "hf/final/config.json" in files and any(f.endswith(".safetensors") for f in files), files


@pytest.fixture(scope="session")
def matrix_results(tmp_path_factory, data_cache):
    """``matrix_results(strategy) -> {cell id: result}``: the strategy's cells, run once per session.

    Single-process cells run in two processes of one thread each (both cores); the cells of a distributed strategy
    run in one group of ``world_size`` processes that every cell's trainer reuses.
    """

    @cache
    def run(strategy: str) -> dict[str, dict]:
        work = tmp_path_factory.mktemp(f"matrix_{strategy}")
        chosen = [c.id for c in cells(strategy)]
        layout = next(s for s in STRATEGIES if s.name == strategy)
        if layout.world_size == 1:
            shards = [chosen[i::2] for i in range(2)]
            jobs = [_start(work / f"part{i}", shard, data_cache, 1, rank=0) for i, shard in enumerate(shards)]
        else:
            port = _free_port()
            runs = recipe_runs(work, work) if strategy == "ep" else {}  # the GPU recipes share the group
            jobs = [
                _start(work, chosen, data_cache, layout.world_size, r, port, runs) for r in range(layout.world_size)
            ]
            chosen += list(runs)
        results: dict[str, dict] = {}
        for proc, out, log in jobs:
            proc.wait(timeout=TIMEOUT)
            if out.is_file():
                results.update(json.loads(out.read_text()))
            elif proc.returncode:
                pytest.fail(f"the matrix runner failed:\n{log.read_text()[-4000:]}")
        for rank in range(1, layout.world_size):  # what the other ranks printed
            peer = work / f"results.rank{rank}.json"
            for cell_id, result in (json.loads(peer.read_text()) if peer.is_file() else {}).items():
                results[cell_id]["stderr"] += result["stderr"]
        missing = [c for c in chosen if c not in results]
        assert not missing, f"cells without a result (runner died?): {missing}"
        return results

    return run


def _start(
    work: Path, cell_ids: list[str], cache: Path, world: int, rank: int, port: int = 0, runs: dict | None = None
):
    work.mkdir(parents=True, exist_ok=True)
    out = work / "results.json"
    spec = work / f"spec_rank{rank}.json"
    spec.write_text(
        json.dumps({"cells": cell_ids, "runs": runs or {}, "work": str(work), "cache": str(cache), "out": str(out)})
    )
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "WORLD_SIZE": str(world),
        "RANK": str(rank),
    }
    if world > 1:
        env.update(LOCAL_RANK=str(rank), NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    log = work / f"log_rank{rank}.txt"
    with log.open("w") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.composition.runner", str(spec)], cwd=ROOT, env=env, stdout=sink, stderr=sink
        )
    return proc, out, log
