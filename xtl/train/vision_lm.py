"""LightningModules of vision-language models (Qwen3-VL, Qwen3-VL-MoE): freezing and per-part learning rates.

A packed micro-batch carries its images in ``seq_ctx.extras`` (:mod:`xtl.data.multimodal`), so the training,
validation and test steps of :class:`~xtl.train.base.LanguageModule` run unchanged. The model's ``shard_units()``
hold the vision blocks and the decoder layers, so FSDP shards both; ``HFExport`` / ``save_hf`` write the
transformers layout (``model.visual.*``, ``model.language_model.*``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from xtl.errors import ConfigError
from xtl.train.base import LanguageModule
from xtl.train.moe_causal_lm import MoECausalLM
from xtl.train.optim import param_groups

PARTS = ("vision", "merger", "language")
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def part_of(name: str) -> str:
    """Which part a parameter belongs to: ``vision`` (tower), ``merger`` (patch mergers) or ``language``.

    Args:
        name: Parameter name in the xtl model (wrapper prefixes of checkpointing / compile are ignored).

    Returns:
        str: One of :data:`PARTS`.
    """
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    if name.startswith("visual."):
        return "merger" if name.startswith(("visual.merger.", "visual.deepstack_merger_list.")) else "vision"
    return "language"


class VisionLM(LanguageModule):
    """Trains a vision-language model: the :class:`LanguageModule` step on packs with images.

    Args:
        freeze_vision: Freeze the vision tower (patch embedding, position embedding, blocks).
        freeze_merger: Freeze the patch merger and the DeepStack mergers.
        freeze_language: Freeze the language model (embedding, layers, head).
        vision_lr_scale: Learning rate of the vision tower relative to ``optimizer.lr``.
        merger_lr_scale: Learning rate of the mergers relative to ``optimizer.lr``.
        language_lr_scale: Learning rate of the language model relative to ``optimizer.lr``.
        *args: :class:`LanguageModule` arguments.
        **kwargs: :class:`LanguageModule` arguments.
    """

    trains_vision = True

    def __init__(
        self,
        *args: Any,
        freeze_vision: bool = False,
        freeze_merger: bool = False,
        freeze_language: bool = False,
        vision_lr_scale: float = 1.0,
        merger_lr_scale: float = 1.0,
        language_lr_scale: float = 1.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.save_hyperparameters()
        self.frozen = {"vision": freeze_vision, "merger": freeze_merger, "language": freeze_language}
        if all(self.frozen.values()):
            raise ConfigError("freeze_vision, freeze_merger and freeze_language are all true: nothing to train")
        self.lr_scales = {"vision": vision_lr_scale, "merger": merger_lr_scale, "language": language_lr_scale}
        for part, scale in self.lr_scales.items():
            if not scale > 0:
                raise ConfigError(f"{part}_lr_scale must be > 0, got {scale} (freeze the part instead)")

    def configure_model(self) -> None:
        """Build and parallelize the model, then freeze the configured parts (``requires_grad=False``)."""
        if self.model is not None:
            return
        super().configure_model()
        for name, param in self.model.named_parameters():
            if self.frozen[part_of(name)]:
                param.requires_grad_(False)

    def configure_optimizers(self) -> dict[str, Any]:
        """As :meth:`LanguageModule.configure_optimizers`, with one parameter group per (part, weight decay)."""
        cfg = self.optimizer_config
        owner = {id(p): part_of(n) for n, p in self.model.named_parameters()}
        groups = []
        for group in param_groups(self.model, cfg.weight_decay, cfg.no_decay_norm_bias_embed):
            for part in PARTS:
                params = [p for p in group["params"] if owner[id(p)] == part]
                if params:
                    groups.append({**group, "params": params, "lr": cfg.lr * self.lr_scales[part], "name": part})
        optimizer = cfg.create(groups, self.device)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self.schedule.lr_lambda(self._total_steps()))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def trainable_parameters(self) -> dict[str, int]:
        """Trainable parameter count per part (after :meth:`configure_model`)."""
        counts = dict.fromkeys(PARTS, 0)
        for name, param in self.model.named_parameters():
            if param.requires_grad:
                counts[part_of(name)] += param.numel()
        return counts


class VisionMoELM(VisionLM, MoECausalLM):
    """:class:`VisionLM` for an MoE language model (Qwen3-VL-MoE): adds :class:`MoECausalLM`'s router losses.

    Args:
        router_bias_update_lr: Must stay 0: Qwen3-VL-MoE routers have no correction bias.
        *args: :class:`VisionLM` and :class:`MoECausalLM` arguments.
        **kwargs: :class:`VisionLM` and :class:`MoECausalLM` arguments.
    """

    def __init__(self, *args: Any, router_bias_update_lr: float = 0.0, **kwargs: Any) -> None:
        if router_bias_update_lr:
            raise ConfigError(
                "router_bias_update_lr: Qwen3-VL-MoE routers have no correction bias (aux-loss-free update); keep 0"
            )
        super().__init__(*args, router_bias_update_lr=0.0, **kwargs)


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
