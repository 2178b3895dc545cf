"""``ParallelLayout``: sizes and their checks, and HSDP across two simulated nodes equal to one node."""

from __future__ import annotations

import csv
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.cli.test_cli import ROOT, SMALL_MODEL
from tests.train.conftest import TINY_MODEL
from tests.train.test_step import _free_port
from xtl.errors import ConfigError
from xtl.strategies.layout import ParallelLayout, ParallelMeshes, broadcast_object
from xtl.strategies.parallelize import ParallelizingStrategy

HSDP = (
    "trainer:\n  strategy:\n    class_path: xtl.strategies.FSDPStrategy\n    init_args:\n"
    "      data_parallel_replicate_size: 2\n      process_group_backend: gloo\n  precision: 32-true\n"
    "  val_check_interval: null\n  enable_progress_bar: false\n  callbacks: []\ndata:\n  val_sources: null\n"
)
# fp32, the same packs: only the order of the gradient sums can differ between the launches
RTOL = 1e-6
# a checkpoint every step into the run folder, the CSV log flushed every step (a killed node keeps what it logged)
EVERY_STEP = (
    "trainer:\n  logger:\n    - class_path: lightning.pytorch.loggers.CSVLogger\n"
    "      init_args: {save_dir: ., name: logs, flush_logs_every_n_steps: 1}\n  callbacks+:\n"
    "    - class_path: xtl.callbacks.TrainingCheckpoint\n"
    "      init_args: {dirpath: checkpoints, save_last: true, every_n_train_steps: 1, save_top_k: -1}\n"
)


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


