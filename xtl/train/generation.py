"""Greedy decoding with an xtl model (no KV cache: for evaluation of small models and short answers)."""

from __future__ import annotations

import torch

from xtl.model import BaseModel


@torch.no_grad()
def greedy_generate(
    model: BaseModel, prompt_ids: list[int], max_new_tokens: int, stop_ids: set[int] | None = None
) -> list[int]:
    """Append up to ``max_new_tokens`` argmax tokens to ``prompt_ids``; stop after a token in ``stop_ids``.

    Returns:
        The generated ids (without the prompt, including the stop token if reached).
    """
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids], device=device)
    generated: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(input_ids=ids).logits
        if hasattr(logits, "full_tensor"):
            logits = logits.full_tensor()
        token = int(logits[0, -1].argmax())
        generated.append(token)
        if stop_ids and token in stop_ids:
            break
        ids = torch.cat([ids, torch.tensor([[token]], device=device)], dim=1)
    return generated
