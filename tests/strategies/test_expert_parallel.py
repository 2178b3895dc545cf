"""Expert parallelism on 2 gloo processes: the all-to-all dispatcher and one training step equal the single-process
computation on the same global batch (qwen3_moe, deepseek_v3, gpt_oss)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from tests.train.test_step import _free_port, _micro_batches
from xtl.errors import ConfigError
from xtl.module.dispatcher import AllToAllDispatcher, LocalDispatcher
from xtl.module.experts import GroupedExperts
from xtl.strategies.expert_parallel import shard_experts, split_experts
from xtl.strategies.layout import ParallelLayout
from xtl.strategies.parallelize import fully_shard_model
from xtl.train import resolve_model_config
from xtl.train.step import forward_backward, grad_norm_and_clip

WORLD = 2
BASE = {
    "vocab_size": 97,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "attn_impl": "sdpa",
    "max_position_embeddings": 64,
}
FAMILIES = {
    "qwen3_moe": {**BASE, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 16, "intermediate_size": 48, "norm_topk_prob": True},
    "deepseek_v3": {**BASE, "model_type": "deepseek_v3", "n_routed_experts": 4, "num_experts_per_tok": 2,
                    "moe_intermediate_size": 16, "intermediate_size": 48, "n_group": 2, "topk_group": 1,
                    "first_k_dense_replace": 1, "n_shared_experts": 1, "kv_lora_rank": 16, "q_lora_rank": 24,
                    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8, "num_key_value_heads": 4},
    "gpt_oss": {**BASE, "model_type": "gpt_oss", "num_local_experts": 4, "num_experts_per_tok": 2,
                "intermediate_size": 16, "sliding_window": 4},
}  # fmt: skip
# fp32: the same sums in another order (expert rows grouped by source rank, reductions split over ranks); measured
# max relative error ~1e-7 on the loss and ~1e-6 on gradients of magnitude >= 1e-3.
TOL = {"rtol": 1e-5, "atol": 1e-6}


def _model(family: str, meta: bool = False) -> torch.nn.Module:
    config, _ = resolve_model_config(FAMILIES[family])
    if meta:
        with torch.device("meta"):
            return config.build()
    model = config.build()
    torch.manual_seed(0)
    model.init_weights()
    return model


def _step(model, batches, dp_world_size, group=None):
    result = forward_backward(
        forward=lambda mb: model(seq_ctx=mb[0], labels=mb[1], return_logits=False),
        micro_batches=batches,
        num_tokens=lambda mb: int((mb[1] != -100).sum()),
        dp_world_size=dp_world_size,
        backward=lambda loss: loss.backward(),
        device=torch.device("cpu"),
        group=group,
        gradient_sync=getattr(model, "set_requires_gradient_sync", None),
    )
    loads = torch.stack([out["tokens_per_expert"] for out in result.outputs]).sum(0).float()
    return result, loads


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _dispatcher_case(rank: int, group) -> dict:
    """Rank 0 has no tokens; rank 1 routes only to experts 0 and 1: rank 1 receives nothing, experts 2, 3 idle."""
    experts, hidden, k = 4, 8, 2
    g = torch.Generator().manual_seed(3)
    full = GroupedExperts(experts, hidden, 6)
    torch.nn.init.normal_(full.gate_up, generator=g)
    torch.nn.init.normal_(full.down, generator=g)
    tokens = [0, 7]
    x_all = torch.randn(sum(tokens), hidden, generator=g)
    ids_all = torch.stack([torch.randperm(2, generator=g) for _ in range(sum(tokens))])
    w_all = torch.rand(sum(tokens), k, generator=g)
    start = sum(tokens[:rank])
    x = x_all[start : start + tokens[rank]].clone().requires_grad_()
    local = GroupedExperts(experts // WORLD, hidden, 6)
    with torch.no_grad():
        local.gate_up.copy_(full.gate_up[2 * rank : 2 * rank + 2])
        local.down.copy_(full.down[2 * rank : 2 * rank + 2])
    dispatcher = AllToAllDispatcher(experts, group)
    d = dispatcher.dispatch(x, ids_all[start : start + tokens[rank]], w_all[start : start + tokens[rank]])
    out = dispatcher.combine(local(d.hidden_states, d.tokens_per_expert), d)
    out.pow(2).sum().backward()
    ref_x = x_all.clone().requires_grad_()
    ref_d = LocalDispatcher(experts).dispatch(ref_x, ids_all, w_all)
    ref = LocalDispatcher(experts).combine(full(ref_d.hidden_states, ref_d.tokens_per_expert), ref_d)
    ref.pow(2).sum().backward()
    return {
        "received": int(d.tokens_per_expert.sum()),
        "out": (out.detach(), ref[start : start + tokens[rank]].detach()),
        "x_grad": (x.grad, ref_x.grad[start : start + tokens[rank]]),
        "gate_up_grad": (local.gate_up.grad, full.gate_up.grad[2 * rank : 2 * rank + 2]),
        "down_grad": (local.down.grad, full.down.grad[2 * rank : 2 * rank + 2]),
    }


def _sharded_model(family: str, meshes) -> torch.nn.Module:
    """The family's model with experts split over ``ep`` and FSDP2 over the meshes, initialized from seed 0."""
    model = _model(family, meta=True)
    shard_experts(split_experts(model, meshes.ep), meshes, {})
    fully_shard_model(model, mesh=meshes.fsdp)
    model.materialize("cpu")
    torch.manual_seed(0)
    model.init_weights()
    return model


