"""GRPO through an agent loop: appended tokens are context but not loss, segments train with their trajectory's
advantage, and a run with multi-turn tool rollouts trains, logs its turns and resumes exactly mid-batch."""

from __future__ import annotations

import torch

from tests.rl.test_module import _fit, _module
from tests.train.test_base import StopAt
from xtl.rl import LocalRolloutEngine, PolicyLossConfig
from xtl.rl.agent import Segment, ToolLoop
from xtl.rl.buffer import Sample
from xtl.rl.loss import policy_loss
from xtl.rl.packing import RLMicroBatch, cut_micro_batches


def _sample() -> Sample:
    """Prompt [1, 2]; sampled [3, 4], appended [5, 6, 7], sampled [8]; an earlier segment [9] -> [10, 11]."""
    return Sample([1, 2], [3, 4, 5, 6, 7, 8], "stop", loss_mask=[1, 1, 0, 0, 0, 1],
                  earlier=[Segment([9], [10, 11], [1, 1], None)])  # fmt: skip


class TestMaskedTokens:
    def test_appended_tokens_are_labelled_but_carry_no_loss(self) -> None:
        (mb,) = cut_micro_batches([(_sample(), 0.5)], 1, "dapo", max_new_tokens=8)
        assert mb.sequences == [([9], [10, 11]), ([1, 2], [3, 4, 5, 6, 7, 8])]  # each segment a sequence
        assert mb.mask.tolist() == [[1, 1, 0, 0, 0, 0], [1, 1, 0, 0, 0, 1]]
        assert mb.advantages.tolist() == [0.5, 0.5] and mb.num_items == 5  # dapo: the sampled tokens
        again = RLMicroBatch.from_state(mb.state())
        assert again.mask.tolist() == mb.mask.tolist() and again.loss_masks == mb.loss_masks

    def test_the_loss_and_its_gradient_ignore_the_appended_tokens(self) -> None:
        (mb,) = cut_micro_batches([(_sample(), 1.0)], 1, "grpo", max_new_tokens=8)
        logps = torch.randn(mb.mask.shape, dtype=torch.float64, requires_grad=True)
        config = PolicyLossConfig(loss_type="grpo")
        out = policy_loss(logps * mb.mask, (logps * mb.mask).detach() - 0.1, mb.advantages.double(), mb.mask, config)
        out.loss_sum.backward()
        assert torch.all(logps.grad[mb.mask == 0] == 0) and torch.all(logps.grad[mb.mask == 1] != 0)
        moved = logps.detach().clone()
        moved[mb.mask == 0] += 5.0  # what the policy thinks of a tool result changes nothing
        again = policy_loss(moved * mb.mask, (logps * mb.mask).detach() - 0.1, mb.advantages.double(), mb.mask, config)
        assert torch.equal(again.loss_sum, out.loss_sum.detach())


class CallsFirst(LocalRolloutEngine):
    """The local sampler, except that a conversation's first turn calls the calculator (a random policy rarely
    writes a call): every trajectory has a sampled call, a tool turn and a sampled answer."""

    CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'

    def __init__(self, model, tokenizer) -> None:
        super().__init__(model)
        self.call_ids = [*tokenizer(self.CALL, add_special_tokens=False)["input_ids"],
                         tokenizer.convert_tokens_to_ids("<|im_end|>")]  # fmt: skip
        self.response_marker = tokenizer.convert_tokens_to_ids("<tool_response>")

    def generate(self, prompts, sampling, stop_token_ids=()):
        first = [i for i, p in enumerate(prompts) if self.response_marker not in p]
        later = [i for i in range(len(prompts)) if i not in first]
        sampled = iter(super().generate([prompts[i] for i in later], sampling, stop_token_ids))
        out = []
        for i, prompt in enumerate(prompts):
            if i in first:
                out.append(self._call(prompt))
            else:
                out.append(next(sampled))
        return out

    def _call(self, prompt):
        from xtl.rl import Rollout

        return Rollout(list(prompt), list(self.call_ids), "stop")


def _agent_module(**kwargs):
    module = _module(agent=ToolLoop(["xtl.agent_tools.calculator"], max_turns=2), **kwargs)
    module._start_engine = lambda: CallsFirst(module.model, module.trainer.datamodule.load_tokenizer())
    return module


