"""RankWatchdog: who is named (the decision, without processes), the phases the hooks publish, and 2-rank runs
where a rank is killed or stalls in its data loader (every peer names it in one line and exits 75, no traceback).

Time to detection (kill or stall -> the line on the peer's stderr) is printed by the 2-rank tests (``-s``)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn

from tests.cli.test_cli import ROOT, _tiny_args
from tests.inprocess import run_in_process
from tests.train.test_step import _free_port
from xtl.callbacks import RankWatchdog
from xtl.callbacks._heartbeats import EXITED, FAILED, FINISHED, Beat, Progress, RankView, diagnose, store_gone
from xtl.callbacks._watchdog_thread import PREFIX, StoreGone, Watch
from xtl.callbacks.watchdog import EXIT_CODE
from xtl.errors import ConfigError

FAULTS = "tests.callbacks.watchdog_faults"
LINE = "; exiting so the launcher can restart the job"


def _view(rank: int, phase: str, step: int, event: int, seen_at: float = 0.0, moved_at: float = 0.0, **beat):
    """Rank ``rank`` (host ``node<rank>``, pid ``100 + rank``) at ``phase step <step>``."""
    view = RankView(rank, seen_at, moved_at=moved_at)
    progress = Progress(step, event, 0, f"{phase} step {step}")
    view.beat = Beat(rank, f"node{rank}", 100 + rank, count=1, progress=progress, **beat)
    return view


class TestProgress:
    def test_the_order_follows_the_hooks_of_a_step(self):
        """Within a step and across steps, each phase is further on than the one before it."""
        p0 = Progress(3).enter("data loading step 3", 3)
        p1 = p0.enter("forward/backward step 3", 3)
        p2 = p1.advance().advance()
        p3 = p2.enter("optimizer step 3", 3)
        p4 = p3.enter("checkpoint save step 4", 4)  # global_step counts the optimizer step
        p5 = p4.enter("data loading step 4", 4)
        orders = [p.order for p in (p0, p1, p2, p3, p4, p5)]
        assert orders == sorted(orders) and len(set(orders)) == len(orders)
        assert p2.sub == 2 and p3.sub == 0 and p4.event == 0

    def test_a_beat_survives_the_store(self):
        beat = Beat(3, "nodeA", 1234, 7, Progress(5, 2, 1, "optimizer step 5"), FAILED, "RuntimeError: boom")
        assert Beat.decode(beat.encode()) == beat

    def test_a_view_dates_new_beats_and_new_progress_only(self):
        view = RankView(1, seen_at=0.0)
        beat = Beat(1, "h", 9, 1, Progress(2, 1, 0, "forward/backward step 2"))
        view.observe(beat, 5.0)
        view.observe(beat, 9.0)  # the same beat read again: not a heartbeat
        assert (view.seen_at, view.moved_at) == (5.0, 5.0)
        view.observe(Beat(1, "h", 9, 2, beat.progress), 11.0)  # a heartbeat, no progress
        assert (view.seen_at, view.moved_at) == (11.0, 5.0)
        view.observe(Beat(1, "h", 9, 3, beat.progress.advance()), 12.0)
        assert view.moved_at == 12.0


class TestDiagnose:
    def test_a_rank_without_heartbeat_for_dead_after_is_named_with_its_host_and_last_step(self):
        views = {0: _view(0, "forward/backward", 5, 1, seen_at=30.0), 1: _view(1, "forward/backward", 5, 1)}
        assert diagnose(views, 30.0, dead_after=30.0, stall_after=None, failed_grace=1.0) is None
        verdict = diagnose(views, 31.0, dead_after=30.0, stall_after=None, failed_grace=1.0)
        expected = "rank 1 (host node1, pid 101) stopped heartbeating 31 s ago; its last step: forward/backward step 5"
        assert verdict == expected

    def test_a_rank_that_never_sent_a_heartbeat(self):
        views = {0: _view(0, "setup", 0, 0, seen_at=40.0), 1: RankView(1, 0.0)}
        assert diagnose(views, 40.0, 30.0, None, 1.0) == "rank 1 sent no heartbeat in 40 s"

    def test_finished_and_exited_ranks_are_not_missed(self):
        views = {r: _view(r, "training end", 9, 3, state=state) for r, state in enumerate((FINISHED, EXITED))}
        assert diagnose(views, 1000.0, 30.0, 10.0, 1.0) is None

    def test_a_launched_rank_killed_by_a_signal_is_named_at_once(self):
        views = {0: _view(0, "forward/backward", 5, 1, seen_at=2.0), 1: _view(1, "forward/backward", 5, 1)}
        views[1].exit_status = "was killed by SIGKILL"
        expected = "rank 1 (host node1, pid 101) was killed by SIGKILL; its last step: forward/backward step 5"
        assert diagnose(views, 2.0, 30.0, None, 1.0) == expected

    def test_a_launched_rank_that_exited_with_an_error_after_the_grace(self):
        """This rank may meet the same error a moment later: then it says its own."""
        views = {0: _view(0, "optimizer", 0, 2, seen_at=2.0), 1: _view(1, "optimizer", 0, 2, seen_at=2.0)}
        views[1].exit_status, views[1].failed_at = "exited with code 2", 2.0
        assert diagnose(views, 2.5, 30.0, None, 1.0) is None
        expected = "rank 1 (host node1, pid 101) exited with code 2; its last step: optimizer step 0"
        assert diagnose(views, 3.0, 30.0, None, 1.0) == expected

    def test_a_failed_rank_is_named_with_its_error_after_the_grace(self):
        views = {0: _view(0, "optimizer", 5, 2), 1: _view(1, "optimizer", 5, 2)}
        views[1].observe(Beat(1, "node1", 101, 2, views[1].beat.progress, FAILED, "ValueError: bad"), 10.0)
        assert diagnose(views, 10.5, 30.0, None, failed_grace=1.0) is None
        expected = "rank 1 (host node1, pid 101) failed with ValueError: bad; its last step: optimizer step 5"
        assert diagnose(views, 11.0, 30.0, None, failed_grace=1.0) == expected

    def test_the_rank_behind_all_others_is_named_with_its_phase(self):
        """Rank 1 hangs reading its batch; ranks 0 and 2 wait in the step's first collective."""
        views = {
            0: _view(0, "forward/backward", 3, 1, seen_at=100.0),
            1: _view(1, "data loading", 3, 0, seen_at=100.0),
            2: _view(2, "forward/backward", 3, 1, seen_at=100.0),
        }
        assert diagnose(views, 60.0, 30.0, stall_after=60.0, failed_grace=1.0) is None
        verdict = diagnose(views, 61.0, 30.0, stall_after=60.0, failed_grace=1.0)
        assert verdict == (
            "rank 1 (host node1, pid 101) made no progress for 61 s at data loading step 3 (the other ranks wait "
            "further on, at forward/backward step 3)"
        )

    def test_no_stall_while_the_rank_behind_still_moves(self):
        views = {0: _view(0, "forward/backward", 3, 1, seen_at=100.0), 1: _view(1, "validation after", 3, 0)}
        views[1].seen_at = views[1].moved_at = 99.0  # its validation batches go on
        assert diagnose(views, 100.0, 30.0, stall_after=60.0, failed_grace=1.0) is None

    def test_every_rank_at_the_same_point_is_named(self):
        views = {r: _view(r, "forward/backward", 3, 1, seen_at=100.0) for r in range(3)}
        verdict = diagnose(views, 100.0, 30.0, stall_after=60.0, failed_grace=1.0)
        assert verdict.startswith("ranks 0, 1, 2 made no progress for 100 s, all at forward/backward step 3")

    def test_stall_detection_can_be_off(self):
        views = {0: _view(0, "forward/backward", 3, 1, seen_at=1e6), 1: _view(1, "data loading", 3, 0, seen_at=1e6)}
        assert diagnose(views, 1e6, 30.0, stall_after=None, failed_grace=1.0) is None

    def test_the_store_host_gone(self):
        rank0 = _view(0, "optimizer", 4, 2)
        assert store_gone(rank0, "10.0.0.1:29500") == (
            "rank 0 (host node0, pid 100) is gone: the store it hosts at 10.0.0.1:29500 closed; its last step: "
            "optimizer step 4"
        )
        assert "torchrun's agent" in store_gone(None, "10.0.0.1:29500")


