"""Rollout traces (:mod:`xtl.rl.trace`) and their HTML page (:mod:`xtl.rl.trace_viewer`)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from xtl.rl import trace_viewer
from xtl.rl.trace import NULL_TRACER, Span, Tracer, activate, carrier, current

ROOT = Path(__file__).resolve().parents[2]
KEYS = {"trace_id", "span_id", "parent_id", "name", "stage", "start_ns", "end_ns", "duration_s", "step", "samples",
        "status", "attributes", "chain"}  # fmt: skip


@pytest.fixture(autouse=True)
def _no_active_tracer() -> Iterator[None]:
    activate(None)
    yield
    activate(None)


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


class TestTracer:
    def test_nested_spans_are_written_as_json_lines(self, tmp_path: Path) -> None:
        path = tmp_path / "run" / "logs" / "traces.jsonl"
        tracer = Tracer(path)
        assert tracer.path == path and path.parent.is_dir()
        with tracer.span("agent_loop", "agent_loop", samples=["s0"], step=3, turn=0) as loop:
            assert isinstance(loop, Span)
            with tracer.span("generate", "generate", samples=["s0", "s1"], step=3) as generate:
                generate.set(finish_reason="stop", new_tokens=12)
                with tracer.span("calculator", "tool", samples="s0", step=3):
                    pass
        with tracer.span("train", "train", step=3):
            pass
        assert not path.exists()  # buffered until flushed
        tracer.flush()
        tool, generate, loop, train = _lines(path)
        for record in (tool, generate, loop, train):
            assert set(record) == KEYS
            assert record["trace_id"] == tracer.trace_id and len(record["trace_id"]) == 32
            assert record["status"] == "ok" and record["step"] == 3
            assert record["end_ns"] >= record["start_ns"]
            assert record["duration_s"] == pytest.approx((record["end_ns"] - record["start_ns"]) / 1e9, abs=1e-9)
        assert len({record["span_id"] for record in (tool, generate, loop, train)}) == 4
        assert loop["parent_id"] is None and loop["chain"] == "agent_loop"
        assert generate["parent_id"] == loop["span_id"] and generate["chain"] == "agent_loop -> generate"
        assert tool["parent_id"] == generate["span_id"] and tool["chain"] == "agent_loop -> generate -> calculator"
        assert train["parent_id"] is None and train["chain"] == "train"  # the stack was popped
        assert tool["samples"] == ["s0"] and generate["samples"] == ["s0", "s1"] and train["samples"] == []
        assert generate["attributes"] == {"finish_reason": "stop", "new_tokens": 12}
        assert loop["attributes"] == {"turn": 0} and tool["stage"] == "tool"
        assert loop["start_ns"] <= generate["start_ns"] <= tool["start_ns"] <= tool["end_ns"] <= loop["end_ns"]
        tracer.flush()  # nothing new: nothing appended
        assert len(_lines(path)) == 4

    def test_a_raising_body_is_an_error_span_and_the_exception_propagates(self, tmp_path: Path) -> None:
        tracer = Tracer(tmp_path / "traces.jsonl")
        with pytest.raises(KeyError, match="boom"):
            with tracer.span("judge", "judge", samples=["s0"]):
                with tracer.span("math_verify", "judge"):
                    raise KeyError("boom")
        with tracer.span("after", "train"):
            pass
        tracer.close()
        inner, outer, after = _lines(tracer.path)
        for record in (inner, outer):
            assert record["status"] == "error" and record["attributes"]["error"] == "KeyError"
        assert after["status"] == "ok" and "error" not in after["attributes"]
        assert after["parent_id"] is None and after["chain"] == "after"

    def test_an_event_is_a_zero_length_span_under_the_open_one(self, tmp_path: Path) -> None:
        tracer = Tracer(tmp_path / "traces.jsonl")
        with tracer.span("rollout", "agent_loop", step=1):
            tracer.event("dynamic_sampling", "filter", samples=["s2"], step=1, status="filtered")
        tracer.close()
        event, rollout = _lines(tracer.path)
        assert event["duration_s"] == 0 and event["start_ns"] == event["end_ns"]
        assert event["parent_id"] == rollout["span_id"] and event["chain"] == "rollout -> dynamic_sampling"
        assert event["attributes"] == {"status": "filtered"} and event["samples"] == ["s2"]

    def test_two_threads_record_spans_at_once(self, tmp_path: Path) -> None:
        tracer = Tracer(tmp_path / "traces.jsonl", flush_every=7)  # flushes race with the other thread's records
        start = threading.Barrier(2)

        def record(thread: int) -> None:
            start.wait()
            with tracer.span(f"outer{thread}", "agent_loop"):
                for index in range(199):
                    with tracer.span(f"inner{thread}", "generate", samples=[f"t{thread}-{index}"], index=index):
                        pass
                    if index % 50 == 0:
                        tracer.flush()

        threads = [threading.Thread(target=record, args=(thread,)) for thread in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        tracer.close()
        lines = tracer.path.read_text().split("\n")
        assert lines[-1] == "" and len(lines) == 401
        records = [json.loads(line) for line in lines[:-1]]
        assert len({record["span_id"] for record in records}) == 400
        outers = {record["name"]: record["span_id"] for record in records if record["name"].startswith("outer")}
        for thread in range(2):
            inner = [record for record in records if record["name"] == f"inner{thread}"]
            assert len(inner) == 199
            # each thread nests under its own outer span (a shared stack would mix them)
            assert {record["parent_id"] for record in inner} == {outers[f"outer{thread}"]}
            assert sorted(record["attributes"]["index"] for record in inner) == list(range(199))

    def test_a_carrier_continues_the_chain_on_another_thread(self, tmp_path: Path) -> None:
        tracer = Tracer(tmp_path / "traces.jsonl")
        assert carrier() == {}  # no tracer active, no span open
        activate(tracer)
        assert carrier() == {"trace_id": tracer.trace_id}
        seen: dict[str, dict[str, str]] = {}

        def judge(parent: dict[str, str]) -> None:
            seen["thread"] = carrier()  # a new thread does not inherit the open span
            with tracer.span("orphan", "judge"):
                pass
            with tracer.span("judge", "judge", samples=["s0"], parent=parent):
                with tracer.span("math_verify", "judge", samples=["s0"]):
                    pass

        with tracer.span("agent_loop", "agent_loop", samples=["s0"]):
            with tracer.span("generate", "generate", samples=["s0"]):
                sent = json.loads(json.dumps(carrier()))  # plain strings: picklable, JSON-serializable
            thread = threading.Thread(target=judge, args=(sent,))
            thread.start()
            thread.join()
        tracer.close()
        records = {record["name"]: record for record in _lines(tracer.path)}
        assert seen["thread"] == {"trace_id": tracer.trace_id}
        assert sent == {"trace_id": tracer.trace_id, "span_id": records["generate"]["span_id"],
                        "chain": "agent_loop -> generate"}  # fmt: skip
        assert records["orphan"]["parent_id"] is None and records["orphan"]["chain"] == "orphan"
        assert records["judge"]["parent_id"] == records["generate"]["span_id"]
        assert records["judge"]["chain"] == "agent_loop -> generate -> judge"
        assert records["math_verify"]["parent_id"] == records["judge"]["span_id"]
        assert records["math_verify"]["chain"] == "agent_loop -> generate -> judge -> math_verify"
        assert {record["trace_id"] for record in records.values()} == {tracer.trace_id}

    def test_a_carrier_continues_the_chain_in_another_process(self, tmp_path: Path) -> None:
        """What a Ray actor does with the carrier it is sent: its own tracer, the run's trace and chain."""
        tracer = Tracer(tmp_path / "traces.jsonl")
        with tracer.span("agent_loop", "agent_loop", samples=["s0"], step=2) as loop:
            sent = carrier()
        tracer.close()
        script = (
            "import json, sys\n"
            "from xtl.rl.trace import Tracer\n"
            "tracer = Tracer(sys.argv[1])\n"
            "with tracer.span('judge', 'judge', samples=['s0'], step=2, parent=json.loads(sys.argv[2])):\n"
            "    with tracer.span('math_verify', 'judge', samples=['s0'], step=2):\n"
            "        pass\n"
            "tracer.close()\n"
        )
        other = tmp_path / "actor.jsonl"
        subprocess.run([sys.executable, "-c", script, str(other), json.dumps(sent)], check=True, cwd=ROOT)
        inner, judge = _lines(other)
        assert judge["trace_id"] == tracer.trace_id and judge["parent_id"] == loop.span_id
        assert judge["chain"] == "agent_loop -> judge" and inner["chain"] == "agent_loop -> judge -> math_verify"
        assert inner["trace_id"] == tracer.trace_id and inner["parent_id"] == judge["span_id"]

    def test_without_a_path_nothing_is_written(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.chdir(tmp_path)
        tracer = Tracer(None)
        with tracer.span("generate", "generate", samples=["s0"]):
            pass
        tracer.close()
        assert tracer.path is None and list(tmp_path.iterdir()) == []

    def test_a_torn_last_line_is_not_glued_to_the_next_run(self, tmp_path: Path) -> None:
        path = tmp_path / "traces.jsonl"
        first = Tracer(path)
        with first.span("generate", "generate", samples=["s0"], step=0):
            pass
        first.close()
        with open(path, "a") as handle:
            handle.write('{"trace_id": "ab", "span_id"')  # the run died mid-write
        resumed = Tracer(path)
        with resumed.span("generate", "generate", samples=["s0"], step=1):
            pass
        resumed.close()
        lines = path.read_text().splitlines()
        assert len(lines) == 3 and lines[1] == '{"trace_id": "ab", "span_id"'
        assert json.loads(lines[2])["trace_id"] == resumed.trace_id != first.trace_id
        with pytest.warns(UserWarning, match=r"traces.jsonl:2: not a JSON object"):
            spans = trace_viewer.load_spans(path)
        assert [span["step"] for span in spans] == [0, 1]


class TestAttributes:
    @pytest.mark.parametrize(
        "key",
        ["prompt", "response", "messages", "text", "content", "api_key", "secret", "token", "tokens", "Prompt",
         "response.s1", "openai_api_key"],
    )  # fmt: skip
    def test_prompts_responses_and_secrets_are_refused(self, tmp_path: Path, key: str) -> None:
        tracer = Tracer(tmp_path / "traces.jsonl")
        with pytest.raises(ValueError, match=re.escape(repr(key))):
            tracer.span("generate", "generate", **{key: "x"})
        with tracer.span("generate", "generate") as span:
            with pytest.raises(ValueError, match=re.escape(repr(key))):
                span.set(**{key: "x"})
        with pytest.raises(ValueError, match=re.escape(repr(key))):
            tracer.event("generate", "generate", **{key: "x"})

    @pytest.mark.parametrize("value", [[1, 2], {"a": 1}, None, (1,), b"bytes", object()])
    def test_non_scalar_values_are_refused(self, tmp_path: Path, value: object) -> None:
        tracer = Tracer(tmp_path / "traces.jsonl")
        with pytest.raises(TypeError, match="'reward'"):
            tracer.span("judge", "judge", reward=value)
        with tracer.span("judge", "judge") as span:
            with pytest.raises(TypeError, match="'reward'"):
                span.set(reward=value)

    def test_scalars_are_kept_and_long_strings_cut(self, tmp_path: Path) -> None:
        tracer = Tracer(tmp_path / "traces.jsonl")
        with tracer.span("judge", "judge", samples=["s0"], note="x" * 500, short="ok", flag=True) as span:
            span.set(reward=0.5, num_tokens=7, completion_tokens=3, **{"reward.s0": 1.0})
            span.set(reward=float("nan"))
        tracer.close()
        (record,) = _lines(tracer.path)
        attributes = record["attributes"]
        assert attributes["note"] == "x" * 200 and attributes["short"] == "ok"
        assert attributes["flag"] is True and attributes["num_tokens"] == 7 and attributes["completion_tokens"] == 3
        assert attributes["reward.s0"] == 1.0 and attributes["reward"] == "nan"  # the file stays strict JSON
        assert "NaN" not in tracer.path.read_text()

    def test_a_step_must_be_an_int(self, tmp_path: Path) -> None:
        tracer = Tracer(tmp_path / "traces.jsonl")
        with pytest.raises(TypeError, match="step"):
            tracer.span("train", "train", step="3")


class TestNullTracer:
    def test_it_is_the_default_and_does_nothing(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.chdir(tmp_path)
        assert current() is NULL_TRACER and isinstance(NULL_TRACER, Tracer) and NULL_TRACER.path is None
        with current().span("generate", "generate", samples=["s0"], step=1, prompt="refused elsewhere") as span:
            span.set(reward=[1.0], secret="x")  # no checks, nothing kept
            assert carrier() == {}  # no span opened
            current().event("filter", "filter", samples=["s0"])
        assert span.attributes == {}
        with pytest.raises(RuntimeError):
            with current().span("judge", "judge"):
                raise RuntimeError
        current().flush()
        current().close()
        assert list(tmp_path.iterdir()) == []

    def test_activate_sets_and_clears_the_process_tracer(self, tmp_path: Path) -> None:
        tracer = Tracer(tmp_path / "traces.jsonl")
        activate(tracer)
        assert current() is tracer
        seen = []
        thread = threading.Thread(target=lambda: seen.append(current()))  # every thread's
        thread.start()
        thread.join()
        assert seen == [tracer]
        activate(None)
        assert current() is NULL_TRACER


def _two_steps(path: Path) -> tuple[Tracer, dict[int, dict[str, float]]]:
    """2 steps x 4 samples: a generate span over the 4, then per-sample judging (step 0) or one batched judge span
    with per-sample attributes (step 1); sample 2 is filtered after judging, sample 3 aborted."""
    tracer = Tracer(path)
    rewards = {0: {"0.0": 1.0, "0.1": 0.0, "0.2": 0.5}, 1: {"1.0": 0.25, "1.1": 1.0, "1.2": 0.0}}
    for step in range(2):
        ids = [f"{step}.{index}" for index in range(4)]
        with tracer.span("rollout", "agent_loop", samples=ids, step=step):
            with tracer.span("generate", "generate", samples=ids, step=step) as generate:
                generate.set(finish_reason="stop", **{f"finish_reason.{ids[1]}": "length"})
            tracer.event("abort", "generate", samples=[ids[3]], step=step, status="aborted")
            if step == 0:
                for sample in ids[:3]:
                    with tracer.span("math", "judge", samples=[sample], step=step) as judge:
                        judge.set(reward=rewards[step][sample], status="completed")
            else:
                batch = {f"reward.{sample}": rewards[step][sample] for sample in ids[:3]}
                with tracer.span("math", "judge", samples=ids[:3], step=step, status="completed", **batch):
                    pass
            tracer.event("dynamic_sampling", "filter", samples=[ids[2]], step=step, status="filtered",
                         filter_reason="zero_std")  # fmt: skip
        with tracer.span("update", "train", samples=ids[:2], step=step):
            pass
    tracer.close()
    return tracer, rewards


def _page_data(page: Path) -> dict:
    html = page.read_text()
    match = re.search(r'<script type="application/json" id="xtl-trace-data">(.*?)</script>', html, re.DOTALL)
    assert match is not None
    return json.loads(match.group(1))


class TestViewer:
    def test_the_page_holds_each_sample_of_each_step(self, tmp_path: Path) -> None:
        path = tmp_path / "traces.jsonl"
        _, rewards = _two_steps(path)
        page = trace_viewer.write_page(path)
        assert page == tmp_path / "traces.html"
        assert sorted(item.name for item in tmp_path.iterdir()) == ["traces.html", "traces.jsonl"]  # no temp file
        html = page.read_text()
        assert "<script src" not in html and "<link" not in html and "http://" not in html and "https://" not in html
        data = _page_data(page)
        assert data == trace_viewer.summarize(trace_viewer.load_spans(path))
        spans = _lines(path)
        assert [step["step"] for step in data["steps"]] == [0, 1]
        for step in data["steps"]:
            number = step["step"]
            ids = [f"{number}.{index}" for index in range(4)]
            assert [sample["id"] for sample in step["samples"]] == ids
            by_id = {sample["id"]: sample for sample in step["samples"]}
            for sample_id, sample in by_id.items():
                listing = [span for span in spans if span["step"] == number and sample_id in span["samples"]]
                expected: dict[str, float] = {}
                for span in listing:
                    expected[span["stage"]] = expected.get(span["stage"], 0.0) + span["duration_s"]
                assert sample["stages"] == pytest.approx(expected, abs=1e-12)
                assert sample["start_ns"] == min(span["start_ns"] for span in listing)
                assert sample["end_ns"] == max(span["end_ns"] for span in listing)
                assert len(sample["segments"]) == len(listing)
            # the batched generate span counts whole for each of its samples
            (generate,) = [span for span in spans if span["step"] == number and span["name"] == "generate"]
            for sample_id in ids[:3]:
                assert by_id[sample_id]["stages"]["generate"] == pytest.approx(generate["duration_s"], abs=1e-12)
            assert by_id[ids[3]]["stages"]["generate"] == pytest.approx(generate["duration_s"], abs=1e-12)  # + abort
            assert {sample_id: by_id[sample_id]["reward"] for sample_id in ids[:3]} == rewards[number]
            assert by_id[ids[3]]["reward"] is None and "judge" not in by_id[ids[3]]["stages"]
            assert [by_id[sample_id]["status"] for sample_id in ids] == ["completed", "completed", "filtered",
                                                                         "aborted"]  # fmt: skip
            assert by_id[ids[2]]["filter_reason"] == "zero_std" and by_id[ids[0]]["filter_reason"] is None
            assert [by_id[sample_id]["finish_reason"] for sample_id in ids] == ["stop", "length", "stop", "stop"]
            assert step["counts"] == dict(Counter(sample["status"] for sample in step["samples"]))
            assert step["counts"] == {"completed": 2, "filtered": 1, "aborted": 1}
            assert "rollout -> generate" in by_id[ids[0]]["chain"] and "update" in by_id[ids[0]]["chain"]
            assert "update" not in by_id[ids[2]]["chain"] and "train" not in by_id[ids[2]]["stages"]

    def test_a_sample_without_a_status_is_an_error_if_a_span_raised(self) -> None:
        tracer = Tracer(None)
        spans: list[dict] = []
        tracer._record = lambda span, end_ns, status: spans.append(  # type: ignore[method-assign]
            {"step": span.step, "samples": list(span.samples), "stage": span.stage, "name": span.name,
             "start_ns": span.start_ns, "end_ns": end_ns, "duration_s": 0.0, "status": status,
             "attributes": dict(span.attributes), "chain": span.chain}
        )  # fmt: skip
        with pytest.raises(TimeoutError):
            with tracer.span("math", "judge", samples=["a"], step=0):
                raise TimeoutError
        with tracer.span("math", "judge", samples=["b"], step=0):
            pass
        (step,) = trace_viewer.summarize(spans)["steps"]
        assert [(sample["id"], sample["status"]) for sample in step["samples"]] == [("a", "error"), ("b", "unknown")]

    def test_spans_without_a_step_count_at_their_samples_step(self) -> None:
        spans = [
            {"step": None, "samples": ["s10", "s2"], "stage": "agent_loop", "name": "loop", "start_ns": 0,
             "end_ns": 2_000_000_000, "duration_s": 2.0, "status": "ok", "attributes": {}, "chain": "loop"},
            {"step": 4, "samples": ["s10", "s2"], "stage": "judge", "name": "math", "start_ns": 2_000_000_000,
             "end_ns": 3_000_000_000, "duration_s": 1.0, "status": "ok", "attributes": {"status": "completed"},
             "chain": "math"},
        ]  # fmt: skip
        (step,) = trace_viewer.summarize(spans)["steps"]
        assert step["step"] == 4 and [sample["id"] for sample in step["samples"]] == ["s2", "s10"]
        assert step["samples"][0]["stages"] == {"agent_loop": 2.0, "judge": 1.0}
        assert step["samples"][0]["seconds"] == 3.0 and step["stages"] == {"agent_loop": 2.0, "judge": 1.0}

    def test_a_torn_last_line_is_skipped(self, tmp_path: Path) -> None:
        path = tmp_path / "traces.jsonl"
        _two_steps(path)
        whole = trace_viewer.load_spans(path)
        assert len(whole) == len(_lines(path))
        with open(path, "a") as handle:
            handle.write('{"trace_id": "0f", "span_id": "1a", "na')
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a torn last line is expected (a stopped run), not warned about
            assert trace_viewer.load_spans(path) == whole
        assert _page_data(trace_viewer.write_page(path)) == trace_viewer.summarize(whole)

    def test_ids_that_would_end_the_script_are_escaped(self, tmp_path: Path) -> None:
        tracer = Tracer(tmp_path / "traces.jsonl")
        with tracer.span("math", "judge", samples=["</script><b>x"], step=0, filter_reason="<!-- & -->"):
            pass
        tracer.close()
        data = _page_data(trace_viewer.write_page(tracer.path, tmp_path / "out" / "page.html"))
        (sample,) = data["steps"][0]["samples"]
        assert sample["id"] == "</script><b>x" and sample["filter_reason"] == "<!-- & -->"

    def test_main_writes_the_page_and_prints_its_path(self, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
        path = tmp_path / "traces.jsonl"
        _two_steps(path)
        assert trace_viewer.main([str(path)]) == 0
        assert capsys.readouterr().out.strip() == str(tmp_path / "traces.html")
        out = tmp_path / "pages" / "run.html"
        assert trace_viewer.main([str(path), "--out", str(out)]) == 0
        assert capsys.readouterr().out.strip() == str(out)
        assert _page_data(out) == _page_data(tmp_path / "traces.html")
        assert trace_viewer.main([str(tmp_path / "missing.jsonl")]) == 1
        assert "no trace file" in capsys.readouterr().err

    def test_module_runs_as_a_command(self, tmp_path: Path) -> None:
        path = tmp_path / "traces.jsonl"
        _two_steps(path)
        done = subprocess.run([sys.executable, "-m", "xtl.rl.trace_viewer", str(path)], check=True, cwd=ROOT,
                              capture_output=True, text=True)  # fmt: skip
        assert done.stdout.strip() == str(tmp_path / "traces.html") and (tmp_path / "traces.html").is_file()


class TestOpenTelemetry:
    def test_spans_are_exported_with_their_ids_and_attributes(self, tmp_path: Path) -> None:
        memory = pytest.importorskip("opentelemetry.sdk.trace.export.in_memory_span_exporter")
        from opentelemetry.trace import StatusCode

        exporter = memory.InMemorySpanExporter()
        tracer = Tracer(tmp_path / "traces.jsonl", service_name="xtl-test", exporter=exporter)
        with tracer.span("agent_loop", "agent_loop", samples=["s0", "s1"], step=5):
            with tracer.span("math", "judge", samples=["s0"], step=5) as judge:
                judge.set(reward=1.0, status="completed")
            with pytest.raises(ValueError):
                with tracer.span("calculator", "tool", samples=["s1"]):
                    raise ValueError
        tracer.close()
        records = {record["name"]: record for record in _lines(tracer.path)}
        exported = {span.name: span for span in exporter.get_finished_spans()}
        assert set(exported) == {"agent_loop", "math", "calculator"}
        for name, span in exported.items():
            record = records[name]
            assert span.context.trace_id == int(tracer.trace_id, 16)
            assert span.context.span_id == int(record["span_id"], 16)
            assert span.start_time == record["start_ns"] and span.end_time == record["end_ns"]
            assert span.attributes["xtl.chain"] == record["chain"] and span.attributes["xtl.stage"] == record["stage"]
            assert list(span.attributes["xtl.samples"]) == record["samples"]
            assert span.resource.attributes["service.name"] == "xtl-test"
        assert exported["agent_loop"].parent is None and exported["agent_loop"].attributes["xtl.step"] == 5
        assert exported["math"].parent.span_id == int(records["agent_loop"]["span_id"], 16)
        assert exported["math"].attributes["reward"] == 1.0 and exported["math"].attributes["status"] == "completed"
        assert exported["math"].status.status_code == StatusCode.OK
        assert exported["calculator"].status.status_code == StatusCode.ERROR
        assert exported["calculator"].attributes["error"] == "ValueError"
        assert "xtl.step" not in exported["calculator"].attributes

    def test_a_missing_exporter_names_what_to_install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        hint = "pip install opentelemetry-sdk opentelemetry-exporter-otlp-proto-http"
        try:
            import opentelemetry.sdk.trace.export as sdk_export
        except ImportError:
            sdk_export = None
        monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.http.trace_exporter", None)
        monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace.export", None)  # no SDK
        with pytest.raises(ImportError, match=re.escape(hint)):
            Tracer(None, otlp_endpoint="http://localhost:4318")
        if sdk_export is None:
            pytest.skip("opentelemetry-sdk is not installed")
        monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace.export", sdk_export)
        with pytest.raises(ImportError, match=re.escape(hint)):  # the SDK without the OTLP HTTP exporter
            Tracer(None, otlp_endpoint="http://localhost:4318")
