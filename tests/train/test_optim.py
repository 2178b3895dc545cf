"""Parameter groups and learning-rate schedules."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from xtl.errors import ConfigError
from xtl.train import TorchOptimizer, resolve_model_config
from xtl.train.optim import AdamWConfig, OptimizerConfig, ScheduleConfig, lr_lambda, param_groups
from xtl.train.step import optimizer_step_unless_nonfinite

from .conftest import TINY_MODEL


class TestParamGroups:
    def test_norms_biases_and_embeddings_are_not_decayed(self):
        config, _ = resolve_model_config({**TINY_MODEL, "model_type": "qwen2", "head_dim": None})
        model = config.build()
        decay, no_decay = param_groups(model, weight_decay=0.1)
        names = {id(p): n for n, p in model.named_parameters()}
        undecayed = {names[id(p)] for p in no_decay["params"]}
        assert no_decay["weight_decay"] == 0.0 and decay["weight_decay"] == 0.1
        assert "embed_tokens.weight" in undecayed and "norm.weight" in undecayed
        assert "layers.0.self_attn.q_proj.bias" in undecayed and "layers.0.input_layernorm.weight" in undecayed
        assert {names[id(p)] for p in decay["params"]} == {n for n, _ in model.named_parameters()} - undecayed
        assert all("proj.weight" in names[id(p)] for p in decay["params"])

    def test_option_off_decays_everything(self):
        config, _ = resolve_model_config(TINY_MODEL)
        groups = param_groups(config.build(), weight_decay=0.1, no_decay_norm_bias_embed=False)
        assert len(groups) == 1


class TestSchedules:
    def test_warmup_then_cosine_to_min_ratio(self):
        f = lr_lambda("cosine", warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
        assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
        assert f(10) == pytest.approx(1.0)
        assert f(60) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
        assert f(110) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)

    def test_linear_and_constant(self):
        assert lr_lambda("linear", 0, 100, 0.0)(50) == pytest.approx(0.5)
        assert lr_lambda("constant", 5, 100, 0.0)(50) == 1.0

    def test_unknown_schedule(self):
        with pytest.raises(ValueError, match="unknown schedule"):
            lr_lambda("exponential", 0, 10, 0.0)

    def test_schedule_config_rejects_an_unknown_kind(self):
        with pytest.raises(ValueError, match="schedule.kind"):
            ScheduleConfig(kind="exponential")


class TestOptimizerConfig:
    def test_adamw_config_builds_adamw_with_its_settings_and_groups(self):
        config, _ = resolve_model_config(TINY_MODEL)
        opt = AdamWConfig(lr=3e-3, weight_decay=0.05, betas=(0.8, 0.9), eps=1e-6).build(
            config.build(), torch.device("cpu")
        )
        assert isinstance(opt, torch.optim.AdamW)
        assert [g["weight_decay"] for g in opt.param_groups] == [0.05, 0.0]
        assert {g["lr"] for g in opt.param_groups} == {3e-3} and opt.defaults["betas"] == (0.8, 0.9)

    def test_a_new_optimizer_is_a_new_class(self):
        @dataclasses.dataclass
        class SGDConfig(OptimizerConfig):
            momentum: float = 0.9

            def create(self, groups, device):
                return torch.optim.SGD(groups, lr=self.lr, momentum=self.momentum)

        config, _ = resolve_model_config(TINY_MODEL)
        opt = SGDConfig(lr=0.5).build(config.build(), torch.device("cpu"))
        assert isinstance(opt, torch.optim.SGD) and opt.defaults["momentum"] == 0.9


class TestTorchOptimizer:
    def _model(self):
        config, _ = resolve_model_config(TINY_MODEL)
        return config.build()

    def test_any_torch_optimizer_by_name_or_class_path(self):
        opt = TorchOptimizer(name="SGD", lr=0.5, weight_decay=0.01, kwargs={"momentum": 0.8}).build(
            self._model(), torch.device("cpu")
        )
        assert type(opt) is torch.optim.SGD and opt.defaults["momentum"] == 0.8
        assert [g["weight_decay"] for g in opt.param_groups] == [0.01, 0.0]
        opt = TorchOptimizer(name="torch.optim.Adagrad", lr=0.1, kwargs={"lr_decay": 0.5}).build(
            self._model(), torch.device("cpu")
        )
        assert type(opt) is torch.optim.Adagrad and opt.defaults["lr_decay"] == 0.5

    def test_an_optimizer_without_weight_decay_gets_no_decay_key(self):
        opt = TorchOptimizer(name="Rprop", lr=0.1, weight_decay=0.0).build(self._model(), torch.device("cpu"))
        assert all("weight_decay" not in g for g in opt.param_groups) and type(opt) is torch.optim.Rprop
        with pytest.raises(ConfigError, match="Rprop has no weight decay; set it to 0"):
            TorchOptimizer(name="Rprop", weight_decay=0.1)

    def test_bad_names_and_arguments_are_refused(self):
        with pytest.raises(ConfigError, match=r"'torch.optim.AdamX' is not an importable optimizer class.*AdamW"):
            TorchOptimizer(name="torch.optim.AdamX")
        with pytest.raises(ConfigError, match="is not a torch.optim.Optimizer subclass"):
            TorchOptimizer(name="torch.nn.Linear")
        with pytest.raises(ConfigError, match=r"kwargs.momentom: SGD takes no argument 'momentom' \(did you mean"):
            TorchOptimizer(name="SGD", kwargs={"momentom": 0.9})
        with pytest.raises(ConfigError, match="set optimizer.lr instead"):
            TorchOptimizer(name="SGD", kwargs={"lr": 0.9})

    def test_a_fused_optimizer_skips_a_nonfinite_step_on_the_device(self):
        model = self._model()
        opt = TorchOptimizer(name="SGD", lr=0.5, kwargs={"fused": True}).build(model, torch.device("cpu"))
        for param in model.parameters():
            param.grad = torch.ones_like(param)
        before = [p.detach().clone() for p in model.parameters()]
        found_inf = optimizer_step_unless_nonfinite(opt, torch.tensor(float("inf")))
        assert found_inf.item() == 1.0 and opt.found_inf is not None  # the fused found-inf path was taken
        assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
        optimizer_step_unless_nonfinite(opt, torch.tensor(1.0))
        assert not all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
