"""Self-resuming runs: ``--ckpt_path auto``, restarts detected from the launcher, and torchrun recovering from a
rank killed by SIGKILL with the losses of an uninterrupted run."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml

from tests.cli.test_cli import ROOT, SMALL_MODEL, _run_main, _tiny_args
from tests.train.test_step import _free_port
from xtl.errors import ConfigError
from xtl.strategies.restart import attempt_store, resolve_ckpt_path, restart_variable

TORCHELASTIC = "TORCHELASTIC_RESTART_COUNT"
SLURM = "SLURM_RESTART_COUNT"
# a checkpoint every step, every one kept: a run of n steps leaves epoch=0-step=1..n.ckpt and last.ckpt
EVERY_STEP = (
    "trainer:\n  val_check_interval: null\n  callbacks:\n    - class_path: xtl.callbacks.TrainingCheckpoint\n"
    "      init_args: {dirpath: checkpoints, save_last: true, every_n_train_steps: 1, save_top_k: -1}\n"
    "data:\n  val_sources: null\n"
)


def _fake_checkpoint(path: Path, step: int, mtime: float) -> Path:
    """A whole single-file checkpoint (a ``torch.save`` zip) saved at ``step``, modified at ``mtime``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"global_step": step, "state_dict": {"w": torch.zeros(64)}}, path)
    os.utime(path, (mtime, mtime))
    return path


def _torn(path: Path) -> Path:
    """``path`` cut to half its bytes, as a crash mid-write would leave it."""
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