class _Watches:
    """Two ranks' watch threads in this process, on one real TCP store, with the verdict recorded instead of the
    exit."""

    def __init__(self, monkeypatch, stall_after: float | None = None, **progress: Progress) -> None:
        self.verdicts: dict[int, str] = {}
        self.progress = {
            0: Progress(3, 1, 0, "forward/backward step 3"),
            1: Progress(3, 1, 0, "forward/backward step 3"),
        }
        self.progress.update({int(rank[-1]): p for rank, p in progress.items()})
        self.sigterm = False

        def report(watch: Watch, verdict: str) -> None:
            self.verdicts[watch.rank] = verdict
            raise SystemExit  # ends the thread, as os._exit ends the process

        monkeypatch.setattr(Watch, "_report", report)
        self.server = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
        self.watches = [
            Watch(
                dist.PrefixStore(PREFIX, dist.TCPStore("127.0.0.1", self.server.port, 2, False)),
                ("127.0.0.1", self.server.port),
                rank,
                2,
                lambda rank=rank: self.progress[rank],
                interval=0.1,
                dead_after=30.0,
                stall_after=stall_after,
                hosts_store=rank == 0,
                rank0_hosts_store=True,
                terminating=lambda: self.sigterm,
            )
            for rank in range(2)
        ]
        for watch in self.watches:
            watch.start()

    def silence(self, rank: int) -> None:
        """Rank ``rank``'s heartbeats stop, as if its process died."""
        watch = self.watches[rank]
        watch._finish = lambda *_: None
        watch.end("dead")

    def wait(self, ranks: set[int], timeout: float) -> float:
        """Seconds until each of ``ranks`` has a verdict."""
        start = time.monotonic()
        while set(self.verdicts) < ranks and time.monotonic() - start < timeout:
            time.sleep(0.02)
        return time.monotonic() - start


