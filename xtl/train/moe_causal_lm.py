"""LightningModule of MoE causal LMs: router losses, router metrics and the aux-free bias update."""

from __future__ import annotations

from typing import Any

import torch

from xtl.model import ModelOutput
from xtl.ops.moe_loss import balance_loss, z_loss
from xtl.train.base import LanguageModule
from xtl.train.step import StepResult


class MoECausalLM(LanguageModule):
    """MoE training: cross-entropy + ``balance_loss_coef`` x load-balancing loss + ``z_loss_coef`` x router z-loss.

    Router statistics are normalized globally like the cross-entropy: each micro-batch's expert loads and token
    count are all-reduced over data-parallel ranks before the losses are formed, so the balancing term sees the
    whole data-parallel micro-batch; the terms are averaged over the step's micro-batches. After each optimizer
    step, routers with an ``e_score_correction_bias`` (DeepSeek-V3, aux-loss-free) move their bias by
    ``router_bias_update_lr`` towards balance, using the step's all-reduced expert loads.

    Logs ``train/balance_loss``, ``train/z_loss`` and ``train/maxvio`` (mean over MoE layers of
    ``(max load - mean load) / mean load`` over the step) besides the :class:`LanguageModule` metrics.

    Args:
        balance_loss_coef: Weight of the load-balancing loss (``None``: the config's ``router_aux_loss_coef``).
        z_loss_coef: Weight of the router z-loss.
        router_bias_update_lr: Step of the aux-free bias update (0 disables it).
        **kwargs: :class:`LanguageModule` arguments.
    """

    trains_experts = True

    def __init__(
        self,
        *args: Any,
        balance_loss_coef: float | None = None,
        z_loss_coef: float = 0.0,
        router_bias_update_lr: float = 1e-3,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.save_hyperparameters()
        if balance_loss_coef is None:
            balance_loss_coef = float(getattr(self.model_config, "router_aux_loss_coef", 0.0) or 0.0)
        self.balance_loss_coef = balance_loss_coef
        self._router_log: dict[str, torch.Tensor] = {}

    def training_step(self, batch: list[Any], batch_idx: int) -> torch.Tensor:
        """As :meth:`LanguageModule.training_step`, with router losses averaged over ``len(batch)``."""
        self._num_micro_batches = max(1, len(batch))
        self._router_log = {k: torch.zeros((), device=self.device) for k in ("balance_loss", "z_loss")}
        loss = super().training_step(batch, batch_idx)
        self.log_dict({f"train/{k}": v for k, v in self._router_log.items()}, on_step=True, batch_size=1)
        return loss

    def extra_loss(self, output: ModelOutput, global_tokens: torch.Tensor) -> torch.Tensor | None:
        """Balance and z losses of one micro-batch, globally normalized across data-parallel ranks."""
        extras = output.extras
        if "router_prob_sum" not in extras:
            return None
        counts = torch.cat([extras["tokens_per_expert"].float().flatten(), extras["router_num_tokens"].float()[None]])
        counts = self._sum_over_data_ranks(counts)
        tokens_per_expert = counts[:-1].view_as(extras["tokens_per_expert"])
        num_tokens = counts[-1]
        scale = self._dp_world_size() / self._num_micro_batches
        bal = balance_loss(extras["router_prob_sum"], tokens_per_expert, num_tokens)
        z = z_loss(extras["router_z_sum"], num_tokens)
        self._router_log["balance_loss"] += bal.detach().float() / self._num_micro_batches
        self._router_log["z_loss"] += z.detach().float() / self._num_micro_batches
        return scale * (self.balance_loss_coef * bal + self.hparams.z_loss_coef * z)

    def after_optimizer_step(self, result: StepResult, applied: torch.Tensor) -> None:
        """Aux-free router bias update (none on a skipped step) and the max-violation metric from the expert loads."""
        loads = [out["tokens_per_expert"] for out in result.outputs if "tokens_per_expert" in out]
        if not loads:
            return
        total = self._sum_over_data_ranks(torch.stack(loads).sum(0).float())
        mean = total.mean(dim=-1, keepdim=True).clamp(min=1e-9)
        self.log("train/maxvio", ((total.max(dim=-1, keepdim=True).values - mean) / mean).mean(), batch_size=1)
        if self.hparams.router_bias_update_lr > 0:
            self.model.update_router_bias(total, self.hparams.router_bias_update_lr * applied)