class TestResolveCkptPath:
    def test_auto_without_a_checkpoint_starts_fresh(self, tmp_path):
        folder = str(tmp_path / "checkpoints")
        resume = resolve_ckpt_path("auto", "fit", [folder], environ={})
        assert (resume.path, resume.automatic) == (None, True)
        assert resume.lines == (f"xtl: no checkpoint in {folder}; starting fresh",)

    def test_auto_takes_the_newest_intact_checkpoint_and_skips_a_torn_newer_one(self, tmp_path):
        _fake_checkpoint(tmp_path / "epoch=0-step=2.ckpt", 2, 1000)
        intact = _fake_checkpoint(tmp_path / "epoch=0-step=4.ckpt", 4, 2000)
        _torn(_fake_checkpoint(tmp_path / "last.ckpt", 6, 3000))
        resume = resolve_ckpt_path("auto", "fit", [str(tmp_path)], environ={})
        assert resume.path == str(intact)
        assert resume.lines == (f"xtl: resuming from {intact} (step 4)",)

    def test_across_folders_the_highest_step_wins_and_a_tie_goes_to_the_first(self, tmp_path):
        _fake_checkpoint(tmp_path / "a/last.ckpt", 5, 3000)  # the newest file, but an earlier step
        later = _fake_checkpoint(tmp_path / "b/last.ckpt", 8, 1000)
        folders = [str(tmp_path / "a"), str(tmp_path / "b")]
        assert resolve_ckpt_path("auto", "fit", folders, environ={}).path == str(later)
        first = _fake_checkpoint(tmp_path / "c/last.ckpt", 8, 500)
        folders = [str(tmp_path / "c"), str(tmp_path / "b")]
        assert resolve_ckpt_path("auto", "fit", folders, environ={}).path == str(first)

    def test_a_replacement_a_crash_interrupted_is_finished_first(self, tmp_path):
        """Killed between ``last.ckpt -> .last.ckpt.old`` and ``.last.ckpt.tmp -> last.ckpt``: the old copy comes
        back when the new one is torn, and is the newest checkpoint."""
        _fake_checkpoint(tmp_path / "epoch=0-step=2.ckpt", 2, 1000)
        _fake_checkpoint(tmp_path / ".last.ckpt.old", 3, 2000)
        _torn(_fake_checkpoint(tmp_path / ".last.ckpt.tmp", 4, 3000))
        resume = resolve_ckpt_path("auto", "fit", [str(tmp_path)], environ={})
        assert resume.path == str(tmp_path / "last.ckpt")
        assert resume.lines == (f"xtl: resuming from {tmp_path / 'last.ckpt'} (step 3)",)

    def test_a_distributed_checkpoint_gives_its_step_from_meta_pt_and_a_truncated_one_is_skipped(self, tmp_path):
        for step, mtime in ((2, 1000), (4, 2000)):
            path = tmp_path / f"epoch=0-step={step}.ckpt"
            dcp.save({"w": torch.arange(256.0)}, checkpoint_id=path, no_dist=True)
            torch.save({"global_step": step}, path / "meta.pt")
            os.utime(path, (mtime, mtime))
        (shard,) = (tmp_path / "epoch=0-step=4.ckpt").glob("*.distcp")
        _torn(shard)
        resume = resolve_ckpt_path("auto", "fit", [str(tmp_path)], environ={})
        assert resume.lines == (f"xtl: resuming from {tmp_path / 'epoch=0-step=2.ckpt'} (step 2)",)

    @pytest.mark.parametrize("variable", [TORCHELASTIC, SLURM])
    def test_a_restart_without_ckpt_path_behaves_as_auto(self, tmp_path, variable):
        last = _fake_checkpoint(tmp_path / "last.ckpt", 3, 1000)
        resume = resolve_ckpt_path(None, "fit", [str(tmp_path)], environ={variable: "2"})
        assert (resume.path, resume.automatic) == (str(last), True)
        assert resume.lines[0].startswith(f"xtl: restart detected ({variable}=2): resuming as --ckpt_path auto")
        assert resume.lines[1] == f"xtl: resuming from {last} (step 3)"

    @pytest.mark.parametrize(
        ("ckpt_path", "environ", "expected"),
        [
            (None, {TORCHELASTIC: "0", SLURM: "0"}, None),  # a first attempt: a fresh fit, the refusal applies
            (None, {TORCHELASTIC: ""}, None),
            ("none", {TORCHELASTIC: "1"}, None),  # opted out
            ("last", {TORCHELASTIC: "1"}, "last"),  # what the user typed wins
            ("some/file.ckpt", {SLURM: "3"}, "some/file.ckpt"),
        ],
    )
    def test_what_is_not_a_restart_or_opts_out_is_left_alone(self, tmp_path, ckpt_path, environ, expected):
        _fake_checkpoint(tmp_path / "last.ckpt", 3, 1000)
        resume = resolve_ckpt_path(ckpt_path, "fit", [str(tmp_path)], environ=environ)
        assert (resume.path, resume.automatic, resume.lines) == (expected, False, ())

    def test_restarts_are_only_detected_for_fit(self, tmp_path):
        assert restart_variable({SLURM: "1"}) == f"{SLURM}=1"
        assert resolve_ckpt_path(None, "validate", [str(tmp_path)], environ={SLURM: "1"}).path is None

    def test_evaluation_auto_without_a_checkpoint_is_an_error(self, tmp_path):
        with pytest.raises(ConfigError, match=r"--ckpt_path auto found no intact checkpoint in .*train first"):
            resolve_ckpt_path("auto", "test", [str(tmp_path)], environ={})
        last = _fake_checkpoint(tmp_path / "last.ckpt", 3, 1000)
        assert resolve_ckpt_path("auto", "test", [str(tmp_path)], environ={}).lines == (
            f"xtl: test uses {last} (step 3)",
        )

    def test_auto_needs_a_checkpoint_folder_but_a_restart_without_one_starts_fresh(self):
        with pytest.raises(ConfigError, match="trainer.callbacks has none"):
            resolve_ckpt_path("auto", "fit", [], environ={})
        resume = resolve_ckpt_path(None, "fit", [], environ={TORCHELASTIC: "1"})
        assert (resume.path, resume.lines[-1]) == (None, "xtl: no checkpoint folder in the config; starting fresh")


