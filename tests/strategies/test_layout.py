"""``ParallelLayout``: sizes and their checks, and HSDP across two simulated nodes equal to one node."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.test_cli import ROOT, SMALL_MODEL
from tests.train.test_step import _free_port
from xtl.errors import ConfigError
from xtl.strategies.layout import ParallelLayout

HSDP = (
    "trainer:\n  strategy:\n    class_path: xtl.strategies.FSDPStrategy\n    init_args:\n"
    "      data_parallel_replicate_size: 2\n      process_group_backend: gloo\n  precision: 32-true\n"
    "  val_check_interval: null\n  enable_progress_bar: false\n  callbacks: []\ndata:\n  val_sources: null\n"
)
# fp32, the same packs: only the order of the gradient sums can differ between the launches
RTOL = 1e-6


class TestParallelLayout:
    def test_sizes_of_an_hsdp_layout(self):
        layout = ParallelLayout.for_world(8, dp_replicate=2)
        assert (layout.dp_replicate, layout.dp_shard, layout.cp, layout.ep) == (2, 4, 1, 1)
        assert (layout.world_size, layout.dp_size, layout.data_rank(5)) == (8, 8, 5)

    def test_sizes_of_an_expert_layout(self):
        layout = ParallelLayout.for_world(8, ep=4)
        assert (layout.world_size, layout.dp_size, layout.edp) == (8, 8, 2)
        assert layout.describe() == "dp_replicate 1 x dp_shard 8 x cp 1, ep 4 (edp 2)"

    def test_the_ranks_of_a_context_group_read_the_same_data(self):
        layout = ParallelLayout(dp_shard=2, cp=2)
        assert (layout.world_size, layout.dp_size) == (4, 2)
        assert [layout.data_rank(r) for r in range(4)] == [0, 0, 1, 1]

    @pytest.mark.parametrize(
        ("kwargs", "message"),
        [
            ({"world_size": 4, "dp_replicate": 3}, r"data_parallel_replicate_size \(3\) x data_parallel_shard_size"),
            ({"world_size": 4, "dp_shard": 3}, "must equal the number of processes"),
            ({"world_size": 4, "ep": 3}, r"expert_parallel_size \(3\) must divide"),
            ({"world_size": 4, "dp_replicate": 2, "ep": 2}, "HSDP with expert parallelism"),
        ],
    )
    def test_a_bad_layout_names_the_strategy_keys(self, kwargs, message):
        with pytest.raises(ConfigError, match=message):
            ParallelLayout.for_world(**kwargs)


@pytest.mark.slow
@pytest.mark.distributed
class TestTwoNodes:
    def test_hsdp_over_two_simulated_nodes_equals_one_node_of_two_processes(self, tmp_path, data_cache):
        """``torchrun --nnodes 2`` on localhost (node ranks 0 and 1, one process each), ``trainer.num_nodes 2``:
        replicated across the nodes. The same layout on one node with 2 processes logs the same losses."""
        (tmp_path / "hsdp.yaml").write_text(HSDP)
        common = ["fit", "--config", str(ROOT / "configs/tiny_sft.yaml"), "--config", str(tmp_path / "hsdp.yaml")]
        common += [*SMALL_MODEL, "--data.cache_dir", str(data_cache), "--data.pack_max_length", "128"]
        common += ["--trainer.max_steps", "3"]
        one_node = _losses(tmp_path / "one", [sys.executable, "-m", "xtl", *common, "--trainer.devices", "2"])
        port = _free_port()
        nodes = []
        for node in (0, 1):
            work = tmp_path / f"node{node}"
            work.mkdir()
            launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"]
            launch += ["--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "xtl"]
            args = [*launch, *common, "--trainer.num_nodes", "2", "--trainer.devices", "1"]
            with (work / "log.txt").open("w") as log:
                nodes.append(subprocess.Popen(args, cwd=work, env=_env(), stdout=log, stderr=subprocess.STDOUT))
        codes = [proc.wait(timeout=600) for proc in nodes]
        logs = "".join((tmp_path / f"node{n}/log.txt").read_text()[-3000:] for n in (0, 1))
        assert codes == [0, 0], logs
        two_nodes = _read(tmp_path / "node0")
        assert sorted(two_nodes) == sorted(one_node) == [0, 1, 2]
        for step, loss in one_node.items():
            assert float(two_nodes[step]) == pytest.approx(float(loss), rel=RTOL), step


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def _losses(work: Path, command: list[str]) -> dict[int, str]:
    work.mkdir()
    proc = subprocess.run(command, cwd=work, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return _read(work)


def _read(work: Path) -> dict[int, str]:
    (metrics,) = work.glob("runs/tiny_sft/logs/version_*/metrics.csv")
    return {int(r["step"]): r["train/loss"] for r in csv.DictReader(metrics.open()) if r.get("train/loss")}
