"""Embedded tiny assets: present, small, loadable, checkable, and reproducible by the generator script."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from transformers import AutoTokenizer

from xtl.data import ChatTokenizeFn, tiny_assets_dir

FILES = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "sft_train.jsonl", "sft_eval.jsonl"]
REPO = Path(__file__).resolve().parents[2]


class TestTinyAssets:
    def test_files_and_size(self):
        root = tiny_assets_dir()
        for name in FILES + ["pretrain.jsonl"]:
            assert (root / name).is_file(), name
        assert sum(p.stat().st_size for p in root.iterdir()) < 3_000_000

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
            if m := re.fullmatch(r"What is (\d+)([+-])(\d+)\?", prompt):
                a, op, b = int(m[1]), m[2], int(m[3])
                assert int(answer) == (a + b if op == "+" else a - b)
            elif m := re.fullmatch(r"What number comes after (\d+)\?", prompt):
                assert int(answer) == int(m[1]) + 1
            elif prompt.startswith("Repeat: "):
                assert answer == prompt.removeprefix("Repeat: ")
            elif prompt.startswith("How many words: "):
                assert int(answer) == len(prompt.removeprefix("How many words: ").split())
            elif prompt.startswith("Uppercase: "):
                assert answer == prompt.removeprefix("Uppercase: ").upper()
            else:
                raise AssertionError(f"unknown task prompt {prompt!r}")

    def test_generator_reproduces_committed_files(self, tmp_path):
        script = REPO / "scripts" / "make_tiny_assets.py"
        subprocess.run([sys.executable, str(script), "--out", str(tmp_path)], check=True, capture_output=True)
        for name in FILES + ["pretrain.jsonl"]:
            assert (tmp_path / name).read_bytes() == (tiny_assets_dir() / name).read_bytes(), name
