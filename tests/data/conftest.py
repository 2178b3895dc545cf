"""Shared fixtures for the data tests: tokenizers trained locally (no hub) and small JSONL corpora."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from xtl.data.tiny import (
    LLAMA3_SPECIAL_TOKENS,
    QWEN3_ADDED_TOKENS,
    QWEN3_SPECIAL_TOKENS,
    build_bpe_tokenizer,
)

FIXTURES = Path(__file__).parent / "fixtures"

CORPUS = [
    "The quick brown fox jumps over the lazy dog. What is 37+45? The answer is 82.",
    "Reverse the string hello -> olleh. Uppercase: HELLO WORLD.",
    "你好，世界！Ünïcödé façade naïve café — emoji 🙂 and math ∑ x² ≤ 10.",
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    "system user assistant tool response function parameters description type object string",
    "def add(a, b):\n    return a + b\n\n# comment\n\tindented\n",
]


def _corpus() -> list[str]:
    return CORPUS * 20


@pytest.fixture(scope="session")
def qwen_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder of a byte-level BPE with the Qwen3 special tokens and the real Qwen3 chat template."""
    tok = build_bpe_tokenizer(
        _corpus(),
        vocab_size=600,
        special_tokens=QWEN3_SPECIAL_TOKENS,
        added_tokens=QWEN3_ADDED_TOKENS,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=(FIXTURES / "qwen3.jinja").read_text(),
    )
    path = tmp_path_factory.mktemp("qwen_tok")
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def qwen_tokenizer(qwen_tokenizer_dir: Path):
    """The Qwen-style test tokenizer, loaded through ``AutoTokenizer``."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen_tokenizer_dir)


@pytest.fixture(scope="session")
def llama_tokenizer(tmp_path_factory: pytest.TempPathFactory):
    """A byte-level BPE with the Llama 3 special tokens and the real Llama 3.2 chat template."""
    from transformers import AutoTokenizer

    tok = build_bpe_tokenizer(
        _corpus(),
        vocab_size=600,
        special_tokens=LLAMA3_SPECIAL_TOKENS,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        pad_token="<|end_of_text|>",
        chat_template=(FIXTURES / "llama3.2.jinja").read_text(),
    )
    path = tmp_path_factory.mktemp("llama_tok")
    tok.save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def write_jsonl(path: Path, records: list) -> Path:
    """Write one JSON value per line."""
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return path


def sft_records(n: int, seed: int = 0) -> list[dict]:
    """Chat samples of varied length (some multi-turn, some with system prompts)."""
    import random

    rng = random.Random(seed)
    records = []
    for i in range(n):
        messages = [{"role": "system", "content": "Be brief."}] if i % 3 == 0 else []
        for turn in range(1 + i % 3):
            words = " ".join(rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(rng.randint(1, 40)))
            messages += [
                {"role": "user", "content": f"Question {i}.{turn}: {words}?"},
                {"role": "assistant", "content": f"Answer {i}.{turn}: {words[::-1]}"},
            ]
        records.append({"messages": messages})
    return records
