"""Compile: ``torch.compile`` each decoder layer (and the model's head loss), or the whole forward, in place."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from torch import nn

from xtl.callbacks._run import run_datamodule
from xtl.errors import ConfigError
from xtl.model import BaseModel
from xtl.strategies.parallelize import ModelTransform, TransformStage

CompileMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
MODES: tuple[str, ...] = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
CompileScope = Literal["layers", "model"]
SCOPES: tuple[str, ...] = ("layers", "model")


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

    ``scope: model`` compiles the language model's whole training forward instead: embeddings, rotary tables, the
    layers, final norm, supervised-row selection and head + loss. The packed attention mask is built eagerly (a
    graph break; its document bounds would be guarded on), and where the layer loop meets an eager part Dynamo
    cannot resume inside the loop, so each layer call becomes its own frame: cross-layer fusion needs
    ``compile_attention: true`` on one device. An MoE model's router statistics run eagerly (they count the real
    tokens, which follow the padding); a pack whose head runs on every row (no row selection) takes the forward's
    other branch, a second variant compiled once. Not with ``fullgraph`` (the mask's graph break).

    Under the FSDP2 strategy (also with expert or context parallelism) the hooks FSDP2 puts around each sharded
    layer are such an eager part: torch runs them outside Dynamo (``torch._dynamo.disable``; no option traces
    them), so each layer call is its own frame with FSDP's unshard, reshard and prefetch around it, and the root's
    hooks run before and after the compiled forward. The backward is each frame's AOTAutograd backward, joined by
    FSDP's eager autograd hooks (no compiled autograd). Tested against eager on 2 ranks with ``aot_eager``: losses
    and gradients bitwise with a bf16 ``param_dtype``, in fp32 gradients to the last bits (sums at the graph
    breaks). In a vision-language model the language model is compiled so; the vision tower and the image merge
    run eagerly before it (their sizes follow the data) and the DeepStack additions as eager hooks.

    The LM head and loss run on the supervised rows only, whose number changes with every pack: that dimension is
    marked dynamic before the first call, so new row counts never compile again.

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
        scope: ``layers`` (each decoder layer, and ``head_loss``) or ``model`` (the whole forward, see above).
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
        scope: CompileScope = "layers",
    ) -> None:
        backends = torch._dynamo.list_backends(exclude_tags=())
        if backend not in backends:
            raise ValueError(f"compile backend must be one of {backends}; got {backend!r}")
        if mode is not None and mode not in MODES:
            raise ValueError(f"compile mode must be one of {MODES} or null; got {mode!r}")
        if scope not in SCOPES:
            raise ValueError(f"compile scope must be one of {SCOPES}; got {scope!r}")
        self.backend = backend
        self.mode = mode
        self.fullgraph = fullgraph
        self.dynamic = dynamic
        self.compile_loss = compile_loss
        self.compile_attention = compile_attention
        self.compile_moe_block = compile_moe_block
        self.scope = scope
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
        """Compile each decoder layer (and ``head_loss``), or the whole language model forward, in place; names
        and structure stay unchanged (compiled functions are instance attributes)."""
        eager = self.eager_parts(model)
        if eager and self.fullgraph:
            raise ValueError(
                "compile fullgraph: true needs compile_attention: true (and compile_moe_block: true for MoE "
                "models): the parts run eagerly are graph breaks"
            )
        if self.scope == "model" and self.fullgraph:
            raise ConfigError(
                "Compile scope: model builds the packed attention mask eagerly (a graph break): set fullgraph: false"
            )
        for part in eager:
            part.forward = torch.compiler.disable(part.forward, recursive=True)
        text = model.text_model()
        if self.scope == "model":
            text.forward = _rows_dynamic(torch.compile(text.forward, **self.options), "seq_ctx")
            return model
        for layer in model.decoder_layers():
            layer.compile(**self.options)
        if self.compile_loss:
            text.head_loss = _rows_dynamic(torch.compile(text.head_loss, **self.options), "hidden")
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


def _rows_dynamic(compiled: Callable[..., Any], argument: str) -> Callable[..., Any]:
    """``compiled`` with the supervised-row dimension of its input marked dynamic before each call: ``hidden``
    ``(..., N, C)`` and ``targets`` ``(..., N)`` of ``head_loss`` (positional), or ``seq_ctx.loss_positions``
    ``(N,)`` of a forward. Dynamo then compiles once for every row count instead of once per count (or once more on
    the second count, which automatic dynamic shapes would do)."""

    @functools.wraps(compiled)
    def call(*args: Any, **kwargs: Any) -> Any:
        if argument == "hidden":
            hidden, targets = args[0], args[1]
            torch._dynamo.maybe_mark_dynamic(hidden, hidden.dim() - 2)
            if targets is not None:
                torch._dynamo.maybe_mark_dynamic(targets, targets.dim() - 1)
        elif (seq_ctx := kwargs.get(argument)) is not None and seq_ctx.loss_positions is not None:
            torch._dynamo.maybe_mark_dynamic(seq_ctx.loss_positions, 0)
        return compiled(*args, **kwargs)

    return call
