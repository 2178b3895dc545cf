"""``xtl check-parity``: exit 0 with the per-layer table on tiny checkpoints of every family (vision-language ones
with their vision rows), exit 1 naming the first diverging layer for each injected fault, exit 2 on usage errors.

Tolerance: ``bitwise`` (``hf_impl`` mode, fp32) unless a test says otherwise; the injected weight fault is a 1e-6
relative change, which only a bitwise check sees.
"""

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
from tests.model.test_parity_vlm import VISION_ROWS
from tests.model.vlm import IMAGE, VARIANTS, build_tiny_vlm
from xtl.command import main
from xtl.model import parity
from xtl.model.compose.qwen3_vl import Qwen3VL
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
    **{variant: (lambda variant=variant: build_tiny_vlm(variant)) for variant in VARIANTS},
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


def _vlm_config_dir(path: Path, variant: str, vocab_size: int, placeholders: list[int]) -> Path:
    """A directory holding only the ``config.json`` of the tiny VLM (enough for ``--random``), with ``vocab_size``
    and the image, video, vision-start and vision-end ids ``placeholders``."""
    config = build_tiny_vlm(variant).config
    config.text_config.vocab_size = vocab_size
    for key, value in zip(
        ["image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"], placeholders
    ):
        setattr(config, key, value)
    config.save_pretrained(path)
    return path


def perturb_a_loaded_vision_weight(monkeypatch: pytest.MonkeyPatch) -> None:
    """A loading fault on xtl's side only: vision block 1's ``linear_fc2`` weight is off by 1e-6 relative."""
    from_hf = Qwen3VL.from_hf

    def faulty(self: Qwen3VL, *args, **kwargs) -> list[str]:  # noqa: ANN002, ANN003
        missing = from_hf(self, *args, **kwargs)
        with torch.no_grad():
            self.visual.blocks[1].mlp.linear_fc2.weight.mul_(1 + 1e-6)
        return missing

    monkeypatch.setattr(Qwen3VL, "from_hf", faulty)


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


@pytest.mark.parametrize("variant", VARIANTS)
class TestCheckParityVLM:
    """Qwen3-VL and Qwen3-VL-MoE directories: transformers' image-text-to-text class as the reference, a probe image
    added to the generated text documents."""

    def test_a_correct_checkpoint_passes_with_vision_rows(self, variant, hf_dir, capsys):
        code, out, _ = _run([str(hf_dir(variant)), *FAST, "--format", "json"], capsys)
        report = json.loads(out)
        assert code == 0 and report["ok"], out
        names = [row["name"] for row in report["rows"]]
        assert names[:10] == [*VISION_ROWS, "embed", "layer 0", "layer 1", "layer 2"]
        assert {"norm", "logits", "loss", "grad visual.blocks.0.attn.qkv.weight"} <= set(names)
        assert "grad visual.merger.linear_fc2.weight" in names and "grad language_model.lm_head.weight" in names
        assert all(row["exact"] for row in report["rows"]) and report["tolerance"]["name"] == "bitwise"
        assert report["images"] == 1 and report["documents"] == 3 and "probe document" in report["notes"][0]

    def test_a_perturbed_vision_weight_exits_1_naming_its_block(self, variant, hf_dir, capsys, monkeypatch):
        path = hf_dir(variant)  # saved before the fault: the checkpoint itself is correct
        perturb_a_loaded_vision_weight(monkeypatch)
        code, out, _ = _run([str(path), *FAST, "--no-grads"], capsys)
        assert code == 1, out
        assert out.rstrip().endswith("FAILED: first diverging layer: vision block 1")
        rows = {line.split("  ")[0]: line for line in out.splitlines()}
        assert rows["vision patch_embed"].endswith("equal") and rows["vision block 0"].endswith("equal")
        assert rows["vision block 1"].endswith("FAIL")

    def test_fast_mode_generated_ids_avoid_the_placeholders(self, variant, hf_dir, capsys):
        """Seed 1 draws the image id 150 among 48 ids of a 160-token vocabulary: a stray placeholder in the packed
        batch would leave xtl with 7 placeholders for the probe image's 6 features."""
        assert IMAGE in torch.cat(parity.ParityDocuments.random(160, 48, 2, seed=1).input_ids)  # the precondition
        code, out, err = _run([str(hf_dir(variant)), *FAST, "--seed", "1", "--mode", "fast", "--no-grads"], capsys)
        assert code == 0, out + err
        assert "mode fast, float32, tolerance fp32" in out and "\nvision block 1" in out

    def test_max_layers_cuts_the_language_model_only(self, variant, hf_dir, capsys):
        """One decoder layer, two DeepStack features: the second has no layer to go to, on both sides."""
        code, out, _ = _run([str(hf_dir(variant)), *FAST, "--max-layers", "1"], capsys)
        assert code == 0, out
        names = [line.split("  ")[0] for line in out.splitlines()[2:]]
        assert names[:9] == [*VISION_ROWS, "embed", "layer 0", "norm"] and "layer 1" not in names
        assert "grad visual.blocks.0.attn.qkv.weight" in names and "grad language_model.layers.0.mlp" in out
        assert "the model is cut to its first 1 of 3 decoder layers (both sides)\n" in out

    def test_random_weights_cut_the_vocabulary_and_keep_the_placeholders(self, variant, tmp_path, capsys):
        """Placeholder ids beyond the cut vocabulary of 4096 move into it (else the probe image's ids overflow)."""
        path = _vlm_config_dir(tmp_path, variant, 5000, [4990, 4991, 4992, 4993])
        code, out, _ = _run([str(path), "--random", "--max-layers", "2", *FAST, "--no-grads"], capsys)
        assert code == 0, out
        assert "\nvision merger" in out and "\nlogits" in out and "1 images; 2/2 layers" in out
        assert "first 2 of 3 decoder layers (both sides), its vocabulary to 4096 tokens (random weights)" in out

    def test_documents_of_a_text_file_get_a_probe_image(self, variant, tmp_path, capsys):
        text = tmp_path / "docs.txt"
        text.write_text("What is 12 + 30?\nIt is 42.\n\nReverse 'abc': cba\n")
        tokenizer = ["--tokenizer", str(TINY_ASSETS_DIR)]
        path = _vlm_config_dir(tmp_path / "ok", variant, 1600, [1596, 1597, 1598, 1599])
        code, out, _ = _run([str(path), "--random", "--text", str(text), *tokenizer, "--format", "json"], capsys)
        report = json.loads(out)
        assert code == 0 and report["documents"] == 3 and report["images"] == 1, out
        assert [row["name"] for row in report["rows"][:6]] == VISION_ROWS
        what = 327  # the tiny tokenizer's id of "What": a placeholder in this config, and the check has no image
        path = _vlm_config_dir(tmp_path / "placeholder", variant, 1600, [what, 1597, 1598, 1599])
        code, _, err = _run([str(path), "--random", "--text", str(text), *tokenizer], capsys)
        assert code == 2 and "holds image or video placeholders (ids [327, 1597])" in err, err
        assert "Traceback" not in err