class TestToolLoopTraining:
    def test_trains_logs_its_turns_and_resumes_mid_batch_exactly(self, tmp_path) -> None:
        whole, _ = _fit(_agent_module(), 4, tmp_path / "a")
        assert whole[1]["rollout/tool_calls"] == 1.0 and whole[1]["rollout/turns"] == 2.0
        assert whole[1]["rollout/failed"] == 0 and whole[1]["rollout/completed"] > 0, "every trajectory judged"
        assert all(torch.isfinite(torch.tensor(m["train/loss"])) for m in whole.values())
        first, trainer = _fit(_agent_module(), 4, tmp_path / "b", [StopAt(3)], every=3)
        assert trainer.lightning_module._pending, "stopped between the updates of a batch"
        resumed, _ = _fit(_agent_module(), 4, tmp_path / "b", ckpt_path=str(tmp_path / "b" / "ckpt" / "last.ckpt"))
        assert [first[s]["train/loss"] for s in (1, 2, 3)] == [whole[s]["train/loss"] for s in (1, 2, 3)]
        assert resumed[4]["train/loss"] == whole[4]["train/loss"]


class TestValidation:
    def test_held_out_prompts_run_through_the_loop_greedily(self, tmp_path) -> None:
        import lightning.pytorch as pl

        from tests.rl.test_module import _datamodule
        from xtl.rl.rollout import GreedyEngine

        class Recording(ToolLoop):
            engines: list = []

            def rollout(self, rows, engine, sampling, context):
                Recording.engines.append(type(engine))
                trajectories = super().rollout(rows, engine, sampling, context)
                for t in trajectories:
                    t.response = "5"  # every greedy answer, as the judger will see it
                return trajectories

        module = _module(agent=Recording(["xtl.agent_tools.calculator"]))
        trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                             default_root_dir=tmp_path, limit_val_batches=1)  # fmt: skip
        metrics = trainer.validate(module, datamodule=_datamodule(val=True), verbose=False)[0]
        assert Recording.engines == [GreedyEngine]
        assert metrics["val/reward"] == 1.0  # varied_reward("5") = ord("5") % 3 / 2 = 1
        assert 0 < metrics["val/exact_match"] < 1  # some held-out answers are 5


class TestComposes:
    def test_dynamic_sampling_with_leftover_trajectories_resumes_exactly(self, tmp_path) -> None:
        settings = dict(rollout=dict(dynamic_sampling=True, oversample=3.0, max_rounds=2, max_staleness=4))
        whole, _ = _fit(_agent_module(**settings), 4, tmp_path / "a")
        _, trainer = _fit(_agent_module(**settings), 4, tmp_path / "b", [StopAt(3)], every=3)
        groups = trainer.lightning_module.buffer.groups
        assert groups and all(s.loss_mask is not None for g in groups for s in g.samples), "masked leftovers"
        resumed, _ = _fit(_agent_module(**settings), 4, tmp_path / "b", ckpt_path=str(tmp_path / "b/ckpt/last.ckpt"))
        assert resumed[4]["train/loss"] == whole[4]["train/loss"]

    def test_routing_replay_routes_the_updates_of_multi_turn_rollouts(self, tmp_path) -> None:
        from tests.rl.test_module import TestRoutingReplay, varied_reward
        from xtl.rl import FunctionJudger, GRPOModule, RolloutSettings, SamplingSettings, UpdateSettings
        from xtl.train import AdamWConfig, ScheduleConfig

        module = GRPOModule(
            TestRoutingReplay.MOE, judger=FunctionJudger(varied_reward),
            sampling=SamplingSettings(group_size=4, max_new_tokens=6), rollout=RolloutSettings(prompts_per_step=3),
            updates=UpdateSettings(mini_batches=2), routing_replay=True, optimizer=AdamWConfig(lr=5e-2),
            schedule=ScheduleConfig(warmup_steps=0, kind="constant"),
            agent=ToolLoop(["xtl.agent_tools.calculator"], max_turns=2),
        )  # fmt: skip
        module._start_engine = lambda: CallsFirst(module.model, module.trainer.datamodule.load_tokenizer())
        steps, _ = _fit(module, 2, tmp_path)
        assert steps[1]["rollout/failed"] == 0 and steps[1]["rollout/tool_calls"] == 1.0
        assert steps[1]["train/ratio"] == 1.0  # the first update is routed as the rollout's forward was

    def test_the_vllm_engine_gets_prompt_ids_and_gives_its_logprobs(self) -> None:
        from tests.rl.agent.scripted import tiny_chat
        from tests.rl.test_rollout import FakeLLM, _vllm
        from xtl.rl import SamplingSettings
        from xtl.rl.agent import AgentContext

        chat, llm = tiny_chat(), FakeLLM()
        rows = [{"prompt": [{"role": "user", "content": "What is 2+3?"}], "answer": "5"}]
        loop = ToolLoop(["xtl.agent_tools.calculator"])
        (trajectory,) = loop.rollout(rows, _vllm(llm), SamplingSettings(max_new_tokens=3), AgentContext(chat))
        segment = trajectory.segments[0]
        assert segment.prompt_ids == chat.prompt_ids(rows[0]["prompt"], loop.schemas)
        assert segment.logprobs == [-0.1 * t for t in segment.response_ids]  # the engine's, token by token