class TestWatch:
    def test_after_sigterm_the_silent_rank_is_named_within_three_heartbeats(self, monkeypatch):
        """torchrun's agent SIGTERMs the other ranks when one dies: on NCCL nothing raises, so the SIGTERM is what
        makes the watch look for the dead rank (3 heartbeats) instead of waiting ``dead_after``."""
        watches = _Watches(monkeypatch)
        time.sleep(0.5)
        watches.silence(1)
        assert watches.wait({0}, 1.0) >= 1.0, "30 s dead_after: not yet"
        watches.sigterm = True
        assert watches.wait({0}, 5.0) < 1.0
        assert re.fullmatch(
            r"rank 1 \(host \S+, pid \d+\) stopped heartbeating \d+ s ago; its last step: forward/backward step 3",
            watches.verdicts[0],
        )

    def test_rank_0_names_the_stalled_rank_and_the_other_rank_reads_it(self, monkeypatch):
        watches = _Watches(monkeypatch, stall_after=0.5, rank1=Progress(3, 0, 0, "data loading step 3"))
        assert watches.wait({0, 1}, 5.0) < 3.0
        assert watches.verdicts[0] == watches.verdicts[1]
        assert re.fullmatch(r"rank 1 \(.*\) made no progress for \d+ s at data loading step 3 .*", watches.verdicts[0])

    def test_the_end_of_a_fit_is_quiet(self, monkeypatch):
        watches = _Watches(monkeypatch, stall_after=0.5)
        for rank in (1, 0):
            watches.progress[rank] = watches.progress[rank].advance()  # moving: no stall
        start = time.monotonic()
        for watch in reversed(watches.watches):
            watch.end(FINISHED)
        assert not any(w.is_alive() for w in watches.watches) and time.monotonic() - start < 2.0
        assert watches.verdicts == {}

    def test_the_sentinel_is_watched_past_fd_setsize(self):
        """A long-lived process (a notebook, the matrix runner) holds descriptors past 1024, where
        ``select.select`` raises ``ValueError``: an open sentinel passes, a closed server's is noticed."""
        server = socket.create_server(("127.0.0.1", 0))
        client = socket.create_connection(server.getsockname())
        peer, _ = server.accept()
        high = os.dup2(client.fileno(), 1500)
        sentinel = socket.socket(fileno=high)
        sentinel.setblocking(False)
        watch = Watch.__new__(Watch)  # only the sentinel check: no store, no thread
        watch._sentinel, watch.address = sentinel, None
        try:
            watch._check_sentinel()  # open, nothing to read
            assert watch._sentinel is sentinel
            peer.close()
            server.close()
            with pytest.raises(StoreGone):  # end-of-file, and no server to reconnect to
                watch._check_sentinel()
        finally:
            for sock in (client, sentinel):
                sock.close()


