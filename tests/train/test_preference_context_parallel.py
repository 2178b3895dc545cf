"""Every preference objective under context parallelism equals one process: loss and every gradient.

Two gloo ranks form one context-parallel group (and the data group, as ``FSDPStrategy`` lays out ``cp = 2`` on two
processes). Each rank scores its half of a pack whose documents cross the split and whose length needs padding, and
runs the objective's step (``PreferenceModule.step_objective``, normalized by ``forward_backward`` as a training step
normalizes it); the gradients are averaged over the ranks as FSDP averages them. They equal one process's forward of
the whole pack, for every loss type: those that read the responses' token counts (IPO, SimPO, ORPO's NLL term, the
RPO term), KTO and APO-zero on unpaired rows, and DPO with a precomputed reference (the table computed on the shares,
one rank of the group contributing each pair).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from tests.strategies.test_context_parallel import averaged_over_ranks, join_one_group, spawned_results
from tests.train.test_preference import MODEL, _pairs
from xtl.data.collate import split_for_context_parallel
from xtl.strategies import SingleDevice
from xtl.train import PreferenceLoss, PreferenceModule
from xtl.train.preference import _pair_logps, pair_count
from xtl.train.reference_cache import compute_reference_table, pair_offsets
from xtl.train.step import forward_backward

CP = 2
LENGTHS = [9, 14, 12, 7, 20, 13]  # 75 tokens -> 76: pairs 1 and 2 cross the split at 38
CASES = {
    "sigmoid": dict(loss_type="sigmoid", beta=0.5),
    "sigmoid_rpo": dict(loss_type="sigmoid", beta=0.5, rpo_alpha=0.7),
    "hinge": dict(loss_type="hinge", beta=0.5),
    "ipo": dict(loss_type="ipo", beta=0.3),
    "robust": dict(loss_type="robust", beta=0.5, label_smoothing=0.1),
    "simpo": dict(loss_type="simpo", beta=2.0, gamma=0.3),
    "orpo": dict(loss_type="orpo", beta=0.2),
    "kto": dict(loss_type="kto", beta=0.5),
    "apo_zero_unpaired": dict(loss_type="apo_zero_unpaired", beta=0.3),
    "sigmoid_precomputed": dict(loss_type="sigmoid", beta=0.5),
}
# fp32, the same sums split over 2 ranks (as tests/strategies/test_context_parallel.py): ~1e-7 relative measured
TOL = {"rtol": 1e-5, "atol": 1e-6}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return spawned_results(_worker, tmp_path_factory.mktemp("preference_cp"))


@pytest.mark.distributed
@pytest.mark.parametrize("case", sorted(CASES))
class TestPreferenceUnderContextParallelism:
    def test_loss_and_every_gradient_equal_one_process(self, results, case):
        for rank, got in enumerate(results):
            got = got[case]
            assert got["pairs"] == CP * (len(LENGTHS) // 2), "every rank of the group counts the whole pack's pairs"
            torch.testing.assert_close(got["loss"], got["want_loss"], rtol=1e-6, atol=0, msg=f"rank {rank}")
            assert got["grads"], "gradients were compared"
            for name, grad in got["grads"].items():
                torch.testing.assert_close(grad, got["want_grads"][name], **TOL, msg=f"rank {rank} {name}")
            if "table" in got:
                torch.testing.assert_close(got["table"], got["want_table"], rtol=1e-6, atol=1e-6)


def _micro_batch(unpaired: bool):
    mb = _pairs(LENGTHS)
    if unpaired:  # rows labeled desirable, undesirable, desirable (each tag on the row's two documents)
        mb = dataclasses.replace(mb, doc_tags=(1, 1, 0, 0, 1, 1))
    return mb


def _module(strategy, objective: PreferenceLoss, reference: str) -> PreferenceModule:
    module = PreferenceModule(MODEL, objective=objective, reference=reference)
    module._trainer = SimpleNamespace(callbacks=[], strategy=strategy, global_step=0, ckpt_path=None)
    module.configure_model()
    return module


def _step(module: PreferenceModule, micro_batches: list, world: int, group) -> tuple[torch.Tensor, dict]:
    """The step's loss (over every rank) and gradients (averaged over the ranks, as FSDP reduces them)."""
    module.model.zero_grad()
    forward, _ = module.step_objective(micro_batches)
    result = forward_backward(forward, micro_batches, pair_count, world, lambda loss: loss.backward(), "cpu", group)
    grads = {name: param.grad for name, param in module.model.named_parameters()}
    loss, grads = averaged_over_ranks(result.loss_sum, grads, group, world)
    return loss / result.global_tokens, grads, int(result.global_tokens)


def _table(module: PreferenceModule, mb, collate, group, contributes: bool) -> torch.Tensor:
    offsets = pair_offsets(SimpleNamespace(pack_offsets=[0, len(LENGTHS)]))
    cp_group = module.parallelizer.meshes.cp_group()
    with module.reference.starting_policy(module.model, moved=False) as (model, _):
        table = compute_reference_table([mb], offsets, collate, lambda m: _pair_logps(model, m, cp_group),
                                        group=group, contributes=contributes)  # fmt: skip
    return table


def _worker(rank: int, port: int, out_path: str) -> None:
    strategy = join_one_group(rank, port)
    mesh = strategy.meshes.cp
    results = {}
    for case, settings in CASES.items():
        objective = PreferenceLoss(**settings)
        reference = "precomputed" if case.endswith("precomputed") else "auto"
        mb = _micro_batch(objective.unpaired)
        share = split_for_context_parallel(mb, rank, CP)
        one, two = _module(SingleDevice(), objective, reference), _module(strategy, objective, reference)
        record = {}
        if reference == "precomputed":
            record["want_table"] = _table(one, mb, lambda m: m, None, True).logps
            record["table"] = _table(two, mb, lambda m: split_for_context_parallel(m, rank, CP), mesh.get_group(),
                                     rank == 0).logps  # fmt: skip
            one.precomputed.tables["train"] = _table(one, mb, lambda m: m, None, True)
            two.precomputed.tables["train"] = _table(two, mb, lambda m: split_for_context_parallel(m, rank, CP),
                                                     mesh.get_group(), rank == 0)  # fmt: skip
        with torch.no_grad():  # the policy moves away from its reference
            for module in (one, two):
                module.model.lm_head.weight.mul_(1.3)
        want_loss, want_grads, _ = _step(one, [mb], 1, None)
        loss, grads, pairs = _step(two, [share], CP, mesh.get_group())
        results[case] = {**record, "loss": loss, "grads": grads, "pairs": pairs, "want_loss": want_loss,
                         "want_grads": want_grads}  # fmt: skip
    torch.save(results, f"{out_path}.{rank}")
    dist.destroy_process_group()
