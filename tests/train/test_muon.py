"""Muon (``xtl.train.MuonConfig``): the update against torch.optim.Muon, the parameter grouping, the found-inf skip,
exact resume, and FSDP / expert parallelism on 2 gloo processes against one process."""

from __future__ import annotations

import copy
import os
import re
import zlib

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.tensor import DTensor

from tests.composition.matrix import FAMILIES
from tests.train.test_base import LossRecorder, StopAt
from tests.train.test_step import MODEL, _free_port
from xtl.errors import ConfigError
from xtl.strategies import AtomicCheckpointIO
from xtl.train import LanguageModule, MuonConfig, ScheduleConfig, resolve_model_config
from xtl.train.muon import Muon
from xtl.train.step import optimizer_step_unless_nonfinite

from .conftest import TINY_MODEL

# One process: the same operations in the same order as torch.optim.Muon (measured: bitwise equal).
TOL = {"rtol": 0.0, "atol": 1e-6}
STEPS = 3
FAMILY = {family.name: family.model for family in FAMILIES}


def _meta_model(spec: dict) -> torch.nn.Module:
    config, _ = resolve_model_config(spec)
    with torch.device("meta"):
        return config.build()


def _model(spec: dict, seed: int = 0) -> torch.nn.Module:
    config, _ = resolve_model_config(spec)
    model = config.build()
    torch.manual_seed(seed)
    model.init_weights()
    return model


def _grad(shape: torch.Size, step: int, index: int) -> torch.Tensor:
    """The gradient of parameter ``index`` at ``step``: the same on every process."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 * step + index))


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _set_grads(model: torch.nn.Module, step: int) -> None:
    """Every parameter's :func:`_grad`, this rank's shard of it for a sharded one."""
    from torch.distributed.tensor import distribute_tensor

    for index, param in enumerate(model.parameters()):
        grad = _grad(param.shape, step, index)
        param.grad = (
            distribute_tensor(grad, param.device_mesh, param.placements) if isinstance(param, DTensor) else grad
        )


def _muon_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> list[dict]:
    """Step ``optimizer`` with :func:`_set_grads`; the full parameters after each step."""
    states = []
    for step in steps:
        _set_grads(model, step)
        optimizer.step()
        states.append({name: _full(p).detach().clone() for name, p in model.named_parameters()})
    return states


CONFIG = MuonConfig(lr=0.02, weight_decay=0.1, adamw_lr=3e-3)
# fused q/k/v of 64 + 8 + 8 rows (hidden 32: q's update is scaled by sqrt(2), k's and v's by 1): FSDP's two row
# shards of 40 cut q
FUSED_MODEL = {**MODEL, "num_attention_heads": 8, "num_key_value_heads": 1, "fused_projections": True}


class TestMatchesTorchMuon:
    @pytest.mark.parametrize("adjust_lr", ["original", "match_rms_adamw"])
    @pytest.mark.parametrize("nesterov", [True, False])
    def test_two_d_parameters_equal_torch_muon_over_steps(self, adjust_lr, nesterov):
        shapes = [(48, 32), (16, 40), (24, 24)]  # tall, wide, square
        ours = [torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(i))) for i, s in
                enumerate(shapes)]  # fmt: skip
        ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
        init = [p.detach().clone() for p in ours]
        settings = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov)
        opt = Muon(ours, **settings, adjust_lr=adjust_lr)
        ref_opt = torch.optim.Muon(ref, **settings, adjust_lr_fn=None if adjust_lr == "original" else adjust_lr)
        for step in range(4):
            for i, (p, q) in enumerate(zip(ours, ref)):
                p.grad, q.grad = _grad(p.shape, step, i), _grad(q.shape, step, i)
            opt.step()
            ref_opt.step()
            for p, q in zip(ours, ref):
                torch.testing.assert_close(p, q, **TOL)
                torch.testing.assert_close(opt.state[p]["momentum_buffer"], ref_opt.state[q]["momentum_buffer"])
        assert all((p - p0).abs().max() > 1e-3 for p, p0 in zip(ours, init)), "the parameters moved"

    def test_grouped_expert_weights_equal_torch_muon_per_expert(self):
        experts = torch.nn.Parameter(torch.randn(4, 24, 16, generator=torch.Generator().manual_seed(0)))
        per_expert = [torch.nn.Parameter(experts.detach()[e].clone()) for e in range(4)]
        opt = Muon([experts], lr=0.02, weight_decay=0.1)
        ref_opt = torch.optim.Muon(per_expert, lr=0.02, weight_decay=0.1)
        for step in range(STEPS):
            experts.grad = _grad(experts.shape, step, 0)
            for e, p in enumerate(per_expert):
                p.grad = experts.grad[e].clone()
            opt.step()
            ref_opt.step()
            torch.testing.assert_close(experts.detach(), torch.stack([p.detach() for p in per_expert]), **TOL)

    @pytest.mark.parametrize("no_decay_norm_bias_embed", [True, False])
    def test_adamw_groups_equal_fused_torch_adamw(self, no_decay_norm_bias_embed):
        """The tiny model's AdamW parameters (tied embedding, norms) step as torch.optim.AdamW(fused=True) with
        AdamW's own learning rate and settings, decayed or not as xtl's groups say."""
        config = MuonConfig(lr=0.02, weight_decay=0.1, no_decay_norm_bias_embed=no_decay_norm_bias_embed,
                            adamw_lr=3e-3, adamw_betas=(0.8, 0.9), adamw_eps=1e-6)  # fmt: skip
        model, ref = _model(TINY_MODEL), _model(TINY_MODEL)
        opt = config.build(model, torch.device("cpu"))
        adamw = [name for name, muon in config.uses_muon(model).items() if not muon]
        ref_opt = torch.optim.AdamW(
            [p for name, p in ref.named_parameters() if name in adamw], lr=3e-3, betas=(0.8, 0.9), eps=1e-6,
            weight_decay=0.0 if no_decay_norm_bias_embed else 0.1, fused=True,
        )  # fmt: skip
        for step in range(STEPS):
            _set_grads(model, step)
            _set_grads(ref, step)
            opt.step()
            ref_opt.step()
        got, want = dict(model.named_parameters()), dict(ref.named_parameters())
        for name in adamw:
            assert torch.equal(got[name], want[name]), name


def _named_grad(name: str, shape: torch.Size, step: int) -> torch.Tensor:
    """The gradient of the (unfused) parameter ``name`` at ``step``: the same in every model that has it."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 * step + zlib.crc32(name.encode())))


