"""``xtl eval`` (:mod:`xtl.tools.eval`): the metrics of lm-eval's ``hf`` model on an xtl export, and its errors."""

from __future__ import annotations

import json
import re

import pytest
import torch
from lm_eval.loggers import EvaluationTracker
from lm_eval.models.huggingface import HFLM
from transformers import AutoTokenizer

from xtl.callbacks.lm_eval_run import EvalSettings, flat_metrics, resolve_tasks, run_lm_eval, write_samples
from xtl.tools.eval import main
from xtl.train.model_spec import resolve_model_config
from xtl.utils import TINY_ASSETS_DIR

# lm-eval's hf model scores each request in one padded forward, xtl packs requests: the same fp32 sums in another
# order. Measured on the export over all 200 tiny_choice documents (800 requests, log-likelihoods -20..-40): at most
# 2.1e-7 relative (7.6e-6 absolute), so an absolute 1e-5 would be nearly spent on sums of this size.
LOGLIKELIHOOD_RTOL = 1e-6

TINY = dict(
    model_type="qwen3", vocab_size=1600, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=True,
)  # fmt: skip


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """A tiny random xtl model exported to an HF directory (fp32) with the tiny tokenizer."""
    path = tmp_path_factory.mktemp("export") / "hf"
    config, _ = resolve_model_config(TINY, None)
    with torch.device("meta"):
        model = config.build()
    model.materialize("cpu")
    torch.manual_seed(3)
    model.init_weights()
    model.save_hf(path, dtype=torch.float32)
    AutoTokenizer.from_pretrained(TINY_ASSETS_DIR).save_pretrained(path)
    return path