class TestPhases:
    def test_the_hooks_publish_the_phase_of_the_main_thread(self):
        watchdog = RankWatchdog()
        watchdog.watch = object()  # watching (the hooks only touch the progress)
        trainer = SimpleNamespace(global_step=3, state=SimpleNamespace(fn=TrainerFn.FITTING))
        seen = []

        def after(hook, *args):
            getattr(watchdog, hook)(trainer, None, *args)
            seen.append(watchdog.progress.phase)

        after("on_train_start")
        after("on_train_batch_start", None, 0)
        after("on_before_backward", None)
        after("on_before_backward", None)
        assert watchdog.progress.sub == 2
        after("on_before_optimizer_step", None)
        trainer.global_step = 4
        after("on_save_checkpoint", {})
        after("on_train_batch_end", None, None, 0)
        after("on_validation_start")
        after("on_validation_batch_start", None, 0)
        after("on_validation_end")
        after("on_train_end")
        assert seen == [
            "data loading step 3", "forward/backward step 3", "forward/backward step 3", "forward/backward step 3",
            "optimizer step 3", "checkpoint save step 4", "data loading step 4", "validation after step 4",
            "validation after step 4", "data loading step 4", "training end",
        ]  # fmt: skip

    def test_nothing_moves_without_a_watch(self):
        watchdog = RankWatchdog()
        watchdog.on_train_batch_start(SimpleNamespace(global_step=3), None, None, 0)
        assert watchdog.progress == Progress()

    @pytest.mark.parametrize(
        "kwargs, key",
        [({"interval_s": 0}, "interval_s"), ({"dead_after_s": 5.0}, "dead_after_s"), ({"stall_timeout_s": 1}, "st")],
    )
    def test_bad_settings_name_their_key(self, kwargs, key):
        with pytest.raises(ConfigError, match=rf"RankWatchdog\].init_args.{key}"):
            RankWatchdog(**kwargs)


class TestOneProcess:
    def test_inert_the_cli_adds_one_that_starts_no_thread(self, tmp_path, data_cache):
        record = tmp_path / "watch.json"
        recorder = json.dumps({"class_path": f"{FAULTS}.RecordWatch", "init_args": {"record": str(record)}})
        args = ["fit", *_tiny_args(ROOT / "configs/tiny_sft.yaml", data_cache), "--trainer.max_steps", "1"]
        args += ["--data.val_sources", "null", "--trainer.val_check_interval", "null"]
        for i, extra in enumerate([[], ["--config", str(ROOT / "callbacks/watchdog.yaml")]]):  # default, fragment
            (tmp_path / str(i)).mkdir()
            code, output = run_in_process([*args, *extra, f"--trainer.callbacks+={recorder}"], tmp_path / str(i))
            assert code == 0, output[-3000:]
            seen = json.loads(record.read_text())
            assert seen["watching"] == [False], "one watchdog, not watching"
            assert "xtl-rank-watchdog" not in seen["threads"]


# ---- two ranks -----------------------------------------------------------------------------------------------


class _Run:
    """A 2-rank ``xtl fit`` (Lightning's launcher, or torchrun) whose output lines are time-stamped as they come."""

    def __init__(self, tmp_path: Path, data_cache: Path, *extra: str, torchrun: bool = False) -> None:
        fragment = tmp_path / "fsdp.yaml"
        fragment.write_text(
            "trainer:\n  strategy: {class_path: xtl.strategies.FSDPStrategy}\n  val_check_interval: null\n"
            "  precision: 32-true\n  max_steps: 50\ndata:\n  val_sources: null\n"
        )
        args = ["fit", *_tiny_args(ROOT / "configs/tiny_sft.yaml", data_cache, "--config", str(fragment), *extra)]
        args += ["--trainer.devices", "2"]
        command = [sys.executable, "-m", "xtl", *args]
        if torchrun:
            launch = ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1"]
            command = [sys.executable, *launch, "--master-port", str(_free_port()), *command[1:]]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        env.pop("XTL_DEBUG", None)
        self.lines: list[tuple[float, str]] = []
        proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        reader = threading.Thread(target=self._read, args=(proc.stdout,), daemon=True)
        reader.start()
        self.code = proc.wait(timeout=300)
        reader.join(timeout=120)  # every rank that holds the pipe has exited
        assert not reader.is_alive(), "a rank outlived the run:\n" + self.output[-3000:]

    def _read(self, stream) -> None:
        for raw in stream:
            self.lines.append((time.time(), raw.decode(errors="replace")))

    @property
    def output(self) -> str:
        return "".join(line for _, line in self.lines)

    def verdicts(self) -> list[tuple[float, str]]:
        """(time, line) of each ``xtl: error: ...`` line."""
        return [(t, line.strip()) for t, line in self.lines if line.startswith("xtl: error: ")]


def _fault(name: str, **init_args) -> str:
    return "--trainer.callbacks+=" + json.dumps({"class_path": f"{FAULTS}.{name}", "init_args": init_args})


def _since(path: Path, when: float) -> float:
    return when - float(path.read_text())


