"""Routers, dispatcher and MoE block against hand-computed examples."""

from __future__ import annotations

import math

import pytest
import torch

from xtl.module.dispatcher import LocalDispatcher
from xtl.module.experts import GroupedExperts
from xtl.module.moe_block import MoEBlock
from xtl.module.router import NoAuxTopKRouter, SoftmaxTopKRouter, TopKSoftmaxRouter
from xtl.ops.moe_loss import balance_loss, router_statistics, z_loss


def _set_logits(router, logits: list[float]) -> torch.Tensor:
    """Give a 1-wide router weights equal to ``logits``; return the input ``x = [[1.0]]``."""
    with torch.no_grad():
        router.weight.copy_(torch.tensor(logits)[:, None])
        if router.bias is not None:
            router.bias.zero_()
    return torch.ones(1, 1)


class TestSoftmaxTopKRouter:
    @pytest.mark.parametrize("renormalize", [True, False])
    def test_top_k_choice_and_weights(self, renormalize):
        router = SoftmaxTopKRouter(1, 4, 2, norm_topk_prob=renormalize)
        out = router(_set_logits(router, [2.0, 1.0, 3.0, 0.0]))
        assert out.topk_ids.tolist() == [[2, 0]]
        denom = sum(math.exp(v) for v in (2.0, 1.0, 3.0, 0.0))
        p2, p0 = math.exp(3.0) / denom, math.exp(2.0) / denom
        expected = [p2 / (p2 + p0), p0 / (p2 + p0)] if renormalize else [p2, p0]
        torch.testing.assert_close(out.topk_weights, torch.tensor([expected]))
        torch.testing.assert_close(out.probs.sum(-1), torch.ones(1))
        assert out.topk_weights.dtype == torch.float32

    def test_routes_in_fp32_for_bf16_inputs(self):
        router = SoftmaxTopKRouter(8, 4, 2).to(torch.bfloat16)
        torch.nn.init.normal_(router.weight)
        out = router(torch.randn(5, 8, dtype=torch.bfloat16))
        assert out.logits.dtype == out.topk_weights.dtype == torch.float32


class TestNoAuxTopKRouter:
    LOGITS = [3.0, -3.0, 1.6, 1.5, 1.0, 1.0, -1.0, -1.0]  # groups of 2: sums of sigmoids 1.0, 1.65, 1.46, 0.54

    def test_group_limited_selection_skips_the_best_expert_of_a_weak_group(self):
        router = NoAuxTopKRouter(1, 8, 2, n_group=4, topk_group=2, routed_scaling_factor=2.5)
        out = router(_set_logits(router, self.LOGITS))
        assert sorted(out.topk_ids[0].tolist()) == [2, 3]
        s2, s3 = 1 / (1 + math.exp(-1.6)), 1 / (1 + math.exp(-1.5))
        weights = dict(zip(out.topk_ids[0].tolist(), out.topk_weights[0].tolist()))
        assert weights[2] == pytest.approx(2.5 * s2 / (s2 + s3))
        assert weights[3] == pytest.approx(2.5 * s3 / (s2 + s3))

    def test_without_groups_the_global_top_k_wins(self):
        router = NoAuxTopKRouter(1, 8, 2, n_group=1, topk_group=1)
        out = router(_set_logits(router, self.LOGITS))
        assert sorted(out.topk_ids[0].tolist()) == [0, 2]

    def test_correction_bias_changes_the_choice_but_not_the_weights(self):
        router = NoAuxTopKRouter(1, 8, 2, n_group=4, topk_group=2, norm_topk_prob=False)
        x = _set_logits(router, self.LOGITS)
        router.e_score_correction_bias[4] = 2.0
        out = router(x)
        assert sorted(out.topk_ids[0].tolist()) == [2, 4]
        weights = dict(zip(out.topk_ids[0].tolist(), out.topk_weights[0].tolist()))
        assert weights[4] == pytest.approx(1 / (1 + math.exp(-1.0)))  # unbiased score

    def test_bias_update_direction(self):
        router = NoAuxTopKRouter(1, 4, 1)
        router.update_bias(torch.tensor([10, 0, 5, 5]), lr=0.01)
        assert router.e_score_correction_bias.tolist() == pytest.approx([-0.01, 0.01, 0.0, 0.0])

    def test_bad_grouping_is_rejected(self):
        with pytest.raises(ValueError, match="bad grouping"):
            NoAuxTopKRouter(4, 6, 2, n_group=4, topk_group=2)