class TestEval:
    def test_metrics_equal_lm_eval_hf_on_the_export(self, export, tmp_path, capsys):
        out = tmp_path / "results.json"
        args = ["--model", str(export), "--tasks", "tiny_choice,tiny_exact", "--limit", "10", "--apply-chat-template"]
        assert main([*args, "--batch-size", "4", "--output", str(out)]) == 0
        table = capsys.readouterr().out
        assert "tiny_choice" in table and "exact_match" in table
        got = flat_metrics(json.loads(out.read_text()))
        settings = EvalSettings(tasks=["tiny_choice", "tiny_exact"], limit=10, apply_chat_template=True)
        hf = HFLM(pretrained=str(export), batch_size=4, device="cpu")  # dtype auto, as `lm_eval --model hf`
        want = flat_metrics(run_lm_eval(hf, settings, *resolve_tasks(settings)))
        assert got == want and len(got) == 3

    def test_log_samples_equal_lm_evals_per_sample_logs(self, export, tmp_path, capsys):
        """``--log-samples`` writes what ``lm_eval --model hf --log_samples --output_path`` writes (its
        ``EvaluationTracker`` on lm-eval's own ``hf`` model here): the same files per task beside the results, the
        same records; generations and per-sample metrics equal, log-likelihoods within :data:`LOGLIKELIHOOD_RTOL`."""
        out = tmp_path / "xtl" / "results.json"
        args = ["--model", str(export), "--tasks", "tiny_choice,tiny_exact", "--limit", "20", "--apply-chat-template"]
        assert main([*args, "--batch-size", "4", "--output", str(out), "--log-samples"]) == 0
        assert "samples: " in capsys.readouterr().out
        settings = EvalSettings(tasks=["tiny_choice", "tiny_exact"], limit=20, apply_chat_template=True)
        hf = HFLM(pretrained=str(export), batch_size=4, device="cpu")
        results = run_lm_eval(hf, settings, *resolve_tasks(settings), log_samples=True)
        samples = results.pop("samples")
        tracker = EvaluationTracker(output_path=str(tmp_path / "hf" / "results.json"))  # as lm-eval's CLI saves
        tracker.save_results_aggregated(results=results, samples=samples)
        for task in results["configs"]:
            tracker.save_results_samples(task_name=task, samples=samples[task])

        ours = json.loads(out.read_text())
        assert "samples" not in ours and ours["task_hashes"] == results["task_hashes"]
        files = sorted(p.name for p in out.parent.iterdir())
        assert [re.sub(r"_[^_]+\.jsonl$", "", name) for name in files] == [
            "results.json", "samples_tiny_choice", "samples_tiny_exact"
        ]  # fmt: skip
        for task in ("tiny_choice", "tiny_exact"):
            got, want = _samples(out.parent, task), _samples(tmp_path / "hf", task)
            assert len(got) == len(want) == 20
            for mine, theirs in zip(got, want):
                assert mine.keys() == theirs.keys()
                loglikelihoods = [(mine.pop(k), theirs.pop(k)) for k in ("resps", "filtered_resps")]
                assert mine == theirs  # prompts, targets, hashes, per-sample metrics
                for resp, ref in loglikelihoods:
                    _assert_resps_close(resp, ref)

    def test_log_samples_needs_output(self, export, capsys):
        args = ["--model", str(export), "--tasks", "tiny_choice", "--log-samples"]
        assert main(args) == 2
        err = capsys.readouterr().err
        assert "--log-samples writes the per-sample logs next to the results JSON; pass --output" in err
        assert "Traceback" not in err

    def test_samples_appear_whole_or_not_at_all(self, tmp_path, monkeypatch):
        samples = {task: [_record(task, i) for i in range(3)] for task in ("first", "second")}
        results = {"configs": dict.fromkeys(samples, {})}
        original = EvaluationTracker.save_results_samples

        def fail_on_second(self, task_name, samples):
            original(self, task_name, samples)  # the file is complete in the temporary folder...
            if task_name == "second":
                raise OSError("disk full")  # ...and the rename never happens

        monkeypatch.setattr(EvaluationTracker, "save_results_samples", fail_on_second)
        with pytest.raises(OSError, match="disk full"):
            write_samples(results, samples, tmp_path / "results.json")
        assert [re.sub(r"_[^_]+\.jsonl$", "", p.name) for p in tmp_path.iterdir()] == ["samples_first"]
        assert len(_samples(tmp_path, "first")) == 3

    @pytest.mark.parametrize(
        ("args", "message"),
        [
            (["--model", "/nonexistent", "--tasks", "tiny_choice"], "does not exist"),
            (["--tasks", "missing.yaml"], "--tasks: missing.yaml does not exist"),
            (["--tasks", "tiny_choice", "--batch-size", "0"], "--batch-size must be >= 1"),
            (["--tasks", "tiny_choice", "--template", "nope"], "is not a built-in template"),
        ],
    )
    def test_bad_input_exits_2(self, export, args, message, capsys):
        if "--model" not in args:
            args = ["--model", str(export), *args]
        assert main(args) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err


def _samples(folder, task: str) -> list[dict]:
    """The records of ``samples_<task>_<date>.jsonl`` in ``folder`` (exactly one such file)."""
    (path,) = folder.glob(f"samples_{task}_*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def _assert_resps_close(got, want) -> None:
    """Nested responses equal, log-likelihoods (numbers written as text) within :data:`LOGLIKELIHOOD_RTOL`."""
    if isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), (got, want)
        for mine, theirs in zip(got, want):
            _assert_resps_close(mine, theirs)
        return
    try:
        number = float(want)
    except ValueError:  # a greedy flag or a generated text
        assert got == want
        return
    assert float(got) == pytest.approx(number, rel=LOGLIKELIHOOD_RTOL, abs=0), (got, want)


def _record(task: str, index: int) -> dict:
    """A per-sample record as lm-eval's evaluator returns it (the fields its sample writer reads)."""
    return {
        "doc_id": index, "doc": {"q": f"{task} {index}"}, "target": 1, "arguments": [("context", " answer")],
        "resps": [[(-1.5, False)]], "filtered_resps": [(-1.5, False)], "doc_hash": "d", "prompt_hash": "p",
        "target_hash": "t",
    }  # fmt: skip
