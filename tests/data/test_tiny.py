"""Embedded tiny assets: present, small, loadable, checkable, and reproducible by the generator script."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from transformers import AutoTokenizer

from xtl.data import ChatTokenizeFn, tiny_assets_dir

FILES = [
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "sft_train.jsonl",
    "sft_eval.jsonl",
    "preference_train.jsonl",
    "preference_eval.jsonl",
]
REPO = Path(__file__).resolve().parents[2]


def _rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (tiny_assets_dir() / name).read_text().splitlines()]


def _expected(prompt: str) -> str:
    """The correct answer to a tiny-task prompt, computed from the prompt."""
    if m := re.fullmatch(r"What is (\d+)([+-])(\d+)\?", prompt):
        a, op, b = int(m[1]), m[2], int(m[3])
        return str(a + b if op == "+" else a - b)
    if m := re.fullmatch(r"What number comes after (\d+)\?", prompt):
        return str(int(m[1]) + 1)
    if prompt.startswith("Repeat: "):
        return prompt.removeprefix("Repeat: ")
    if prompt.startswith("How many words: "):
        return str(len(prompt.removeprefix("How many words: ").split()))
    if prompt.startswith("Uppercase: "):
        return prompt.removeprefix("Uppercase: ").upper()
    raise AssertionError(f"unknown task prompt {prompt!r}")


class TestTinyAssets:
    def test_files_and_size(self):
        root = tiny_assets_dir()
        for name in FILES + ["pretrain.jsonl"]:
            assert (root / name).is_file(), name
        assert sum(p.stat().st_size for p in root.iterdir()) < 4_200_000  # 1.1 MB of it: the KTO rows

    def test_tokenizer_loads_with_qwen3_tokens_and_template(self):
        tok = AutoTokenizer.from_pretrained(tiny_assets_dir())
        assert 1000 <= len(tok) <= 2100
        vocab = tok.get_added_vocab()
        for token in ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>"]:
            assert token in vocab
        assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
        row = json.loads((tiny_assets_dir() / "sft_train.jsonl").read_text().splitlines()[0])
        item = ChatTokenizeFn(tok, template="qwen3")(row)[0]
        assert item["input_ids"] == list(tok.apply_chat_template(row["messages"])["input_ids"])

    def test_eval_answers_are_checkable_and_held_out(self):
        root = tiny_assets_dir()
        evals = [json.loads(line) for line in (root / "sft_eval.jsonl").read_text().splitlines()]
        train_prompts = {
            json.loads(line)["messages"][-2]["content"] for line in (root / "sft_train.jsonl").read_text().splitlines()
        }
        assert len(train_prompts) > 3000 and len(evals) >= 100
        for record in evals:
            prompt, answer = record["messages"][0]["content"], record["answer"]
            assert prompt not in train_prompts and record["messages"][-1]["content"] == answer
            assert answer == _expected(prompt)

    def test_preference_pairs_follow_the_sft_rows(self):
        for split, size in (("train", 6000), ("eval", 200)):
            sft, pairs = _rows(f"sft_{split}.jsonl"), _rows(f"preference_{split}.jsonl")
            assert len(pairs) == len(sft) == size
            for record, pair in zip(sft, pairs):
                assert set(pair) == {"prompt", "chosen", "rejected"}
                assert pair["prompt"] == record["messages"][:-1] and pair["chosen"] == record["messages"][-1:]
                (rejected,) = pair["rejected"]
                assert rejected["role"] == "assistant"
                assert pair["chosen"][0]["content"] == _expected(pair["prompt"][-1]["content"])
                assert rejected["content"] != _expected(pair["prompt"][-1]["content"])

    def test_generator_reproduces_committed_files(self, tmp_path):
        script = REPO / "scripts" / "make_tiny_assets.py"
        subprocess.run([sys.executable, str(script), "--out", str(tmp_path)], check=True, capture_output=True)
        for name in FILES + ["pretrain.jsonl"]:
            assert (tmp_path / name).read_bytes() == (tiny_assets_dir() / name).read_bytes(), name
