"""fp8 training: the decoder layers' linear layers run their matmuls in ``float8_e4m3fn`` (a model transform)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from fnmatch import fnmatchcase
from typing import Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn

from xtl.callbacks._layers import module_names
from xtl.model import BaseModel
from xtl.ops.fp8 import BLOCK, blockwise_fp8_linear, blockwise_fp8_path
from xtl.strategies.parallelize import ModelTransform, TransformStage

Fp8Recipe = Literal["tensorwise", "rowwise", "blockwise"]
RECIPES: tuple[str, ...] = ("tensorwise", "rowwise", "blockwise")
TORCHAO_MULTIPLE = 16


class FP8Training(pl.Callback, ModelTransform):
    """Swap the decoder layers' ``nn.Linear`` layers for fp8 ones (stage ``MODEL``: before FSDP and weight loading).

    Recipes (the scales are computed from the current amax of each operand, in forward and in backward):

    - ``tensorwise``: one scale per tensor; torchao's float8 training (``convert_to_float8_training``) on
      ``torch._scaled_mm``, which runs on CPU and CUDA alike.
    - ``rowwise``: one scale per row of each operand (power-of-two scales); torchao, ``_scaled_mm``, CPU and CUDA.
    - ``blockwise``: 1x128 activation and 128x128 weight scales (DeepSeek-V3 style),
      :func:`xtl.ops.blockwise_fp8_linear`: torchao's triton kernels and ``F.scaled_mm`` on CUDA sm90+, the
      quantize -> dequantize -> matmul reference on CPU (same rounding).

    Converted: the ``nn.Linear`` layers of every decoder layer -- attention and MLP projections, dense MLPs and MoE
    shared experts. A vision-language model's vision blocks stay in the training dtype (their patch counts change
    with every pack). Kept in the training dtype: the embedding and LM head (outside the decoder layers), routers
    (``Router`` modules, not ``nn.Linear``), and, with the reason in :attr:`skipped`, layers whose in/out features
    are not multiples of 16 (``tensorwise``/``rowwise``) or 128 (``blockwise``; no padding), the modules ``skip``
    names, and routed experts (grouped GEMMs: ``_scaled_grouped_mm`` has no CPU kernel, so they stay in the training
    dtype on every device). Parameter names do not change, so HF weights load as before.

    Under an FSDP2 strategy on CUDA, ``tensorwise`` all-gathers the weights in fp8 (torchao's
    ``enable_fsdp_float8_all_gather``); every other case all-gathers in the mixed-precision dtype (bf16).

    Args:
        recipe: ``tensorwise``, ``rowwise`` or ``blockwise``.
        skip: Module names to keep in high precision, as ``fnmatch`` patterns on the full name (e.g.
            ``layers.0.*``, ``*.down_proj``); each must match at least one linear layer of the decoder layers.
        fsdp_float8_all_gather: Allow fp8 all-gather (used only with ``tensorwise`` under FSDP2 on CUDA).
        emulate: ``tensorwise`` only: torchao's emulated GEMM (the same fp8 casts and scales, the matmul in high
            precision) instead of ``torch._scaled_mm``, for hardware without fp8 GEMMs, where ``_scaled_mm`` runs a
            slow reference kernel (a CPU without fp8 instructions: ~100x slower than emulation). Not bitwise equal
            to the kernel (the accumulation differs: ~1e-3 relative in bf16). (torchao's rowwise emulation departs
            from its kernel by ~10% in the weight gradient, so ``rowwise`` refuses it.)

    Attributes:
        converted: Names of the linear layers made fp8 by :meth:`transform_model`.
        skipped: Name -> reason for the decoder-layer linear layers and routed experts kept in high precision.

    Raises:
        ValueError: An unknown ``recipe``, a bad ``skip`` or ``emulate`` with another recipe than ``tensorwise``,
            naming the key.
    """

    transform_stage = TransformStage.MODEL

    def __init__(
        self,
        recipe: Fp8Recipe = "tensorwise",
        skip: Sequence[str] = (),
        fsdp_float8_all_gather: bool = True,
        emulate: bool = False,
    ) -> None:
        if recipe not in RECIPES:
            raise ValueError(f"fp8 recipe must be one of {RECIPES}; got {recipe!r}")
        if isinstance(skip, str) or not all(isinstance(p, str) and p for p in skip):
            raise ValueError(f"fp8 skip must be a list of module-name patterns; got {skip!r}")
        if emulate and recipe != "tensorwise":
            raise ValueError(
                f"fp8 emulate applies to the tensorwise recipe only (recipe: {recipe}; blockwise runs its own "
                "reference path where the hardware lacks fp8 kernels): remove emulate"
            )
        self.recipe = recipe
        self.skip = list(skip)
        self.fsdp_float8_all_gather = fsdp_float8_all_gather
        self.emulate = emulate
        self.converted: list[str] = []
        self.skipped: dict[str, str] = {}
        self._fsdp_on_cuda = False

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Note whether the model will be FSDP-sharded on CUDA (runs before ``configure_model``)."""
        parallelizer = pl_module.parallelizer
        device = parallelizer.root_device
        self._fsdp_on_cuda = parallelizer.shards_parameters and device.type == "cuda"
        if self.recipe == "blockwise":
            rank_zero_info(f"fp8 blockwise on {device}: {blockwise_fp8_path(device)} path")

    def transform_model(self, model: BaseModel) -> BaseModel:
        """Swap the chosen linear layers of ``model`` (built on meta) for fp8 ones; names are unchanged."""
        chosen = self._choose(model)
        if self.recipe == "blockwise":
            for name in chosen:
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent), child, BlockwiseFp8Linear.from_linear(model.get_submodule(name)))
        elif chosen:
            fp8_all_gather = self.fsdp_float8_all_gather and self._fsdp_on_cuda
            _torchao_convert(model, self.recipe, set(chosen), fp8_all_gather, self.emulate)
        self.converted = chosen
        if not chosen:
            rank_zero_warn(f"fp8 {self.recipe}: no linear layer qualifies; the model trains in high precision")
        rank_zero_info(f"fp8 {self.recipe}: {len(chosen)} linear layers converted, {len(self.skipped)} kept")
        return model

    def _choose(self, model: BaseModel) -> list[str]:
        multiple = BLOCK if self.recipe == "blockwise" else TORCHAO_MULTIPLE
        self.skipped = {}
        chosen, used = [], set()
        names = module_names(model)
        for block in model.moe_blocks():
            self.skipped[names[id(block.experts)]] = "routed experts: grouped GEMM in the training dtype"
        for part, stack in model.layer_stacks().items():
            for layer in stack:
                for module in layer.modules():
                    name = names[id(module)]
                    if type(module) is not nn.Linear:
                        continue
                    patterns = [p for p in self.skip if fnmatchcase(name, p)]
                    used.update(patterns)
                    if part != "language":
                        self.skipped[name] = f"{part} blocks: their token counts change with every pack"
                    elif patterns:
                        self.skipped[name] = f"skip: {patterns[0]}"
                    elif module.in_features % multiple or module.out_features % multiple:
                        self.skipped[name] = (
                            f"in/out features {module.in_features}/{module.out_features} are not multiples of "
                            f"{multiple}"
                        )
                    else:
                        chosen.append(name)
        unused = [p for p in self.skip if p not in used]
        if unused:
            raise ValueError(f"fp8 skip pattern {unused[0]!r} matches no linear layer of the decoder layers")
        return chosen