class TestPerHFMatrix:
    """Muon orthogonalizes and scales each HF matrix on its own: a fused q/k/v or gate/up weight steps as the unfused
    model's separate weights, and a routed expert's gate and up rows as two matrices where the checkpoint keeps them
    apart (one, where it stores them fused: GPT-OSS, Qwen3-VL-MoE)."""

    def test_each_family_names_the_hf_matrices_it_stacks(self):
        def splits(family: str, **overrides) -> dict[str, tuple[int, ...]]:
            model = _meta_model({**FAMILY[family], **overrides})
            return {re.sub(r"\.\d+\.", ".N.", name): rows for name, rows in _matrix_rows(model).items()}

        qkv, gate_up, expert = (256, 128, 128), (256, 256), (16, 16)  # the matrix families' sizes
        assert splits("dense") == {}
        assert splits("dense", fused_projections=True) == {
            "layers.N.self_attn.qkv_proj.weight": qkv, "layers.N.mlp.gate_up_proj.weight": gate_up,
        }  # fmt: skip
        assert splits("moe") == {"layers.N.mlp.experts.gate_up": expert}
        assert splits("mla", fused_projections=True, mtp_layers=1) == {
            "layers.N.mlp.gate_up_proj.weight": gate_up,
            "layers.N.mlp.experts.gate_up": expert,
            "layers.N.mlp.shared_experts.gate_up_proj.weight": expert,
            "mtp.N.layer.mlp.experts.gate_up": expert,
            "mtp.N.layer.mlp.shared_experts.gate_up_proj.weight": expert,
        }
        assert splits("sinks", fused_projections=True) == {"layers.N.self_attn.qkv_proj.weight": qkv}
        assert splits("vlm", fused_projections=True) == {
            "language_model.layers.N.self_attn.qkv_proj.weight": qkv,
            "language_model.layers.N.mlp.gate_up_proj.weight": gate_up,
        }  # the vision tower's qkv is one HF matrix
        assert splits("vlm_moe", fused_projections=True) == {"language_model.layers.N.self_attn.qkv_proj.weight": qkv}

    @pytest.mark.parametrize("adjust_lr", ["original", "match_rms_adamw"])
    @pytest.mark.parametrize("family", ["dense", "mla", "vlm"])
    def test_a_fused_model_steps_as_the_unfused_one(self, family, adjust_lr):
        config = MuonConfig(lr=0.02, weight_decay=0.1, adamw_lr=3e-3, adjust_lr=adjust_lr)
        fused, plain = _model({**FAMILY[family], "fused_projections": True}), _model(FAMILY[family])
        opt, ref_opt = config.build(fused, torch.device("cpu")), config.build(plain, torch.device("cpu"))
        assert opt.matrix_rows and not ref_opt.matrix_rows or family == "mla"  # MLA: its experts' gate and up too
        for step in range(STEPS):
            for name, param in plain.named_parameters():
                param.grad = _named_grad(name, param.shape, step)
            for name, param in fused.named_parameters():
                parts = fused.fused_param_parts(name) or ((name, param.shape[0]),)
                param.grad = torch.cat([_named_grad(part, (rows, *param.shape[1:]), step) for part, rows in parts])
            opt.step()
            ref_opt.step()
        want, init = dict(plain.named_parameters()), dict(_model(FAMILY[family]).named_parameters())
        for name, param in fused.named_parameters():
            parts = fused.fused_param_parts(name) or ((name, param.shape[0]),)
            for (part, _), piece in zip(parts, param.detach().split([rows for _, rows in parts])):
                assert not torch.equal(piece, init[part]), f"{part} did not move"
                # measured: 0.0 (each part runs the unfused weight's very operations, on its rows of the fused one)
                torch.testing.assert_close(piece, want[part].detach(), **TOL, msg=lambda m, part=part: f"{part}: {m}")

    @pytest.mark.parametrize("family", ["moe", "sinks"])
    def test_expert_gate_and_up_step_as_torch_muon_per_hf_matrix(self, family):
        """Qwen3-MoE keeps each expert's gate and up apart in its checkpoint, GPT-OSS stores them as one matrix."""
        model = _model(FAMILY[family])
        experts = model.layers[0].mlp.experts.gate_up
        split = family == "moe"
        opt = CONFIG.build(model, torch.device("cpu"))
        assert (experts in opt.matrix_rows) == split
        rows = experts.shape[1] // 2 if split else experts.shape[1]
        matrices = [torch.nn.Parameter(m.clone()) for m in experts.detach().split(rows, dim=1) for m in m.unbind(0)]
        ref_opt = torch.optim.Muon(matrices, lr=CONFIG.lr, weight_decay=CONFIG.weight_decay)
        for step in range(STEPS):
            for param in model.parameters():
                param.grad = torch.zeros_like(param)
            experts.grad = _grad(experts.shape, step, 0)
            for matrix, grad in zip(matrices, [g for m in experts.grad.split(rows, dim=1) for g in m.unbind(0)]):
                matrix.grad = grad.clone()
            opt.step()
            ref_opt.step()
        got = [m for part in experts.detach().split(rows, dim=1) for m in part.unbind(0)]
        for mine, theirs in zip(got, matrices, strict=True):
            torch.testing.assert_close(mine, theirs.detach(), **TOL)

    def test_matrix_rows_must_split_a_muon_parameter(self):
        weight, other = torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(6, 4))
        with pytest.raises(ValueError, match=r"matrix_rows \(2, 3\) do not split the 6 rows"):
            Muon([weight], matrix_rows={weight: (2, 3)})
        with pytest.raises(ValueError, match="outside the Muon groups"):
            Muon([{"params": [weight]}, {"params": [other], "use_muon": False}], matrix_rows={other: (3, 3)})