def _worker(rank: int, port: int, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    meshes = ParallelLayout(dp_shard=WORLD, ep=WORLD).build("cpu")
    results: dict = {"dispatcher": _dispatcher_case(rank, meshes.ep.get_group()), "out_path": out_path}
    batches = _micro_batches()[2 * rank : 2 * rank + 2]  # the four of tests.train.test_step: rank r takes 2r, 2r+1
    for family in FAMILIES:
        model = _sharded_model(family, meshes)
        init = {name: _full(p).detach().clone() for name, p in model.named_parameters()}
        model.save_hf(f"{out_path}.hf.{family}")
        result, loads = _step(model, batches, WORLD, meshes.data_group())
        loss_sum = result.loss_sum.clone()
        dist.all_reduce(loss_sum)
        dist.all_reduce(loads)
        norm = grad_norm_and_clip(list(model.parameters()), None)
        model.update_router_bias(loads, lr=0.01)
        results[family] = {
            "init": init,
            "loss": loss_sum / result.global_tokens,
            "grads": {name: _full(p.grad) for name, p in model.named_parameters()},
            "norm": norm,
            "loads": loads,
            "buffers": {name: _full(b).clone() for name, b in model.named_buffers() if "correction_bias" in name},
            "expert_local_shape": tuple(model.layers[-1].mlp.experts.gate_up.to_local().shape),
        }
    torch.save(results, f"{out_path}.{rank}")
    dist.destroy_process_group()


def _efsdp_worker(rank: int, port: int, out_path: str) -> None:
    """4 ranks, EP=2 x efsdp=2: each rank steps on one of the four micro-batches."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=4)
    meshes = ParallelLayout(dp_shard=4, ep=2).build("cpu")
    results = {}
    for family in FAMILIES:
        model = _sharded_model(family, meshes)
        result, _ = _step(model, _micro_batches()[rank : rank + 1], 4, meshes.data_group())
        loss_sum = result.loss_sum.clone()
        dist.all_reduce(loss_sum)
        grads = {name: _full(p.grad) for name, p in model.named_parameters()}
        results[family] = {"loss": loss_sum / result.global_tokens, "grads": grads}
    if rank == 0:
        torch.save(results, out_path)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ep_results(tmp_path_factory) -> list[dict]:
    """One spawn of 2 processes (EP=2) computing every case below; the results of each rank."""
    out = tmp_path_factory.mktemp("ep") / "results.pt"
    mp.spawn(_worker, args=(_free_port(), str(out)), nprocs=WORLD, join=True)
    return [torch.load(f"{out}.{rank}") for rank in range(WORLD)]


@pytest.mark.distributed
class TestAllToAllDispatcher:
    def test_empty_rank_and_empty_experts_match_the_local_dispatcher(self, ep_results):
        assert [r["dispatcher"]["received"] for r in ep_results] == [7 * 2, 0], "rank 1's experts get no row"
        for rank, results in enumerate(ep_results):
            for key in ("out", "x_grad", "gate_up_grad", "down_grad"):
                got, want = results["dispatcher"][key]
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"rank {rank} {key}")
        assert ep_results[1]["dispatcher"]["gate_up_grad"][0].abs().sum() == 0, "idle experts get zero gradient"


@pytest.mark.distributed
@pytest.mark.parametrize("family", sorted(FAMILIES))
class TestExpertParallelStep:
    def test_experts_are_split_and_init_equals_the_unsharded_model(self, ep_results, family):
        reference = _model(family)
        experts = reference.config.num_routed_experts
        assert ep_results[0][family]["expert_local_shape"][0] == experts // WORLD
        for name, p in reference.named_parameters():
            assert torch.equal(ep_results[0][family]["init"][name], p.detach()), name

    def test_save_hf_is_byte_identical_to_the_unsplit_model(self, ep_results, family, tmp_path):
        directory = Path(ep_results[0]["out_path"] + f".hf.{family}")
        _model(family).save_hf(tmp_path / "ref")
        files = sorted(p.name for p in (tmp_path / "ref").iterdir())
        assert files == sorted(p.name for p in directory.iterdir())
        for name in files:
            assert (directory / name).read_bytes() == (tmp_path / "ref" / name).read_bytes(), name

    def test_loss_and_every_gradient_equal_the_single_process_step(self, ep_results, family):
        reference = _model(family)
        result, loads = _step(reference, _micro_batches(), 1)
        got = ep_results[0][family]
        torch.testing.assert_close(got["loss"], result.loss_sum / result.global_tokens, rtol=1e-6, atol=0)
        for name, p in reference.named_parameters():
            for rank in range(WORLD):
                torch.testing.assert_close(ep_results[rank][family]["grads"][name], p.grad, **TOL, msg=name)
        ref_norm = grad_norm_and_clip(list(reference.parameters()), None)
        torch.testing.assert_close(got["norm"], ref_norm, rtol=1e-6, atol=0)
        assert torch.equal(got["loads"], loads), "global expert loads equal the single-process loads"
        reference.update_router_bias(loads, lr=0.01)
        for name, buffer in reference.named_buffers():
            if "correction_bias" in name:
                assert torch.equal(got["buffers"][name], buffer), f"aux-free bias update differs: {name}"


@pytest.mark.slow
@pytest.mark.distributed
class TestExpertDataParallel:
    def test_ep2_by_efsdp2_on_four_ranks_equals_one_process(self, tmp_path):
        """Catches expert gradients divided by the expert-parallel size instead of the data-parallel size: with
        efsdp = 2 the two differ (with 2 ranks and EP = 2 they are both 2). Loss and every gradient within 1e-5."""
        out = tmp_path / "efsdp.pt"
        mp.spawn(_efsdp_worker, args=(_free_port(), str(out)), nprocs=4, join=True)
        got = torch.load(out)
        for family in FAMILIES:
            reference = _model(family)
            result, _ = _step(reference, _micro_batches(), 1)
            want = result.loss_sum / result.global_tokens
            torch.testing.assert_close(got[family]["loss"], want, rtol=1e-5, atol=0, msg=family)
            for name, p in reference.named_parameters():
                torch.testing.assert_close(got[family]["grads"][name], p.grad, **TOL, msg=f"{family} {name}")


class TestLayoutErrors:
    def test_ep_must_divide_the_world_size(self):
        with pytest.raises(ConfigError, match=r"expert_parallel_size \(3\) must divide the ranks a parameter is"):
            ParallelLayout(dp_shard=4, ep=3)

    def test_ep_must_divide_the_expert_count(self):
        class ThreeRanks:
            def size(self) -> int:
                return 3

        with pytest.raises(
            ValueError, match=r"MoE block 0: 4 routed experts do not split over expert_parallel_size=3"
        ):
            split_experts(_model("qwen3_moe", meta=True), ThreeRanks())
