"""GRPO under context parallelism equals one process: old and reference log-probabilities, loss and every gradient.

Two gloo ranks form one context-parallel group (and the data group, as ``FSDPStrategy`` lays out ``cp = 2`` on two
processes). A packed rollout micro-batch whose sequences cross the split is produced as ``GRPOModule`` produces it
(``_fill_logps``: the old log-probabilities and, with a KL term, the reference's), the policy moves, and the update's
objective (``GRPOModule.step_objective``, normalized by ``forward_backward`` as a training step normalizes it) runs on
each rank's share; the gradients are averaged over the ranks as FSDP averages them. Every loss type and both
importance-sampling levels equal one process forwarding the whole pack; sampling at a temperature and entropies too.
Decoding under the group (whole sequences, ranks in step) is checked with the same ranks: both decode the sequences
one process decodes.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from tests.strategies.test_context_parallel import averaged_over_ranks, join_one_group, spawned_results
from tests.train.test_preference import MODEL
from xtl.rl import GRPOModule, PolicyLossConfig
from xtl.rl.loss import loss_normalizer
from xtl.rl.packing import pack_sequences
from xtl.rl.rollout import SamplingSettings
from xtl.strategies import SingleDevice
from xtl.train.generation import GenerationConfig, generate
from xtl.train.step import forward_backward

CP = 2
# prompt + completion lengths 9+7, 5+12, 4+3, 11+6: 57 tokens -> 58 with padding; the second sequence crosses 29
SEQUENCES = [
    ([3, 4, 5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17, 18]),
    ([20, 21, 22, 23, 24], [25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36]),
    ([40, 41, 42, 43], [44, 45, 46]),
    ([50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60], [61, 62, 63, 64, 65, 66]),
]
ADVANTAGES = [1.0, -0.5, 0.25, -1.0]
CASES = {
    "grpo_kl": dict(loss_type="grpo", beta=0.05),
    "bnpo": dict(loss_type="bnpo"),
    "dr_grpo": dict(loss_type="dr_grpo"),
    "dapo_clip_higher": dict(loss_type="dapo", epsilon_high=0.28),
    "gspo": dict(loss_type="grpo", importance_sampling="sequence", beta=0.05),
}
TOL = {
    "rtol": 1e-5,
    "atol": 1e-6,
}  # fp32, the same sums split over 2 ranks (tests/strategies/test_context_parallel.py)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return spawned_results(_worker, tmp_path_factory.mktemp("grpo_cp"))


@pytest.mark.distributed
class TestGRPOUnderContextParallelism:
    @pytest.mark.parametrize("case", sorted(CASES))
    def test_log_probabilities_loss_and_every_gradient_equal_one_process(self, results, case):
        for rank, got in enumerate(results):
            got, want = got[case]["cp"], got[case]["one"]
            for key in ("old_logps", "ref_logps", "logps", "entropy"):
                if want[key] is not None:
                    torch.testing.assert_close(got[key], want[key], **TOL, msg=f"rank {rank} {key}")
            assert got["items"] == CP * want["items"], "every rank of the group counts the whole normalizer"
            torch.testing.assert_close(got["loss"], want["loss"], rtol=1e-6, atol=1e-7, msg=f"rank {rank}")
            assert abs(float(want["loss"])) > 1e-4, "the policy moved: a loss that is not 0"
            for name, grad in want["grads"].items():
                torch.testing.assert_close(got["grads"][name], grad, **TOL, msg=f"rank {rank} {name}")

    def test_a_group_decodes_the_sequences_of_one_process(self, results):
        for got in results:
            assert got["decoded"]["cp"] == got["decoded"]["one"]


def _module(strategy, objective: PolicyLossConfig, rank: int = 0) -> GRPOModule:
    sampling = SamplingSettings(group_size=2, max_new_tokens=12, temperature=0.7)
    module = GRPOModule(MODEL, objective=objective, sampling=sampling)
    module._trainer = SimpleNamespace(callbacks=[], strategy=strategy, global_step=0, ckpt_path=None, global_rank=rank)
    module.configure_model()
    return module


def _run(module: GRPOModule, world: int, group) -> dict:
    mb = pack_sequences(SEQUENCES, ADVANTAGES)
    loss_type, budget = module.objective.loss_type, module.sampling.max_new_tokens
    mb.num_items = float(loss_normalizer(loss_type, len(SEQUENCES), int(mb.mask.sum()), budget))
    with torch.no_grad():
        module._fill_logps(mb)
        module.model.lm_head.weight.mul_(1.2)  # the policy moves: ratios off 1, a KL off 0
    module.model.zero_grad()
    forward, _ = module.step_objective()
    device_mb = module._on_device(mb)
    result = forward_backward(forward, [device_mb], lambda m: m.num_items, world, lambda x: x.backward(), "cpu", group)
    with torch.no_grad():
        logps, entropy = module._token_logps(module.model, device_mb, with_entropy=True)
    grads = {name: param.grad for name, param in module.model.named_parameters()}
    loss, grads = averaged_over_ranks(result.loss_sum, grads, group, world)
    return {
        "old_logps": mb.old_logps, "ref_logps": mb.ref_logps, "logps": logps, "entropy": entropy,
        "items": float(result.global_tokens), "loss": loss / result.global_tokens, "grads": grads,
    }  # fmt: skip


def _worker(rank: int, port: int, out_path: str) -> None:
    strategy = join_one_group(rank, port)
    mesh = strategy.meshes.cp
    results: dict = {}
    for case, settings in CASES.items():
        objective = PolicyLossConfig(**settings)
        one, two = _module(SingleDevice(), objective), _module(strategy, objective, rank)
        results[case] = {"one": _run(one, 1, None), "cp": _run(two, CP, mesh.get_group())}
    one, two = _module(SingleDevice(), PolicyLossConfig()), _module(strategy, PolicyLossConfig(), rank)
    prompts, config = [prompt for prompt, _ in SEQUENCES], GenerationConfig(max_new_tokens=8, temperature=0.9, seed=3)
    with strategy.whole_sequences(two.model):
        cp = generate(two.model, prompts, config, torch.Generator().manual_seed(5), group=mesh.get_group()).sequences
    single = generate(one.model, prompts, config, torch.Generator().manual_seed(5)).sequences
    results["decoded"] = {"cp": cp, "one": single}
    torch.save(results, f"{out_path}.{rank}")
    dist.destroy_process_group()
