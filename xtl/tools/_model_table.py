"""Published HF ``config.json`` dimensions of the models ``xtl memory`` knows by alias.

Only the fields the estimator reads are kept, under their HF names, so a table entry and a real ``config.json``
go through the same code path. Values are copied from the official Hugging Face repositories named in ``SOURCES``.
"""

from __future__ import annotations

import json
from pathlib import Path

from xtl.tools._cli import ToolInputError


def _qwen3(h: int, inter: int, layers: int, heads: int, kv: int, tie: bool) -> dict:
    return {
        "model_type": "qwen3", "vocab_size": 151936, "hidden_size": h, "intermediate_size": inter,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": 128,
        "tie_word_embeddings": tie, "attention_bias": False,
    }  # fmt: skip


def _qwen3_moe(h: int, layers: int, heads: int, moe_inter: int) -> dict:
    return {
        "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": h, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": 4, "head_dim": 128, "tie_word_embeddings": False,
        "attention_bias": False, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": moe_inter,
    }  # fmt: skip


def _llama(h: int, inter: int, layers: int, heads: int) -> dict:
    return {
        "model_type": "llama", "vocab_size": 128256, "hidden_size": h, "intermediate_size": inter,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": 8,
        "tie_word_embeddings": False, "attention_bias": False,
    }  # fmt: skip


def _gpt_oss(layers: int, experts: int) -> dict:
    return {
        "model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880,
        "num_hidden_layers": layers, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
        "tie_word_embeddings": False, "attention_bias": True, "num_local_experts": experts,
        "num_experts_per_tok": 4,
    }  # fmt: skip


MODEL_TABLE: dict[str, dict] = {
    "qwen3-0.6b": _qwen3(1024, 3072, 28, 16, 8, True),
    "qwen3-1.7b": _qwen3(2048, 6144, 28, 16, 8, True),
    "qwen3-4b": _qwen3(2560, 9728, 36, 32, 8, True),
    "qwen3-8b": _qwen3(4096, 12288, 36, 32, 8, False),
    "qwen3-14b": _qwen3(5120, 17408, 40, 40, 8, False),
    "qwen3-32b": _qwen3(5120, 25600, 64, 64, 8, False),
    "qwen3-30b-a3b": _qwen3_moe(2048, 48, 32, 768),
    "qwen3-235b-a22b": _qwen3_moe(4096, 94, 64, 1536),
    "llama-3.1-8b": _llama(4096, 14336, 32, 32),
    "llama-3.1-70b": _llama(8192, 28672, 80, 64),
    "deepseek-v3": {
        "model_type": "deepseek_v3",
        "vocab_size": 129280,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "first_k_dense_replace": 3,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "n_shared_experts": 1,
        "n_routed_experts": 256,
        "num_experts_per_tok": 8,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "tie_word_embeddings": False,
        "attention_bias": False,
    },  # fmt: skip
    "gpt-oss-20b": _gpt_oss(24, 32),
    "gpt-oss-120b": _gpt_oss(36, 128),
}

SOURCES = {
    "qwen3-*": "https://huggingface.co/Qwen/Qwen3-{0.6B,1.7B,4B,8B,14B,32B,30B-A3B,235B-A22B}/blob/main/config.json",
    "llama-3.1-*": "https://huggingface.co/meta-llama/Llama-3.1-{8B,70B}/blob/main/config.json",
    "deepseek-v3": "https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json",
    "gpt-oss-*": "https://huggingface.co/openai/gpt-oss-{20b,120b}/blob/main/config.json",
}


def normalize_alias(alias: str) -> str:
    """Normalize an alias the way ``xtl.model`` does: lower case, ``-`` and ``_`` dropped.

    Args:
        alias (str): e.g. ``"Qwen3_8B"`` or ``"DeepSeek-V3-671B"``.

    Returns:
        str: e.g. ``"qwen38b"``; the ``-671b`` size suffix of DeepSeek-V3 is dropped.
    """
    key = alias.strip().lower().replace("-", "").replace("_", "")
    return key.removesuffix("671b") if key.startswith("deepseekv3") else key


def resolve_model(spec: str) -> tuple[str, dict]:
    """Turn a ``config.json`` path, a directory holding one, or an alias into ``(name, hf_config_dict)``.

    For an alias, ``xtl.model.get_model_config(alias).hf_config.to_dict()`` is preferred when ``xtl.model``
    provides it; otherwise the built-in :data:`MODEL_TABLE` entry is used.

    Args:
        spec (str): Path or alias.

    Returns:
        tuple[str, dict]: Display name and HF config fields.
    """
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            return path.parent.name or str(path), json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ToolInputError(f"{path} is not valid JSON: {exc}") from exc
    from_xtl = _from_xtl_model(spec)
    if from_xtl is not None:
        return spec, from_xtl
    table = {normalize_alias(name): name for name in MODEL_TABLE}
    key = table.get(normalize_alias(spec))
    if key is None:
        raise ToolInputError(f"{spec!r} is neither a config.json path nor a known alias ({', '.join(MODEL_TABLE)})")
    return key, dict(MODEL_TABLE[key])


def _from_xtl_model(alias: str) -> dict | None:
    try:
        from xtl.model import get_model_config

        return get_model_config(alias).hf_config.to_dict()
    except (ImportError, KeyError, AttributeError):
        return None