class TestAttemptStore:
    def test_each_torchrun_attempt_has_its_own_keys_in_the_agents_store(self):
        """A key a process of attempt 0 published (its address) is invisible to attempt 1, visible to attempt 0."""
        port = _free_port()
        server = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10))
        launch = {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        first = attempt_store(timedelta(seconds=10), {**launch, TORCHELASTIC: "0"})
        first.set("rank_0_address", "127.0.0.1:41381")
        second = attempt_store(timedelta(seconds=10), {**launch, TORCHELASTIC: "1"})
        assert not second.check(["rank_0_address"])
        assert (
            attempt_store(timedelta(seconds=10), {**launch, TORCHELASTIC: "0"}).get("rank_0_address")
            == b"127.0.0.1:41381"
        )
        assert server.num_keys() >= 1
        # without torchrun's shared store (Lightning's launcher, c10d with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)
        assert attempt_store(timedelta(seconds=10), {**launch, "TORCHELASTIC_USE_AGENT_STORE": "False"}) is None


def _steps(run: Path) -> list[list[int]]:
    """The steps each fit of the run logged a training loss at, one list per log version."""
    versions = sorted(run.glob("logs/version_*/metrics.csv"), key=lambda p: int(p.parent.name.split("_")[1]))
    return [[int(r["step"]) for r in csv.DictReader(m.open()) if r.get("train/loss")] for m in versions]


class TestAutoResume:
    RUN = Path("runs/tiny_sft")
    FOLDER = RUN / "checkpoints"

    @pytest.fixture
    def args(self, tmp_path, monkeypatch, data_cache) -> list[str]:
        """``xtl fit`` of the tiny recipe (checkpoint every step) in ``tmp_path``; no restart in the environment."""
        monkeypatch.chdir(tmp_path)
        for name in (TORCHELASTIC, SLURM):
            monkeypatch.delenv(name, raising=False)
        (tmp_path / "every_step.yaml").write_text(EVERY_STEP)
        return ["fit", *_tiny_args(ROOT / "configs/tiny_sft.yaml", data_cache, "--config", "every_step.yaml")]

    def test_auto_starts_fresh_then_resumes_from_the_newest_checkpoint(self, args, capsys):
        assert _run_main([*args, "--ckpt_path", "auto", "--trainer.max_steps", "2"]) == 0
        folder = self.FOLDER.resolve()
        assert f"xtl: no checkpoint in {folder}; starting fresh" in capsys.readouterr().err
        assert _run_main([*args, "--ckpt_path", "auto", "--trainer.max_steps", "3"]) == 0
        assert re.search(rf"xtl: resuming from {re.escape(str(folder))}/\S+\.ckpt \(step 2\)", capsys.readouterr().err)
        assert _steps(self.RUN) == [[0, 1], [2]]
        # the run's config keeps what the user wrote: it resumes again from whatever is newest then
        assert yaml.safe_load((self.RUN / "config.yaml").read_text())["ckpt_path"] == "auto"

    def test_auto_skips_a_torn_newer_checkpoint(self, args, capsys):
        assert _run_main([*args, "--trainer.max_steps", "3"]) == 0
        _torn(self.FOLDER / "last.ckpt")  # the newest file: step 3, now cut short
        capsys.readouterr()
        assert _run_main([*args, "--ckpt_path", "auto", "--trainer.max_steps", "4"]) == 0
        step3 = (self.FOLDER / "epoch=0-step=3.ckpt").resolve()
        assert f"xtl: resuming from {step3} (step 3)" in capsys.readouterr().err
        assert _steps(self.RUN) == [[0, 1, 2], [3]]

    def test_a_restarted_fit_resumes_by_itself_and_is_not_refused(self, args, capsys, monkeypatch):
        assert _run_main([*args, "--trainer.max_steps", "2"]) == 0
        monkeypatch.setenv(TORCHELASTIC, "1")
        capsys.readouterr()
        assert _run_main([*args, "--trainer.max_steps", "3"]) == 0
        err = capsys.readouterr().err
        assert f"xtl: restart detected ({TORCHELASTIC}=1): resuming as --ckpt_path auto" in err
        assert "xtl: resuming from " in err and "(step 2)" in err
        assert _steps(self.RUN) == [[0, 1], [2]]
        # opted out: a fresh fit again, refused over the run's checkpoints
        assert _run_main([*args, "--trainer.max_steps", "4", "--ckpt_path", "none"]) == 2
        assert "already holds the checkpoints of an earlier run" in capsys.readouterr().err

    def test_an_explicit_path_wins_over_a_restart(self, args, capsys, monkeypatch):
        assert _run_main([*args, "--trainer.max_steps", "2"]) == 0
        monkeypatch.setenv(SLURM, "1")
        capsys.readouterr()
        first = str(self.FOLDER / "epoch=0-step=1.ckpt")
        assert _run_main([*args, "--trainer.max_steps", "2", "--ckpt_path", first]) == 0
        assert "xtl: " not in capsys.readouterr().err.replace("xtl: data", "")
        assert _steps(self.RUN) == [[0, 1], [1]]

    def test_the_checkpoint_auto_finds_gives_the_model_settings(self, args, capsys, data_cache):
        """``validate --ckpt_path auto`` without the small model's options: the architecture is the checkpoint's,
        as with an explicit path (else loading its weights into the recipe's larger model would fail)."""
        assert _run_main([*args, "--trainer.max_steps", "1"]) == 0
        capsys.readouterr()
        plain = ["--config", str(ROOT / "configs/tiny_sft.yaml"), "--data.cache_dir", str(data_cache)]
        plain += ["--data.pack_max_length", "128", "--trainer.enable_progress_bar", "false"]
        assert _run_main(["validate", *plain, "--ckpt_path", "auto", "--trainer.limit_val_batches", "1"]) == 0
        assert re.search(r"xtl: validate uses \S+\.ckpt \(step 1\)", capsys.readouterr().err)


def _torchrun_fit(work: Path, cache: Path, *launch: str, extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node 2 LAUNCH -m xtl fit``: FSDP on gloo, 6 steps, a DCP checkpoint every 2 steps, the
    CSV log flushed every step (a killed attempt keeps what it logged)."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "fsdp.yaml").write_text(FSDP_EVERY_2)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", *launch, "-m", "xtl", "fit"]
    command += ["--config", str(ROOT / "configs/tiny_sft.yaml"), "--config", "fsdp.yaml", *SMALL_MODEL]
    command += ["--data.cache_dir", str(cache), "--data.pack_max_length", "128", "--trainer.max_steps", "6"]
    command += ["--trainer.devices", "2", *extra]
    env = {k: v for k, v in os.environ.items() if k not in (TORCHELASTIC, SLURM)}
    env.update(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    agent = subprocess.Popen(command, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = agent.communicate(timeout=300)
    except subprocess.TimeoutExpired:  # SIGTERM: torchrun stops its workers (they run in sessions of their own)
        agent.terminate()
        out, err = agent.communicate(timeout=30)
    return subprocess.CompletedProcess(command, agent.returncode, out, err)


FSDP_EVERY_2 = """\
trainer:
  strategy:
    class_path: xtl.strategies.FSDPStrategy
    init_args: {process_group_backend: gloo}
  precision: 32-true
  val_check_interval: null
  enable_progress_bar: false
  logger:
    - class_path: lightning.pytorch.loggers.CSVLogger
      init_args: {save_dir: ., name: logs, flush_logs_every_n_steps: 1}
  callbacks:
    - class_path: xtl.callbacks.TrainingCheckpoint
      init_args: {dirpath: checkpoints, save_last: true, every_n_train_steps: 2, save_top_k: -1}
data:
  val_sources: null
"""


def _losses_by_version(run: Path) -> list[dict[int, str]]:
    versions = sorted(run.glob("logs/version_*/metrics.csv"), key=lambda p: int(p.parent.name.split("_")[1]))
    return [
        {int(r["step"]): r["train/loss"] for r in csv.DictReader(m.open()) if r.get("train/loss")} for m in versions
    ]


@pytest.mark.slow
@pytest.mark.distributed
class TestTorchrunRestart:
    def test_a_rank_killed_mid_run_is_restarted_and_resumes_with_the_losses_of_an_uninterrupted_run(
        self, tmp_path, data_cache
    ):
        """``torchrun --max-restarts 2`` on 2 FSDP ranks; rank 1 SIGKILLs itself when step 3 starts (first attempt
        only). The restarted job resumes by itself from the step-2 checkpoint; the losses logged by the two attempts
        equal those of an uninterrupted run exactly (fp32 on CPU, the same packs: a resume is bitwise)."""
        port = ["--master-addr", "127.0.0.1"]
        full = _torchrun_fit(tmp_path / "full", data_cache, *port, "--master-port", str(_free_port()))
        assert full.returncode == 0, full.stderr[-4000:]
        (expected,) = _losses_by_version(tmp_path / "full/runs/tiny_sft")
        assert sorted(expected) == list(range(6))

        kill = {"class_path": "tests.cli.kill_rank.KillRankOnce", "init_args": {"step": 3, "rank": 1}}
        launch = [*port, "--master-port", str(_free_port()), "--max-restarts", "2"]
        proc = _torchrun_fit(
            tmp_path / "killed", data_cache, *launch, extra=(f"--trainer.callbacks+={json.dumps(kill)}",)
        )
        log = proc.stdout + proc.stderr
        assert proc.returncode == 0, log[-6000:]
        assert "exitcode: -9" in log, "rank 1 was not killed"
        assert f"xtl: restart detected ({TORCHELASTIC}=1)" in log
        ckpt = tmp_path / "killed/runs/tiny_sft/checkpoints/last.ckpt"
        assert f"xtl: resuming from {ckpt} (step 2)" in log or re.search(
            r"resuming from \S+step=2\.ckpt \(step 2\)", log
        )
        first, resumed = _losses_by_version(tmp_path / "killed/runs/tiny_sft")
        assert sorted(first) == [0, 1, 2] and sorted(resumed) == [2, 3, 4, 5]
        assert {**first, **resumed} == expected
        assert resumed[2] == first[2], "step 2 ran twice (logged, killed before its checkpoint): the same loss"
