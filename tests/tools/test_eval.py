"""``xtl eval`` (:mod:`xtl.tools.eval`): the metrics of lm-eval's ``hf`` model on an xtl export, and its errors."""

from __future__ import annotations

import json

import pytest
import torch
from lm_eval.models.huggingface import HFLM
from transformers import AutoTokenizer

from xtl.callbacks.lm_eval_run import EvalSettings, flat_metrics, resolve_tasks, run_lm_eval
from xtl.tools.eval import main
from xtl.train.model_spec import resolve_model_config
from xtl.utils import TINY_ASSETS_DIR

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