def _matrix_rows(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """:meth:`MuonConfig.matrix_rows` of :data:`CONFIG` by parameter name."""
    names = {id(p): name for name, p in model.named_parameters()}
    return {names[id(p)]: rows for p, rows in CONFIG.matrix_rows(model).items()}


class TestGrouping:
    """Hidden matrices (linear weights, grouped experts) go to Muon; embeddings, head, norms, biases, routers, the
    patch embedding and the attention sinks go to AdamW."""

    def _adamw(self, family: str, config: MuonConfig = CONFIG) -> set[str]:
        return {name for name, muon in config.uses_muon(_meta_model(FAMILY[family])).items() if not muon}

    def test_dense(self):
        adamw = self._adamw("dense")
        assert {"embed_tokens.weight", "norm.weight", "layers.1.self_attn.q_norm.weight"} <= adamw
        assert all(n == "embed_tokens.weight" or n.endswith("norm.weight") for n in adamw), adamw

    def test_untied_head_goes_to_adamw(self):
        model = _meta_model({**FAMILY["dense"], "tie_word_embeddings": False})
        muon = CONFIG.uses_muon(model)
        assert not muon["lm_head.weight"] and not muon["embed_tokens.weight"]
        assert muon["layers.0.mlp.down_proj.weight"]

    def test_moe_experts_are_muon_and_routers_adamw(self):
        uses = CONFIG.uses_muon(_meta_model(FAMILY["sinks"]))  # gpt_oss: router and expert biases, sinks
        assert uses["layers.0.mlp.experts.gate_up"] and uses["layers.0.mlp.experts.down"]
        for name in ["mlp.gate.weight", "mlp.gate.bias", "mlp.experts.gate_up_bias", "self_attn.sinks",
                     "self_attn.q_proj.bias"]:  # fmt: skip
            assert not uses[f"layers.1.{name}"], name
        assert uses["layers.1.self_attn.q_proj.weight"]
        mla = CONFIG.uses_muon(_meta_model(FAMILY["mla"]))
        assert (
            mla["layers.1.mlp.shared_experts.up_proj.weight"] and mla["layers.0.self_attn.kv_a_proj_with_mqa.weight"]
        )
        assert not mla["layers.1.mlp.gate.weight"]

    def test_vlm_patch_embedding_and_position_embedding_are_adamw(self):
        uses = CONFIG.uses_muon(_meta_model(FAMILY["vlm"]))
        assert not uses["visual.patch_embed.proj.weight"] and not uses["visual.pos_embed.weight"]
        assert not uses["visual.merger.norm.weight"] and not uses["visual.blocks.0.attn.qkv.bias"]
        assert uses["visual.blocks.0.attn.qkv.weight"] and uses["visual.merger.linear_fc1.weight"]
        assert uses["language_model.layers.0.mlp.gate_proj.weight"]

    def test_groups_keep_decay_and_part_learning_rates(self):
        config = MuonConfig(lr=0.02, adamw_lr=1e-3, weight_decay=0.1, lr_scales={"vision": 0.5})
        model = _meta_model(FAMILY["vlm"])
        names = {id(p): n for n, p in model.named_parameters()}
        groups = config.param_groups(model)
        assert sum(len(g["params"]) for g in groups) == len(names)
        by_key = {(g["name"], g["use_muon"], g["weight_decay"]): g for g in groups}
        assert by_key[("vision", True, 0.1)]["lr"] == 0.01 and by_key[("language", True, 0.1)]["lr"] == 0.02
        assert by_key[("vision", False, 0.0)]["lr"] == 5e-4 and by_key[("language", False, 0.0)]["lr"] == 1e-3
        adamw = {n for g in groups if not g["use_muon"] for n in map(names.get, map(id, g["params"]))}
        assert adamw == {n for n, muon in config.uses_muon(model).items() if not muon}
        decayed_adamw = by_key[("vision", False, 0.1)]  # the patch embedding (a convolution) keeps weight decay
        assert [names[id(p)] for p in decayed_adamw["params"]] == ["visual.patch_embed.proj.weight"]
        assert decayed_adamw["lr"] == 5e-4 and ("language", False, 0.1) not in by_key
        assert all(not g["use_muon"] or all(p.ndim >= 2 for p in g["params"]) for g in groups)

    def test_name_patterns_override_the_default(self):
        config = MuonConfig(muon_params=[r"^lm_head\."], adamw_params=[r"\.o_proj\.", r"layers\.0\.mlp\.experts"])
        uses = config.uses_muon(_meta_model({**FAMILY["moe"], "tie_word_embeddings": False}))
        assert uses["lm_head.weight"] and not uses["layers.1.self_attn.o_proj.weight"]
        assert not uses["layers.0.mlp.experts.gate_up"] and uses["layers.1.mlp.experts.gate_up"]
        assert uses["layers.1.self_attn.q_proj.weight"]

    @pytest.mark.parametrize(
        ("settings", "message"),
        [
            ({"muon_params": ["lm_haed"]}, r"optimizer.muon_params: 'lm_haed' matches no trainable parameter"),
            ({"muon_params": ["norm"]}, r"optimizer.muon_params: 'norm' names .*norm.weight of shape \(64,\)"),
            ({"muon_params": ["q_proj"], "adamw_params": ["layers.0"]}, r"both name layers.0.self_attn.q_proj"),
        ],
    )
    def test_patterns_that_cannot_apply_are_config_errors(self, settings, message):
        with pytest.raises(ConfigError, match=message):
            MuonConfig(**settings).uses_muon(_meta_model(FAMILY["dense"]))

    @pytest.mark.parametrize(
        ("settings", "message"),
        [
            ({"adamw_params": ["(unclosed"]}, r"optimizer.adamw_params: '\(unclosed' is not a regular expression"),
            ({"adjust_lr": "rms"}, "optimizer.adjust_lr: 'rms' is not original or match_rms_adamw"),
            ({"momentum": 1.0}, r"optimizer.momentum must be in \[0, 1\)"),
            ({"ns_steps": 0}, "optimizer.ns_steps must be in 1..99"),
        ],
    )
    def test_bad_settings_are_config_errors(self, settings, message):
        with pytest.raises(ConfigError, match=message):
            MuonConfig(**settings)


class TestFoundInfSkip:
    def test_a_nonfinite_step_changes_no_parameter_and_no_state(self):
        model = _model(TINY_MODEL)
        opt = CONFIG.build(model, torch.device("cpu"))
        _muon_steps(model, opt, range(2))
        params, state = copy.deepcopy(dict(model.named_parameters())), copy.deepcopy(opt.state_dict())
        _set_grads(model, 2)
        next(model.parameters()).grad[0, 0] = float("nan")
        found_inf = optimizer_step_unless_nonfinite(opt, torch.tensor(float("inf")))
        assert found_inf.item() == 1.0
        for name, param in model.named_parameters():
            assert torch.equal(param, params[name]), name
        after = opt.state_dict()["state"]
        assert after.keys() == state["state"].keys() and all(
            torch.equal(after[i][k], v) for i in state["state"] for k, v in state["state"][i].items()
        )
        _set_grads(model, 2)  # a finite step still moves every parameter
        assert optimizer_step_unless_nonfinite(opt, torch.tensor(1.0)).item() == 0.0
        assert all(not torch.equal(param, params[name]) for name, param in model.named_parameters())


class TestExactResume:
    def _fit(self, make_datamodule, root, max_steps, ckpt_path=None, stop_at=None) -> dict[int, float]:
        recorder = LossRecorder()
        callbacks = [recorder] + ([StopAt(stop_at)] if stop_at else [])
        callbacks.append(ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=2, save_last=True))
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_progress_bar=False,
            enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=root, callbacks=callbacks,
            plugins=[AtomicCheckpointIO()],
        )  # fmt: skip
        pl.seed_everything(0)
        module = LanguageModule(
            model=TINY_MODEL, optimizer=MuonConfig(lr=0.02, adamw_lr=5e-3), schedule=ScheduleConfig(warmup_steps=2)
        )
        trainer.fit(module, datamodule=make_datamodule(), ckpt_path=ckpt_path)
        assert isinstance(module.optimizers().optimizer, Muon)
        return recorder.losses

    def test_two_plus_two_equals_four_bitwise(self, make_datamodule, tmp_path):
        uninterrupted = self._fit(make_datamodule, tmp_path / "a", 4)
        self._fit(make_datamodule, tmp_path / "b", 4, stop_at=2)  # "killed" after step 2
        resumed = self._fit(make_datamodule, tmp_path / "b", 4, ckpt_path=str(tmp_path / "b" / "ckpt" / "last.ckpt"))
        assert [resumed[s] for s in (3, 4)] == [uninterrupted[s] for s in (3, 4)]