class _OneRankLayout(ParallelizingStrategy):
    """A sharded strategy whose layout is this rank alone, inside a process group of two: what several runs sharing
    one process group see (every collective of a run must stay within its layout's groups)."""

    shards_parameters = True
    root_device = torch.device("cpu")

    def __init__(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        alone = init_device_mesh("cpu", (2, 1), mesh_dim_names=("runs", "rank"))["rank"]
        self.meshes = ParallelMeshes(self.layout, alone, alone, None, None)


def _groups_worker(rank: int, port: int, out: str) -> None:
    from xtl.train import LanguageModule
    from xtl.train.step import global_token_count

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        strategy = _OneRankLayout()
        module = LanguageModule(TINY_MODEL)
        module._trainer = SimpleNamespace(strategy=strategy, global_rank=0)
        fillers = [real for _, real in module.eval_micro_batches([object()] * (rank + 1))].count(False)
        result = {
            "tokens": float(global_token_count(3 + rank, torch.device("cpu"), strategy.data_group())),
            "summed": float(module._sum_over_data_ranks(torch.tensor(10.0 + rank))),
            "fillers": fillers,
            "shared": broadcast_object(f"rank {rank}", strategy.world_group()),
        }
        torch.save(result, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
class TestCollectivesNameTheirGroup:
    def test_a_one_rank_layout_in_a_two_rank_process_group_stays_alone(self, tmp_path):
        """Token count, logged sums, the evaluation's forward count and rank 0's shared objects reduce over the
        layout's groups: over the process group's default group they would mix the two runs."""
        out = str(tmp_path / "groups")
        mp.spawn(_groups_worker, args=(_free_port(), out), nprocs=2, join=True)
        for rank in range(2):
            got = torch.load(f"{out}.{rank}")
            assert got == {"tokens": 3.0 + rank, "summed": 10.0 + rank, "fillers": 0, "shared": f"rank {rank}"}


@pytest.fixture(scope="class")
def one_node(tmp_path_factory, data_cache) -> tuple[list[str], dict[int, str]]:
    """The HSDP run's arguments and the losses of 1 node x 2 processes."""
    tmp_path = tmp_path_factory.mktemp("one_node")
    (tmp_path / "hsdp.yaml").write_text(HSDP)
    common = ["fit", "--config", str(ROOT / "configs/tiny_sft.yaml"), "--config", str(tmp_path / "hsdp.yaml")]
    common += [*SMALL_MODEL, "--data.cache_dir", str(data_cache), "--data.pack_max_length", "128"]
    common += ["--trainer.max_steps", "3"]
    return common, _losses(tmp_path / "one", [sys.executable, "-m", "xtl", *common, "--trainer.devices", "2"])


@pytest.mark.slow
@pytest.mark.distributed
class TestTwoNodes:
    """HSDP 2 x 1, replicated across 2 simulated nodes (one process each, node ranks 0 and 1 on localhost), logs
    the losses of the same layout on one node of 2 processes (``trainer.num_nodes 2``, ``trainer.devices 1``)."""

    def test_torchrun(self, tmp_path, one_node):
        common, expected = one_node
        port = _free_port()
        launches = []
        for node in (0, 1):
            launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"]
            launch += ["--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "xtl"]
            launches.append(([*launch, *common, "--trainer.num_nodes", "2", "--trainer.devices", "1"], _env()))
        _assert_same_losses(tmp_path, launches, expected)

    def test_slurm(self, tmp_path, one_node):
        """As ``srun --nodes 2 --ntasks-per-node 1`` starts them: Lightning's SLURM environment reads the ranks."""
        common, expected = one_node
        slurm = {
            "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "1", "SLURM_NNODES": "2", "SLURM_LOCALID": "0",
            "SLURM_NODELIST": "127.0.0.1", "SLURM_JOB_NAME": "xtl", "SLURM_JOB_ID": "4242",
            "MASTER_PORT": str(_free_port()),
        }  # fmt: skip
        launches = []
        for node in (0, 1):
            env = {**_env(), **slurm, "SLURM_PROCID": str(node), "SLURM_NODEID": str(node)}
            launches.append(([sys.executable, "-m", "xtl", *common, "--trainer.num_nodes", "2"], env))
        _assert_same_losses(tmp_path, launches, expected)

    def test_a_killed_node_is_started_again_and_the_run_resumes_by_itself(self, tmp_path, one_node):
        """Node 1's torchrun agent and its worker die by SIGKILL when step 2 starts (after the step-2 checkpoint);
        node 0's agent restarts its worker (``--max-restarts 1``) and waits in the rendezvous; node 1 is started
        again, as SLURM would requeue it. Both resume from the newest checkpoint (``--ckpt_path auto``: the restart
        counts differ, 1 on node 0 and 0 on the fresh node 1) and the losses are the uninterrupted run's.

        c10d rendezvous with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (each round a store of its own): on torch 2.13
        the static rendezvous (``--master-addr``) has no re-rendezvous, so the fresh node's worker waits for the
        ranks of attempt 0 while node 0's waits for those of attempt 1 (a hang), and c10d sharing its store with
        the workers fails the second round (keep-alive and role_info timeouts). Node 0 starts first and hosts the
        rendezvous store: the node that hosts it must survive."""
        common, expected = one_node
        (tmp_path / "every_step.yaml").write_text(EVERY_STEP)
        shared = tmp_path / "shared"  # the run folder every node sees
        args = [*common, "--config", str(tmp_path / "every_step.yaml"), "--trainer.num_nodes", "2"]
        args += ["--trainer.devices", "1", "--trainer.default_root_dir", str(shared), "--ckpt_path", "auto"]
        kill = {"class_path": "tests.cli.kill_rank.KillRankOnce", "init_args": {"step": 2, "rank": None}}
        kill["init_args"].update(node=True, marker=str(tmp_path / "killed"))
        port = _free_port()
        launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"]
        launch += ["--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]
        launch += ["--rdzv-id", "two-nodes", "-m", "xtl", *args]
        env = {**_env(), "PYTHONPATH": str(ROOT), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        env = {k: v for k, v in env.items() if k not in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")}
        names = ("node0", "node1", "node1_again")
        agents: list[subprocess.Popen] = []

        def start(name: str, *extra: str) -> subprocess.Popen:
            log = (tmp_path / f"{name}.txt").open("w")
            agent = subprocess.Popen([*launch, *extra], env=env, stdout=log, stderr=subprocess.STDOUT)
            agents.append(agent)
            return agent

        try:
            node0 = start("node0")
            _wait_for_listener(port, timeout=120)  # node 0's agent hosts the rendezvous
            assert start("node1", f"--trainer.callbacks+={json.dumps(kill)}").wait(timeout=300) == -signal.SIGKILL
            assert (tmp_path / "killed").is_file(), "node 1 died, but not by the kill at step 2"
            again = start("node1_again", f"--trainer.callbacks+={json.dumps(kill)}")
            codes = [again.wait(timeout=300), node0.wait(timeout=120)]
        finally:
            _stop(agents)
        logs = "".join((tmp_path / f"{n}.txt").read_text()[-3000:] for n in names)
        assert codes == [0, 0], logs
        assert f"xtl: resuming from {shared / 'checkpoints/last.ckpt'} (step 2)" in logs
        versions = sorted(shared.glob("logs/version_*/metrics.csv"), key=lambda p: int(p.parent.name[8:]))
        first, resumed = (_read_versions(m) for m in versions)
        assert (sorted(first), sorted(resumed)) == ([0, 1], [2])
        for step, loss in {**first, **resumed}.items():
            assert float(loss) == pytest.approx(float(expected[step]), rel=RTOL), step


def _read_versions(metrics: Path) -> dict[int, str]:
    return {int(r["step"]): r["train/loss"] for r in csv.DictReader(metrics.open()) if r.get("train/loss")}


def _wait_for_listener(port: int, timeout: float) -> None:
    """Return once something listens on ``127.0.0.1:port``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on port {port} after {timeout} s")


def _stop(agents: list[subprocess.Popen]) -> None:
    """SIGTERM the torchrun agents still running (each stops its workers), SIGKILL what is left after 20 s."""
    for agent in agents:
        if agent.poll() is None:
            agent.terminate()
    for agent in agents:
        try:
            agent.wait(timeout=20)
        except subprocess.TimeoutExpired:
            agent.kill()


def _assert_same_losses(tmp_path: Path, launches: list[tuple[list[str], dict]], expected: dict[int, str]) -> None:
    """Start one process per node and compare node 0's logged losses with ``expected``."""
    procs = []
    for node, (args, env) in enumerate(launches):
        work = tmp_path / f"node{node}"
        work.mkdir()
        with (work / "log.txt").open("w") as log:
            procs.append(subprocess.Popen(args, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT))
    codes = [proc.wait(timeout=600) for proc in procs]
    logs = "".join((tmp_path / f"node{n}/log.txt").read_text()[-3000:] for n in range(len(launches)))
    assert codes == [0] * len(launches), logs
    for node in range(len(launches)):  # each launch is one rank of one 2-rank world
        assert f"GLOBAL_RANK: {node}, MEMBER: {node + 1}/2" in (tmp_path / f"node{node}/log.txt").read_text()
    two_nodes = _read(tmp_path / "node0")
    assert sorted(two_nodes) == sorted(expected) == [0, 1, 2]
    for step, loss in expected.items():
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
