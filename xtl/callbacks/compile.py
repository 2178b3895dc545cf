"""Compile: ``torch.compile`` each decoder layer (and the model's head loss) in place."""

from __future__ import annotations

from typing import Any, Literal

import lightning.pytorch as pl
import torch
from torch import nn

from xtl.callbacks._run import run_datamodule
from xtl.model import BaseModel
from xtl.strategies.parallelize import ModelTransform, TransformStage

CompileMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
MODES: tuple[str, ...] = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


class Compile(pl.Callback, ModelTransform):
    """``torch.compile`` every decoder layer in place (stage ``COMPILE``, after checkpointing and offload).

    ``nn.Module.compile`` keeps the module and its parameter names, so HF weights load and FSDP2 shards the layers
    afterwards as usual. Layers compile on their first call; identical layers share the compiled code. The
    language model's ``head_loss`` (the fused LM head + cross-entropy) is compiled too (``compile_loss``). The
    vision blocks of a vision-language model run eagerly: the number of patches changes with every pack.

    Two parts of a layer run eagerly by default, as graph breaks inside the compiled layer, because their shapes
    or control flow follow the data and would make Dynamo compile again for nearly every pack:

    - the attention block (``self_attn``): a packed batch's document bounds are Python ints (one kernel call per
      document with SDPA) -- ``compile_attention: true`` compiles it (fixed document structure only);
    - the MoE block (``mlp`` of MoE layers): the experts' row counts are data-dependent (a host sync and a loop
      per expert) -- ``compile_moe_block: true`` compiles it.

    Compiled code is specialized to the pack length: packs must have a fixed length (``data.pad_to_max_length:
    true``, the default) unless ``dynamic: true``. ``train/recompiles`` counts the frames Dynamo compiled after
    the first training step; with fixed-length packs it stays 0 (a validation run adds its own grad-free
    compiles).

    Numerics: ``backend: aot_eager`` runs the eager kernels: losses equal eager bitwise, gradients equal them
    bitwise when the whole layer is one graph and to the last bit or so otherwise (gradient contributions that
    meet at a graph break are summed in another order). ``inductor`` fuses and reorders floating-point work
    (fp32: about 1e-7 relative on the tiny runs).

    Args:
        backend: A ``torch.compile`` backend (``inductor``, ``aot_eager``, ``eager``, ...).
        mode: ``torch.compile`` mode (inductor only; ``None``: the default).
        fullgraph: Fail on graph breaks (needs ``compile_attention`` and, for MoE, ``compile_moe_block``).
        dynamic: ``torch.compile``'s ``dynamic`` (``None``: specialize, then go dynamic on a shape change).
        compile_loss: Also compile the language model's ``head_loss`` (the fused LM head + cross-entropy).
        compile_attention: Compile the attention block too (see above).
        compile_moe_block: Compile the MoE block of MoE layers too (see above).
    """

    transform_stage = TransformStage.COMPILE

    def __init__(
        self,
        backend: str = "inductor",
        mode: CompileMode | None = None,
        fullgraph: bool = False,
        dynamic: bool | None = None,
        compile_loss: bool = True,
        compile_attention: bool = False,
        compile_moe_block: bool = False,
    ) -> None:
        backends = torch._dynamo.list_backends(exclude_tags=())
        if backend not in backends:
            raise ValueError(f"compile backend must be one of {backends}; got {backend!r}")
        if mode is not None and mode not in MODES:
            raise ValueError(f"compile mode must be one of {MODES} or null; got {mode!r}")
        self.backend = backend
        self.mode = mode
        self.fullgraph = fullgraph
        self.dynamic = dynamic
        self.compile_loss = compile_loss
        self.compile_attention = compile_attention
        self.compile_moe_block = compile_moe_block
        self._frames_after_first_step: int | None = None

    @property
    def options(self) -> dict[str, Any]:
        """The keyword arguments given to ``torch.compile``."""
        options: dict[str, Any] = {"backend": self.backend, "fullgraph": self.fullgraph, "dynamic": self.dynamic}
        if self.mode is not None:
            options["mode"] = self.mode
        return options

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Refuse packs of varying length (each new length would compile again) unless ``dynamic: true``.

        Raises:
            ValueError: When the datamodule does not pad packs to ``pack_max_length`` and ``dynamic`` is not true.
        """
        datamodule = run_datamodule(trainer)
        if self.dynamic is not True and datamodule is not None and not datamodule.pad_to_max_length:
            raise ValueError(
                "the Compile callback needs fixed-length packs: set data.pad_to_max_length: true "
                "(or compile with dynamic: true to accept varying lengths)"
            )

    def eager_parts(self, model: BaseModel) -> list[nn.Module]:
        """The parts of the decoder layers that run eagerly inside the compiled layers (graph breaks around them):
        the attention modules and the MoE blocks, unless ``compile_attention`` / ``compile_moe_block``."""
        parts: list[nn.Module] = [] if self.compile_attention else model.attention_modules()
        return parts + ([] if self.compile_moe_block else model.moe_blocks())

    def transform_model(self, model: BaseModel) -> BaseModel:
        """Compile each decoder layer (and ``head_loss``) in place; names and structure stay unchanged."""
        eager = self.eager_parts(model)
        if eager and self.fullgraph:
            raise ValueError(
                "compile fullgraph: true needs compile_attention: true (and compile_moe_block: true for MoE "
                "models): the parts run eagerly are graph breaks"
            )
        for part in eager:
            part.forward = torch.compiler.disable(part.forward, recursive=True)  # an attribute: names unchanged
        for layer in model.decoder_layers():
            layer.compile(**self.options)
        if self.compile_loss:
            text = model.text_model()
            text.head_loss = torch.compile(text.head_loss, **self.options)  # an attribute: names unchanged
        return model

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Log ``train/recompiles``: frames Dynamo compiled since the end of the first training step."""
        frames = compiled_frames()
        if self._frames_after_first_step is None:
            self._frames_after_first_step = frames
        recompiles = frames - self._frames_after_first_step
        pl_module.log("train/recompiles", float(recompiles), on_step=True, on_epoch=False, batch_size=1)


def compiled_frames() -> int:
    """How many frames Dynamo has compiled in this process (every first compile and every recompile)."""
    return int(torch._dynamo.utils.counters["frames"]["total"])