def _distributed_worker(rank: int, port: int, out_path: str) -> None:
    """FSDP (a dense model over 2 ranks) and EP 2 (a MoE model): :data:`STEPS` Muon steps on the same gradients,
    and a DCP save after step 2 that a fresh model and optimizer load and continue from."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh

    from tests.strategies.test_expert_parallel import _sharded_model
    from xtl.strategies.layout import ParallelLayout
    from xtl.strategies.parallelize import fully_shard_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))

    def fsdp_model(seed: int, spec: dict = MODEL) -> torch.nn.Module:
        model = _model(spec, seed)
        fully_shard_model(model, mesh=mesh)
        return model

    model = fsdp_model(0)
    init = {name: _full(p).detach().clone() for name, p in model.named_parameters()}
    opt = CONFIG.build(model, torch.device("cpu"))
    fsdp = _muon_steps(model, opt, range(2))
    checkpoint = f"{out_path}.dcp"
    dcp.save(
        {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=checkpoint
    )
    fsdp += _muon_steps(model, opt, range(2, STEPS))
    resumed_model = fsdp_model(1)
    resumed_opt = CONFIG.build(resumed_model, torch.device("cpu"))
    state = {
        "model": get_model_state_dict(resumed_model),
        "optim": get_optimizer_state_dict(resumed_model, resumed_opt),
    }
    dcp.load(state, checkpoint_id=checkpoint)
    set_model_state_dict(resumed_model, state["model"])
    set_optimizer_state_dict(resumed_model, resumed_opt, state["optim"])
    resumed = _muon_steps(resumed_model, resumed_opt, range(2, STEPS))

    fused_model = fsdp_model(0, FUSED_MODEL)
    fused_init = {name: _full(p).detach().clone() for name, p in fused_model.named_parameters()}
    fused = _muon_steps(fused_model, CONFIG.build(fused_model, torch.device("cpu")), range(STEPS))

    meshes = ParallelLayout(dp_shard=2, ep=2).build("cpu")
    moe = _sharded_model("qwen3_moe", meshes)
    moe_init = {name: _full(p).detach().clone() for name, p in moe.named_parameters()}
    ep = _muon_steps(moe, CONFIG.build(moe, torch.device("cpu")), range(STEPS))
    expert_shape = tuple(moe.layers[0].mlp.experts.gate_up.to_local().shape)
    if rank == 0:
        torch.save(
            {"init": init, "fsdp": fsdp, "resumed": resumed, "moe_init": moe_init, "ep": ep,
             "expert_local_shape": expert_shape, "fused_init": fused_init, "fused": fused},
            out_path,
        )  # fmt: skip
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def distributed(tmp_path_factory) -> dict:
    """One spawn of 2 gloo processes for every distributed case (what rank 0 saved)."""
    out = tmp_path_factory.mktemp("muon") / "results.pt"
    mp.spawn(_distributed_worker, args=(_free_port(), str(out)), nprocs=2, join=True)
    return torch.load(out)


def _one_process(spec: dict, init: dict[str, torch.Tensor]) -> list[dict]:
    model = _model(spec)
    model.load_state_dict(init, strict=False)
    for name, param in model.named_parameters():
        assert torch.equal(param, init[name]), name
    return _muon_steps(model, CONFIG.build(model, torch.device("cpu")), range(STEPS))


def _max_diff(got: list[dict], want: list[dict]) -> float:
    return max((g[name] - w[name]).abs().max().item() for g, w in zip(got, want, strict=True) for name in w)


@pytest.mark.distributed
class TestDistributed:
    def test_fsdp_equals_one_process(self, distributed):
        """Every 2-D weight is sharded on its rows: Newton-Schulz on a shard alone would differ."""
        reference = _one_process(MODEL, distributed["init"])
        assert _max_diff(distributed["fsdp"], reference) <= 1e-6

    def test_fsdp_of_a_fused_model_equals_one_process(self, distributed):
        """q/k/v of 64, 8 and 8 rows: rank 0 holds 40 of q's rows, rank 1 the rest of q, k and v (a shard across
        matrices, each scaled as its own)."""
        reference = _one_process(FUSED_MODEL, distributed["fused_init"])
        assert _max_diff(distributed["fused"], reference) <= 1e-6

    def test_expert_parallel_equals_one_process(self, distributed):
        from tests.strategies.test_expert_parallel import FAMILIES as EP_FAMILIES

        assert distributed["expert_local_shape"][0] == 2, "each rank holds 2 of the 4 experts"
        reference = _one_process(EP_FAMILIES["qwen3_moe"], distributed["moe_init"])
        assert _max_diff(distributed["ep"], reference) <= 1e-6

    def test_a_dcp_checkpoint_resumes_exactly(self, distributed):
        """Saved after step 2 with DCP (as the FSDP strategy saves), loaded into a differently initialized model
        and a fresh optimizer: step 3 is bitwise the uninterrupted one."""
        for name, want in distributed["fsdp"][-1].items():
            assert torch.equal(distributed["resumed"][-1][name], want), name
