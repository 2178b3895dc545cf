"""The launch scripts: valid bash, the command lines they build (their ``DRY_RUN=1`` output) parse as ``xtl fit``
options, and the SLURM script runs a 2-process fit (``srun`` and ``scontrol`` stubbed) and requeues on USR1."""

from __future__ import annotations

import csv
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.cli.test_cli import ROOT, SMALL_MODEL, _run_main
from tests.train.test_step import _free_port

TORCHRUN = ROOT / "scripts/torchrun_multinode.sh"
SBATCH = ROOT / "scripts/slurm_fit.sbatch"
# a stand-in for SLURM's commands on a machine without SLURM: scontrol names the nodes and logs a requeue, srun
# drops its own options and runs the task (one node)
SCONTROL = """#!/bin/sh
case "$1" in
  show) echo "${STUB_FIRST_NODE:-127.0.0.1}"; echo node-b ;;
  requeue) echo "requeue $2" >> "$STUB_LOG" ;;
esac
"""
SRUN = """#!/bin/sh
while [ "${1#--}" != "$1" ]; do shift; done
exec "$@"
"""
FSDP = """\
trainer:
  strategy:
    class_path: xtl.strategies.FSDPStrategy
    init_args: {process_group_backend: gloo}
  precision: 32-true
  val_check_interval: null
  enable_progress_bar: false
data:
  val_sources: null
"""


def _dry_run(script: Path, env: dict[str, str], *args: str, cwd: Path | None = None) -> list[str]:
    """The command ``script`` would run (``DRY_RUN=1``), as words."""
    proc = subprocess.run(
        ["bash", str(script), *args],
        env={**os.environ, **env, "DRY_RUN": "1"},
        capture_output=True,
        text=True,
        cwd=cwd,
    )
    assert proc.returncode == 0, proc.stderr
    return shlex.split(proc.stdout)


def _xtl_part(words: list[str]) -> list[str]:
    """The arguments of ``xtl`` in a launch command (after ``-m xtl``)."""
    at = words.index("xtl")
    assert words[at - 1] == "-m"
    return words[at + 1 :]


def _stubs(tmp_path: Path) -> dict[str, str]:
    """``PATH`` with the stand-ins for ``scontrol`` and ``srun`` first."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", SCONTROL), ("srun", SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "STUB_LOG": str(tmp_path / "scontrol.log")}


class TestLaunchScripts:
    @pytest.mark.parametrize("script", [TORCHRUN, SBATCH], ids=lambda p: p.name)
    def test_the_scripts_are_valid_bash(self, script):
        proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr

    def test_torchrun_on_each_node_with_c10d_rendezvous(self):
        env = {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "node01", "MASTER_PORT": "29555"}
        env.update(NPROC_PER_NODE="4", PYTHON="python3")
        words = _dry_run(TORCHRUN, env, "--config", "my run.yaml")
        assert words == [
            "python3", "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "4", "--max-restarts",
            "3", "--rdzv-backend", "c10d", "--rdzv-endpoint", "node01:29555", "--rdzv-id", "xtl-29555",
            "-m", "xtl", "fit", "--config", "my run.yaml", "--ckpt_path", "auto", "--trainer.num_nodes", "2",
            "--trainer.devices", "4",
        ]  # fmt: skip

    def test_torchrun_with_static_rendezvous_and_the_users_ckpt_path(self):
        env = {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1", "RDZV": "static", "MAX_RESTARTS": "0"}
        words = _dry_run(TORCHRUN, env, "--config", "a.yaml", "--ckpt_path", "last")
        launch = words[: words.index("-m", 3)]
        assert launch[-6:] == ["--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "29500"]
        assert "--max-restarts" in launch and launch[launch.index("--max-restarts") + 1] == "0"
        assert _xtl_part(words).count("--ckpt_path") == 1 and "last" in words and "auto" not in words

    def test_torchrun_refuses_an_unknown_rendezvous(self):
        proc = subprocess.run(["bash", str(TORCHRUN)], env={**os.environ, "RDZV": "etcd"}, capture_output=True)
        assert proc.returncode == 2 and b"RDZV must be c10d or static" in proc.stderr

    def test_slurm_builds_the_torchrun_command_from_the_job(self, tmp_path):
        env = {**_stubs(tmp_path), "STUB_FIRST_NODE": "node07", "SLURM_JOB_NODELIST": "node[07-08]"}
        env.update(SLURM_JOB_ID="123456", SLURM_NNODES="2", SLURM_GPUS_PER_NODE="h100:8", CKPT_PATH="")
        words = _dry_run(SBATCH, env, "--config", "a.yaml")
        assert words[:3] == ["srun", "--kill-on-bad-exit=1", "--ntasks-per-node=1"]
        launch = words[4 : words.index("xtl") - 1]
        assert launch == [
            "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "8", "--max-restarts", "3",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", "node07:23456", "--rdzv-id", "xtl-123456",
        ]  # fmt: skip
        assert _xtl_part(words) == ["fit", "--config", "a.yaml", "--trainer.num_nodes", "2", "--trainer.devices", "8"]

    @pytest.mark.parametrize("script", [TORCHRUN, SBATCH], ids=lambda p: p.name)
    def test_the_command_lines_are_xtl_options(self, script, tmp_path, capsys):
        """What the scripts add (nodes, devices, ``--ckpt_path auto``) parses and lands in the fit's config."""
        env = {**_stubs(tmp_path), "NNODES": "3", "NPROC_PER_NODE": "2", "SLURM_JOB_NODELIST": "n1"}
        env.update(SLURM_JOB_ID="7", SLURM_NNODES="3", SLURM_GPUS_PER_NODE="2")
        words = _dry_run(script, env, "--config", str(ROOT / "configs/tiny_sft.yaml"))
        assert _run_main([*_xtl_part(words), "--print_config"]) == 0
        config = yaml.safe_load(capsys.readouterr().out)
        trainer = config["trainer"]
        assert (trainer["num_nodes"], str(trainer["devices"]), config["ckpt_path"]) == (3, "2", "auto")