@pytest.mark.slow
@pytest.mark.distributed
class TestTwoRanks:
    """FSDP on gloo, 2 ranks, the watchdog's defaults (the CLI adds it) unless said otherwise."""

    def test_rank_1_killed_is_named_by_rank_0(self, tmp_path, data_cache):
        record = tmp_path / "killed"
        run = _Run(tmp_path, data_cache, _fault("KillRank", step=3, rank=1, linger_s=4.5, record=str(record)))
        (when, line), *others = run.verdicts()
        assert others == [], run.output[-3000:]
        assert re.fullmatch(
            r"xtl: error: rank 1 \(host \S+, pid \d+\) was killed by SIGKILL; its last step: forward/backward step 3"
            + LINE,
            line,
        ), line
        assert run.code == EXIT_CODE and "Traceback" not in run.output, run.output[-3000:]
        print(f"\nrank 1 killed -> rank 0 named it after {_since(record, when):.1f} s")
        assert _since(record, when) < 30

    def test_rank_0_killed_is_named_by_rank_1(self, tmp_path, data_cache):
        """Rank 0 hosts the store (Lightning's launcher): its death closes it; rank 1 names rank 0 at once."""
        record = tmp_path / "killed"
        run = _Run(tmp_path, data_cache, _fault("KillRank", step=3, rank=0, linger_s=4.5, record=str(record)))
        (when, line), *others = run.verdicts()
        assert others == [], run.output[-3000:]
        assert re.fullmatch(
            r"xtl: error: rank 0 \(host \S+, pid \d+\) is gone: the store it hosts at [\d.]+:\d+ closed; its last "
            r"step: forward/backward step 3" + LINE,
            line,
        ), line
        assert "Traceback" not in run.output, run.output[-3000:]
        print(f"\nrank 0 killed -> rank 1 named it after {_since(record, when):.1f} s")
        assert _since(record, when) < 30

    def test_rank_1_stalled_in_its_data_loader_is_named_by_both(self, tmp_path, data_cache):
        """Rank 1's batch never comes; rank 0 waits in the step's first collective: after the stall time, both
        ranks name rank 1 and its phase, and exit 75."""
        record, stall = tmp_path / "stalled", 10.0
        settings = {"interval_s": 0.5, "dead_after_s": 10.0, "stall_timeout_s": stall}
        watchdog = json.dumps({"class_path": "xtl.callbacks.RankWatchdog", "init_args": settings})
        watchdog = f"--trainer.callbacks+={watchdog}"
        run = _Run(tmp_path, data_cache, watchdog, _fault("StallData", step=3, rank=1, record=str(record)))
        verdicts = run.verdicts()
        expected = (
            r"xtl: error: rank 1 \(host \S+, pid \d+\) made no progress for \d+ s at data loading step 3 \(the other "
            r"ranks wait further on, at forward/backward step 3\)" + LINE
        )
        assert len(verdicts) == 2 and all(re.fullmatch(expected, line) for _, line in verdicts), run.output[-3000:]
        assert run.code == EXIT_CODE and "Traceback" not in run.output, run.output[-3000:]
        late = max(_since(record, when) for when, _ in verdicts)
        print(f"\nrank 1 stalled -> both ranks named it after {late:.1f} s (stall_timeout_s {stall})")
        assert stall < late < stall + 5

    def test_torchrun_rank_0_killed_is_named_by_rank_1(self, tmp_path, data_cache):
        """torchrun's agent hosts the store and stops the other rank (SIGTERM) when one dies; rank 1's collective
        fails and it names rank 0 from the heartbeats, before the agent's time-out."""
        record = tmp_path / "killed"
        run = _Run(
            tmp_path, data_cache, _fault("KillRank", step=3, rank=0, linger_s=4.5, record=str(record)), torchrun=True
        )
        (when, line), *others = run.verdicts()
        assert others == [], run.output[-3000:]
        assert re.fullmatch(
            r"xtl: error: rank 0 \(host \S+, pid \d+\) stopped heartbeating \d+ s ago; its last step: "
            r"forward/backward step 3" + LINE,
            line,
        ), line
        assert re.search(rf"rank\s+: 1 \(local_rank: 1\)\n\s+exitcode\s+: {EXIT_CODE}", run.output), run.output[-3000:]
        assert "pair.cc" not in run.output, "gloo's error is not shown"
        print(f"\ntorchrun: rank 0 killed -> rank 1 named it after {_since(record, when):.1f} s")
        assert _since(record, when) < 30