class BlockwiseFp8Linear(nn.Linear):
    """``nn.Linear`` whose forward is :func:`xtl.ops.blockwise_fp8_linear` (same parameters and names)."""

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> BlockwiseFp8Linear:
        """A blockwise fp8 linear sharing ``linear``'s weight and bias."""
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None)
        new.weight, new.bias = linear.weight, linear.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T + bias`` in blockwise fp8."""
        return blockwise_fp8_linear(x, self.weight, self.bias)


def layer_errors(
    fp8_model: nn.Module, reference: nn.Module, names: Sequence[str], loss_fn: Callable[[nn.Module], torch.Tensor]
) -> dict[str, dict[str, float]]:
    """Relative error ``||fp8 - ref|| / ||ref||`` of each fp8 layer's output, input gradient and weight gradient.

    Each layer is measured on its own: the same-named layer of ``reference`` (the model before conversion, same
    weights) records its input and output gradient during ``loss_fn(reference).backward()``, and both layers are
    then run on exactly those, so errors of earlier layers do not accumulate.

    Args:
        fp8_model: The converted model.
        reference: The unconverted model with the same weights.
        names: The layers to measure (e.g. :attr:`FP8Training.converted`).
        loss_fn: Returns a scalar loss of a model.

    Returns:
        Name -> ``{"output": ..., "grad_input": ..., "grad_weight": ...}``.
    """
    captured: dict[str, dict[str, torch.Tensor]] = {name: {} for name in names}
    hooks = []
    for name in names:
        module = reference.get_submodule(name)
        hooks.append(module.register_forward_hook(lambda m, a, o, n=name: captured[n].update(x=a[0].detach())))
        hooks.append(module.register_full_backward_hook(lambda m, gi, go, n=name: captured[n].update(g=go[0])))
    loss_fn(reference).backward()
    for hook in hooks:
        hook.remove()
    errors = {}
    for name in names:
        x, g = captured[name]["x"], captured[name]["g"].detach()
        ref = _forward_backward(reference.get_submodule(name), x, g)
        got = _forward_backward(fp8_model.get_submodule(name), x, g)
        errors[name] = {key: float((got[key] - ref[key]).float().norm() / ref[key].float().norm()) for key in ref}
    return errors


def _forward_backward(module: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> dict[str, torch.Tensor]:
    x = x.clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    out = module(x)
    out.backward(grad)
    return {"output": out.detach(), "grad_input": x.grad, "grad_weight": module.weight.grad}


def _torchao_convert(model: nn.Module, recipe: str, chosen: set[str], fp8_all_gather: bool, emulate: bool) -> None:
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as err:
        raise ImportError(f"fp8 recipe {recipe!r} needs torchao: pip install 'xtl[fp8]'") from err
    config = Float8LinearConfig.from_recipe_name(recipe)
    if fp8_all_gather and recipe == "tensorwise":
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    config = dataclasses.replace(config, emulate=emulate)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda module, fqn: fqn in chosen)