@pytest.mark.slow
@pytest.mark.distributed
class TestSlurmScriptRuns:
    def test_a_two_process_fit_through_srun_and_torchrun_and_a_requeue_on_usr1(self, tmp_path, data_cache):
        """One node of 2 CPU processes (FSDP on gloo): the script's srun -> torchrun -> ``xtl fit`` path trains 2
        steps from scratch (``--ckpt_path auto`` finds nothing); USR1 (what ``--signal=B:USR1@600`` sends near the
        time limit) makes it ask SLURM to requeue the job, and it still waits for the fit and returns its status."""
        (tmp_path / "fsdp.yaml").write_text(FSDP)
        env = {**os.environ, **_stubs(tmp_path), "SLURM_JOB_NODELIST": "n1", "SLURM_JOB_ID": "4242"}
        env.update(SLURM_NNODES="1", SLURM_GPUS_PER_NODE="2", PYTHON=sys.executable, PYTHONPATH=str(ROOT))
        env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", MASTER_PORT=str(_free_port()))
        env = {k: v for k, v in env.items() if k not in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")}
        args = ["--config", str(ROOT / "configs/tiny_sft.yaml"), "--config", "fsdp.yaml", *SMALL_MODEL]
        args += ["--data.cache_dir", str(data_cache), "--data.pack_max_length", "128", "--trainer.max_steps", "2"]
        with (tmp_path / "log.txt").open("w") as log:
            job = subprocess.Popen(
                ["bash", str(SBATCH), *args], cwd=tmp_path, env=env, stdout=log, stderr=log, start_new_session=True
            )
            try:
                time.sleep(3)
                job.send_signal(signal.SIGUSR1)
                code = job.wait(timeout=300)
            finally:  # on a failure: SIGTERM the script and torchrun (which stops its workers)
                if job.poll() is None:
                    os.killpg(job.pid, signal.SIGTERM)
                    job.wait(timeout=30)
        text = (tmp_path / "log.txt").read_text()
        assert code == 0, text[-4000:]
        assert "xtl: time limit near: requeueing job 4242" in text
        assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"
        assert f"xtl: no checkpoint in {tmp_path / 'runs/tiny_sft/checkpoints'}; starting fresh" in text
        (metrics,) = (tmp_path / "runs/tiny_sft/logs").glob("version_*/metrics.csv")
        assert [int(r["step"]) for r in csv.DictReader(metrics.open()) if r.get("train/loss")] == [0, 1]
        assert (tmp_path / "runs/tiny_sft/checkpoints/last.ckpt").is_dir(), "a DCP checkpoint of the 2 ranks"
