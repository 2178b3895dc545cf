"""``xtl check-parity``: exit 0 with the per-layer table on tiny checkpoints of every family, exit 1 naming the
first diverging layer for each injected fault, exit 2 on usage errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from tests.conftest import TINY, build_tiny_hf
from tests.model.test_moe_parity import build_tiny_moe
from tests.model.test_parity import router_top_k_plus_one, swap_q_and_k_keys, wrong_norm_eps, wrong_rope_theta
from xtl.command import main
from xtl.model import parity
from xtl.tools import TOOLS, check_parity
from xtl.utils import TINY_ASSETS_DIR


def _build_mha_llama() -> PreTrainedModel:
    """A tiny llama whose q and k projections have the same shape (heads == kv heads)."""
    torch.manual_seed(0)
    config = LlamaConfig(**{**TINY, "num_key_value_heads": TINY["num_attention_heads"]})
    return LlamaForCausalLM(config).eval()


def _build_text_llama() -> PreTrainedModel:
    """A tiny llama with the vocabulary of the embedded tiny tokenizer."""
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**TINY, "vocab_size": 1600})).eval()


BUILDERS = {
    "llama": lambda: build_tiny_hf("llama"),
    "qwen3": lambda: build_tiny_hf("qwen3"),
    "qwen3_moe": lambda: build_tiny_moe("qwen3_moe"),
    "deepseek_v3": lambda: build_tiny_moe("deepseek_v3"),
    "gpt_oss": lambda: build_tiny_moe("gpt_oss"),
    "llama_mha": _build_mha_llama,
    "llama_text": _build_text_llama,
}
FAST = ["--max-tokens", "48"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory):
    """Factory ``hf_dir(name) -> Path``: a tiny checkpoint saved by transformers (once per module)."""
    cache: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in cache:
            cache[name] = tmp_path_factory.mktemp(name)
            BUILDERS[name]().save_pretrained(cache[name])
        return cache[name]

    return make


def _run(args: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    code = main(["check-parity", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


class TestCheckParity:
    @pytest.mark.parametrize(
        "family",
        [
            "llama",
            "qwen3",
            "qwen3_moe",
            "deepseek_v3",
            "gpt_oss",
        ],
    )
    def test_a_correct_checkpoint_passes_with_the_per_layer_table(self, family, hf_dir, capsys):
        code, out, _ = _run([str(hf_dir(family)), *FAST], capsys)
        assert code == 0, out
        assert "mode hf_impl, float32, tolerance bitwise" in out
        for row in ["embed", "layer 0", "layer 1", "norm", "logits", "loss", "grad layers.0.", "grad layers.1."]:
            assert f"\n{row}" in out
        assert out.rstrip().endswith("PASSED")

    def test_gpt_oss_is_bitwise_in_bfloat16(self, hf_dir, capsys):
        code, out, _ = _run([str(hf_dir("gpt_oss")), *FAST, "--dtype", "bfloat16"], capsys)
        assert code == 0, out
        assert "bfloat16" in out and out.rstrip().endswith("PASSED")

    @pytest.mark.parametrize(
        "fault,family,layer",
        [
            (swap_q_and_k_keys, "llama_mha", "layer 0"),
            (wrong_rope_theta, "llama", "layer 0"),
            (wrong_norm_eps, "qwen3", "layer 0"),
            (router_top_k_plus_one, "qwen3_moe", "layer 1"),  # layer 0 is dense (mlp_only_layers)
        ],
        ids=lambda v: v.__name__ if callable(v) else None,
    )
    def test_an_injected_fault_exits_1_naming_the_first_diverging_layer(
        self, fault, family, layer, hf_dir, capsys, monkeypatch
    ):
        path = hf_dir(family)  # saved before the fault: the checkpoint itself is correct
        fault(monkeypatch)
        code, out, _ = _run([str(path), *FAST, "--no-grads"], capsys)
        assert code == 1, out
        assert out.rstrip().endswith(f"FAILED: first diverging layer: {layer}")
        rows = {line.split("  ")[0]: line for line in out.splitlines()}
        assert rows[layer].endswith("FAIL") and rows["embed"].endswith("equal")

    def test_json_output(self, hf_dir, capsys):
        code, out, _ = _run([str(hf_dir("qwen3_moe")), *FAST, "--format", "json", "--mode", "fast"], capsys)
        assert code == 0
        report = json.loads(out)
        assert report["ok"] and report["mode"] == "fast" and report["tolerance"]["name"] == "fp32"
        assert [row["name"] for row in report["rows"][:3]] == ["embed", "layer 0", "layer 1"]
        assert set(report["metrics"]) == {
            "parity/max_abs_logits",
            "parity/max_rel_grad",
            "parity/loss_abs_diff",
            "parity/ok",
        }

    def test_random_alias_and_max_layers(self, capsys):
        code, out, err = _run(
            ["qwen3-0.6b", "--random", "--max-layers", "1", "--max-tokens", "12", "--no-grads"], capsys
        )
        assert code == 0, out
        assert "1/1 layers" in out and "\nlayer 0" in out and "\nlayer 1" not in out
        assert "the model is cut to its first 1 of 28 decoder layers" in out
        # random weights: the vocabulary is cut too, so a large model's embedding and head do not fill the RAM
        assert "its vocabulary to 4096 tokens (random weights)" in out
        assert "[transformers]" not in out + err, "no special-token id is left beyond the cut vocabulary"

    def test_documents_of_a_text_file(self, hf_dir, tmp_path, capsys):
        path = hf_dir("llama_text")
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(TINY_ASSETS_DIR / name, path / name)
        text = tmp_path / "docs.txt"
        text.write_text("What is 12 + 30?\nIt is 42.\n\n  \nReverse 'abc': cba\n")
        code, out, _ = _run([str(path), "--text", str(text), "--format", "json"], capsys)
        assert code == 0, out
        assert json.loads(out)["documents"] == 2

    def test_usage_errors_exit_2(self, hf_dir, tmp_path, capsys):
        llama = str(hf_dir("llama"))
        text = tmp_path / "t.txt"
        text.write_text("hello")
        cases = [
            (["qwen3-0.6b"], "an alias needs --random"),
            (["no-such-model", "--random"], "unknown model alias"),
            ([llama, "--text", str(text)], "no tokenizer in"),
            ([llama, "--text", str(text), "--tokenizer", str(TINY_ASSETS_DIR)], "vocab_size 160"),
            ([llama, "--grad-params", "nothing.*"], "matches no trainable parameter"),
            ([llama, "--max-tokens", "0"], "must be >= 1"),
            ([llama, "--mode", "eager"], "invalid choice"),
        ]
        for args, message in cases:
            code, _, err = _run(args, capsys)
            assert code == 2, args
            assert message in err, (args, err)

    def test_registered_and_choices_match_the_engine(self):
        assert "check-parity" in TOOLS
        assert check_parity.MODES == parity.PARITY_MODES
        assert check_parity.TOLERANCE_CHOICES == ("auto", *parity.TOLERANCES)
