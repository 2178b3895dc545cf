"""Greedy answers of a vision-language model to chat prompts with images (a short check after finetuning)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn


@torch.no_grad()
def answer_images(
    model: nn.Module,
    tokenizer: Any,
    rows: list[dict[str, Any]],
    image_processor: Any,
    image_root: str | Path,
    template: str = "chatml",
    max_new_tokens: int = 8,
) -> list[str]:
    """Greedy answers of a vision-language model to chat prompts with images (no KV cache; short answers).

    Args:
        model: An xtl ``Qwen3VL`` (HF-style call with ``pixel_values`` / ``image_grid_thw``).
        tokenizer: The tokenizer with the vision tokens.
        rows: Records ``{"messages": [...]}``; a trailing assistant turn (the reference) is dropped.
        image_processor: :class:`xtl.data.multimodal.ImageProcessorConfig` or its fields.
        image_root: Folder of relative image paths.
        template: Chat template.
        max_new_tokens: Decoding limit.

    Returns:
        list[str]: The decoded answers (special tokens removed, stripped).
    """
    from xtl.data.multimodal import ImageProcessorConfig, VisionChatTokenizeFn, load_image

    settings = ImageProcessorConfig.from_any(image_processor)
    fn = VisionChatTokenizeFn(tokenizer, settings, image_root=image_root, template=template)
    processor = settings.build()
    stops = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
    device = next(model.parameters()).device
    answers = []
    for i, row in enumerate(rows):
        messages = row["messages"]
        if messages and messages[-1].get("role") == "assistant":
            messages = messages[:-1]
        prompt = {"messages": messages}
        item = fn.encode(prompt, f"<row {i}>", add_generation_prompt=True)
        refs = fn.image_index(prompt, f"<row {i}>").images
        kwargs: dict[str, torch.Tensor] = {}
        if refs:
            out = processor(images=[load_image(r.path, f"<row {i}>") for r in refs], return_tensors="pt")
            kwargs = {"pixel_values": out["pixel_values"].to(device), "image_grid_thw": out["image_grid_thw"]}
        ids = torch.tensor([item["input_ids"]], device=device)
        new: list[int] = []
        for _ in range(max_new_tokens):
            logits = model(input_ids=ids, **kwargs).logits
            token = int(logits[0, -1].argmax())
            if token in stops:
                break
            new.append(token)
            ids = torch.cat([ids, torch.tensor([[token]], device=device)], dim=1)
        answers.append(tokenizer.decode(new, skip_special_tokens=True).strip())
    return answers
