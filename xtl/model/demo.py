"""A two-minute tour of the model seam on a tiny random Qwen3 (no downloads).

Run ``python -m xtl.model.demo``: it writes a tiny transformers checkpoint, loads it into xtl, checks that xtl's
logits are bitwise equal to transformers' eager model, runs a packed 3-document forward, and exports the model
back to HF safetensors.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

from xtl.model import SequenceContext, get_model_config_from_hf
from xtl.ops import hf_impl


def main() -> None:
    """Run the tour and print what it checked."""
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "hf", Path(tmp) / "export"
        config = Qwen3Config(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
        )
        Qwen3ForCausalLM(config).save_pretrained(src)
        xtl_config = get_model_config_from_hf(src)
        print(f"model_type={xtl_config.model_type} -> {type(xtl_config).__name__}")
        with torch.device("meta"):
            model = xtl_config.build()
        model.from_hf(src)
        reference = AutoModelForCausalLM.from_pretrained(src, attn_implementation="eager").eval()
        ids = torch.randint(0, 256, (1, 32))
        with hf_impl(), torch.no_grad():
            equal = torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)
        print(f"logits bitwise equal to transformers eager: {equal}")
        ctx = SequenceContext.from_lengths(ids, [10, 12, 10])
        with torch.no_grad():
            packed = model(seq_ctx=ctx).logits
            alone = model(input_ids=ids[:, 10:22]).logits
        print(f"packed document 2 vs alone, max |diff| = {(packed[:, 10:22] - alone).abs().max().item():.2e}")
        model.save_hf(out)
        print(f"exported: {sorted(p.name for p in out.iterdir())}")


if __name__ == "__main__":
    main()