class TestTopKSoftmaxRouter:
    def test_softmax_over_the_selected_logits_with_bias(self):
        router = TopKSoftmaxRouter(1, 4, 2)
        x = _set_logits(router, [0.5, 2.0, 1.0, 0.0])
        with torch.no_grad():
            router.bias.copy_(torch.tensor([1.0, 0.0, 0.0, 0.0]))  # expert 0: 1.5 > expert 2: 1.0
        out = router(x)
        assert out.topk_ids.tolist() == [[1, 0]]
        torch.testing.assert_close(out.topk_weights, torch.softmax(torch.tensor([[2.0, 1.5]]), -1))
        torch.testing.assert_close(out.probs, torch.softmax(torch.tensor([[1.5, 2.0, 1.0, 0.0]]), -1))


class TestAuxLosses:
    def test_balance_and_z_loss_against_hand_computed_values(self):
        logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0], [5.0, -5.0]])
        probs = torch.softmax(logits, -1)  # [.5, .5], [.75, .25], padding
        ids = torch.tensor([[0], [0], [1]])
        mask = torch.tensor([True, True, False])
        prob_sum, z_sum, counts = router_statistics(logits, probs, ids, mask)
        torch.testing.assert_close(prob_sum, torch.tensor([1.25, 0.75]))
        assert counts.tolist() == [2, 0]
        torch.testing.assert_close(z_sum, torch.tensor(math.log(2) ** 2 + math.log(4) ** 2))
        # E * sum_e (c_e / N) (P_e / N) = 2 * (2/2 * 1.25/2) = 1.25
        torch.testing.assert_close(balance_loss(prob_sum[None], counts[None], 2), torch.tensor(1.25))
        torch.testing.assert_close(z_loss(z_sum[None], 2), torch.tensor(2.5 * math.log(2) ** 2))

    def test_uniform_routing_gives_k(self):
        prob_sum = torch.full((3, 4), 10.0 / 4)
        counts = torch.full((3, 4), 2 * 10 // 4)
        torch.testing.assert_close(balance_loss(prob_sum, counts, 10), torch.tensor(2.0))

    def test_global_normalization_sums_over_micro_batches(self):
        torch.manual_seed(0)
        probs = torch.softmax(torch.randn(12, 4), -1)
        ids = probs.topk(2, -1).indices
        stats = [router_statistics(probs.log(), probs[s], ids[s]) for s in (slice(0, 5), slice(5, 12))]
        counts = stats[0][2] + stats[1][2]
        parts = sum(balance_loss(p[None], counts[None], 12) for p, _, _ in stats)
        whole = router_statistics(probs.log(), probs, ids)
        torch.testing.assert_close(parts, balance_loss(whole[0][None], whole[2][None], 12))


class TestMoEBlock:
    @pytest.mark.parametrize("hf_mode", ["0", "1"])
    def test_matches_a_per_token_reference_including_idle_experts(self, monkeypatch, hf_mode):
        monkeypatch.setenv("XTL_HF_IMPL", hf_mode)
        torch.manual_seed(0)
        router = SoftmaxTopKRouter(16, 6, 2)
        experts = GroupedExperts(6, 16, 8)
        for p in (router.weight, experts.gate_up, experts.down):
            torch.nn.init.normal_(p, std=0.3)
        with torch.no_grad():
            router.weight[5] = -100.0  # with positive inputs, expert 5 is never chosen
        block = MoEBlock(router, experts)
        x = torch.randn(2, 5, 16).abs()
        out, routing = block(x)
        flat = x.reshape(-1, 16)
        expected = torch.zeros_like(flat)
        for t in range(flat.shape[0]):
            for e, w in zip(routing.topk_ids[t].tolist(), routing.topk_weights[t]):
                gate, up = (experts.gate_up[e] @ flat[t]).chunk(2)
                expected[t] += w * (experts.down[e] @ (torch.nn.functional.silu(gate) * up))
        assert 5 not in routing.topk_ids
        torch.testing.assert_close(out.reshape(-1, 16), expected, atol=1e-5, rtol=1e-5)
        out.sum().backward()
        assert experts.gate_up.grad[5].abs().sum() == 0 and experts.gate_up.grad[:5].abs().sum() > 0

    def test_dispatch_groups_rows_by_expert_then_slot_then_token(self):
        ids = torch.tensor([[2, 0], [0, 1], [2, 1]])
        d = LocalDispatcher(4).dispatch(torch.arange(3.0)[:, None], ids, torch.ones(3, 2))
        assert d.tokens_per_expert.tolist() == [2, 2, 2, 0]
        assert d.hidden_states[:, 0].tolist() == [1.0, 0.0, 1.0, 2.0, 0.0, 2.0]


class TestRoutingReplay:
    ROUTERS = {
        "softmax_topk": lambda: SoftmaxTopKRouter(16, 8, 2),
        "noaux": lambda: NoAuxTopKRouter(16, 8, 2, n_group=2, topk_group=1, routed_scaling_factor=2.5),
        "topk_softmax": lambda: TopKSoftmaxRouter(16, 8, 2),
    }

    @pytest.mark.parametrize("kind", ROUTERS)
    def test_rerouting_to_the_chosen_experts_changes_nothing(self, kind) -> None:
        torch.manual_seed(0)
        router = self.ROUTERS[kind]()
        for param in router.parameters():
            torch.nn.init.normal_(param)
        out = router(torch.randn(5, 16))
        again = router.reroute(out, out.topk_ids)
        assert torch.equal(again.topk_weights, out.topk_weights) and torch.equal(again.topk_ids, out.topk_ids)

    @pytest.mark.parametrize("kind", ROUTERS)
    def test_forced_experts_get_the_routers_weights_with_gradient(self, kind) -> None:
        torch.manual_seed(0)
        router = self.ROUTERS[kind]()
        for param in router.parameters():
            torch.nn.init.normal_(param)
        out = router(torch.randn(5, 16))
        forced = (out.topk_ids + 1) % 8
        rerouted = router.reroute(out, forced)
        assert torch.equal(rerouted.topk_ids, forced)
        # a weighted sum: normalized top-k weights sum to a constant per row, whose gradient is 0 up to rounding
        (rerouted.topk_weights * torch.randn_like(rerouted.topk_weights)).sum().backward()
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0

    @pytest.mark.parametrize("kind", ROUTERS)
    def test_a_replayed_block_weights_the_forced_experts_by_their_own_scores(self, kind) -> None:
        """Forced experts none of which the router would choose: the block's output is the forced experts' outputs
        weighted as the router weights those experts (by hand from its logits), and so is its gradient."""
        torch.manual_seed(0)
        router = self.ROUTERS[kind]()
        for param in router.parameters():
            torch.nn.init.normal_(param)
        block = MoEBlock(router, GroupedExperts(8, 16, 8))
        for param in block.experts.parameters():
            torch.nn.init.normal_(param, std=0.1)
        x = torch.randn(1, 5, 16)
        own = router(x.view(5, 16)).topk_ids
        forced = router(x.view(5, 16)).probs.argsort(dim=-1)[:, :2]  # the two least likely experts of each token
        assert not (forced[:, :, None] == own[:, None, :]).any()
        block.replay_routing(forced)
        out, routing = block(x)
        grad_out = torch.randn_like(out)
        (out * grad_out).sum().backward()
        got = router.weight.grad.clone()
        router.weight.grad = None

        logits = router.fp32_logits(x.view(5, 16))  # the same logits, recomputed with their own graph
        weights = self._forced_weights(kind, router, logits, forced)
        torch.testing.assert_close(routing.topk_weights, weights)
        experts = block.experts
        expected = torch.zeros(5, 16)
        for token in range(5):
            for slot in range(2):
                e = int(forced[token, slot])
                gate, up = (x[0, token] @ experts.gate_up[e].T).chunk(2)
                expected[token] += weights[token, slot] * ((torch.nn.functional.silu(gate) * up) @ experts.down[e].T)
        torch.testing.assert_close(out.view(5, 16), expected, rtol=1e-5, atol=1e-6)
        (expected * grad_out.view(5, 16)).sum().backward()
        torch.testing.assert_close(got, router.weight.grad, rtol=1e-5, atol=1e-6)

    @staticmethod
    def _forced_weights(kind: str, router, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The combine weights of experts ``ids`` by each router's rule, from its logits."""
        if kind == "softmax_topk":  # the experts' softmax probabilities over all experts, renormalized
            chosen = logits.softmax(dim=-1).gather(1, ids)
            return chosen / chosen.sum(dim=-1, keepdim=True)
        if kind == "noaux":  # the experts' sigmoid scores, renormalized and scaled
            chosen = logits.sigmoid().gather(1, ids)
            return chosen / (chosen.sum(dim=-1, keepdim=True) + 1e-20) * router.routed_scaling_factor
        return logits.gather(1, ids).softmax(dim=-1)  # softmax over the experts' logits

    def test_a_block_records_and_replays(self) -> None:
        torch.manual_seed(0)
        router = SoftmaxTopKRouter(16, 8, 2)
        torch.nn.init.normal_(router.weight)
        block = MoEBlock(router, GroupedExperts(8, 16, 8))
        for param in block.experts.parameters():
            torch.nn.init.normal_(param, std=0.1)
        x = torch.randn(1, 5, 16)
        block.record_routing(True)
        _, natural = block(x)
        block.record_routing(False)
        assert torch.equal(block.recorded, natural.topk_ids)
        block.replay_routing((natural.topk_ids + 3) % 8)
        _, replayed = block(x)
        assert torch.equal(replayed.topk_ids, (natural.topk_ids + 3) % 8)
        block.replay_routing(None)
        assert torch.equal(block(x)[1].topk_ids, natural.topk_ids)
