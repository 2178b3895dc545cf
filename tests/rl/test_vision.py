"""RL on vision-language policies: prompt rows with images, cached decoding with images, packed updates with images.

- Greedy decoding of a tiny Qwen3-VL / Qwen3-VL-MoE with images equals transformers' ``generate``: the same tokens
  and, with the HF-parity ops and the padded prefill, bitwise the same logits (left-padded batch of two prompts with
  images of different grids); the packed prefill gives the same tokens, logits within ``PACKED_ATOL``.
- The update's recomputed log-probabilities of a rollout equal the sampler's for the same weights within
  ``LOGP_ATOL`` (fp32), and with other images in the pack they do not (by more than ``IMAGE_EFFECT``).
- Routing replay on Qwen3-VL-MoE records one route per token of the pack, vision tokens included, and the update is
  dispatched on them.
- The tool loop and partial rollouts pass each prompt's images with every engine call (turns, continuations); Ray
  actors sample prompts with images as the local sampler does.
- The vLLM engine's requests: one placeholder per image and the decoded images as ``multi_modal_data``.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from tests.model.vlm import IMAGE, PATCH_DIM, VISION_END, VISION_START, load_pair, save_tiny_vlm
from tests.rl.test_module import DispatchLog, _fit, varied_reward
from tests.rl.test_rollout import FakeLLM
from xtl.data import SourceSpec, XTLDataModule
from xtl.data.item import DataError
from xtl.data.multimodal import ImageProcessorConfig, VisionChatTokenizeFn
from xtl.data.prompts import read_prompt_rows
from xtl.errors import ConfigError
from xtl.rl import (
    FunctionJudger,
    GRPOModule,
    LocalRolloutEngine,
    OnlineDPOModule,
    RolloutSettings,
    SamplingSettings,
    UpdateSettings,
    VLLMRolloutEngine,
    VLLMSettings,
)
from xtl.rl.agent import BlackBoxAgentLoop, ToolLoop
from xtl.rl.agent.chat import ChatFormat
from xtl.rl.agent.loop import AgentContext
from xtl.rl.packing import RLMicroBatch, pack_sequences
from xtl.rl.rollout import GreedyEngine, Rollout
from xtl.rl.vision import PromptImages, PromptVision, collapse_placeholders
from xtl.train import AdamWConfig, ScheduleConfig
from xtl.train.generation import GenerationConfig, generate
from xtl.train.scorer import pack_values, score_tokens
from xtl.utils import resolve_path

TINY_VLM = Path(resolve_path("tiny:../tiny_vlm"))
SETTINGS = dict(patch_size=8, merge_size=2, temporal_patch_size=2, min_pixels=4096, max_pixels=4096)
_TEXT = dict(
    vocab_size=1600, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=16, max_position_embeddings=256, attn_impl="sdpa",
    rope={"rope_type": "default", "rope_theta": 10000.0, "params": {"mrope_section": [4, 2, 2]}},
)  # fmt: skip
_VISION = dict(
    depth=2, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=8, spatial_merge_size=2,
    temporal_patch_size=2, out_hidden_size=32, num_position_embeddings=16, deepstack_visual_indexes=[0],
)  # fmt: skip
_TOKENS = dict(image_token_id=1544, vision_start_token_id=1542, vision_end_token_id=1543, video_token_id=1545)
MODEL_VL = {"model_type": "qwen3_vl", **_TOKENS, "text_config": _TEXT, "vision_config": _VISION}
MODEL_VL_MOE = {
    "model_type": "qwen3_vl_moe", **_TOKENS, "vision_config": _VISION,
    "text_config": {**_TEXT, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16},
}  # fmt: skip
PACKED_ATOL = 1e-5  # fp32 logits, packed prefill vs transformers' padded batch
LOGP_ATOL = 1e-5  # fp32, the update's log-probabilities vs the sampler's (measured: ~2e-7)
IMAGE_EFFECT = 1e-3  # with other images some log-probability moves by more than this


def _tokenizer():
    return AutoTokenizer.from_pretrained(TINY_VLM)


def _vision() -> PromptVision:
    return PromptVision(_tokenizer(), ImageProcessorConfig(**SETTINGS), "chatml")


def _rows(count: int = 4) -> list[dict]:
    return read_prompt_rows([SourceSpec("tiny:../tiny_vlm/eval.jsonl", kind="prompt")])[:count]


def _datamodule(val: bool = False) -> XTLDataModule:
    spec = SourceSpec("tiny:../tiny_vlm/train.jsonl", kind="prompt")
    heldout = {"heldout": [SourceSpec("tiny:../tiny_vlm/eval.jsonl", kind="prompt")]} if val else None
    return XTLDataModule(
        [spec], tokenizer="tiny:../tiny_vlm", template="chatml", image_processor=SETTINGS, val_sources=heldout,
        predict_batch_size=8,
    )  # fmt: skip


def _module(model: dict = MODEL_VL, cls: type = GRPOModule, **kwargs):
    settings = dict(
        judger=FunctionJudger(varied_reward),
        sampling=SamplingSettings(group_size=kwargs.pop("group_size", 4), max_new_tokens=4),
        rollout=RolloutSettings(**{"prompts_per_step": 2, **kwargs.pop("rollout", {})}),
        updates=UpdateSettings(**{"mini_batches": 2 if cls is GRPOModule else 1, **kwargs.pop("updates", {})}),
        optimizer=AdamWConfig(lr=1e-2, weight_decay=0.0),
        schedule=ScheduleConfig(warmup_steps=0, kind="constant"),
    )
    return cls(model, **{**settings, **kwargs})


def _model(config: dict = MODEL_VL):
    from xtl.train.model_spec import resolve_model_config

    with torch.device("meta"):
        model = resolve_model_config(config)[0].build()
    model.materialize("cpu")
    torch.manual_seed(0)
    model.init_weights()
    return model.float().eval()


class RecordingEngine(LocalRolloutEngine):
    """The local engine, recording each call's prompts and images."""

    def __init__(self, model, logprobs: bool = False) -> None:
        super().__init__(model, logprobs=logprobs)
        self.calls: list[tuple[list[list[int]], list[PromptImages | None] | None]] = []

    def generate(self, prompts, sampling, stop_token_ids=(), images=None):
        self.calls.append(([list(p) for p in prompts], None if images is None else list(images)))
        return super().generate(prompts, sampling, stop_token_ids, images)


class TestPromptRows:
    def test_image_paths_resolve_relative_to_the_file_and_are_listed(self, tmp_path) -> None:
        (tmp_path / "pics").mkdir()
        (tmp_path / "pics" / "a.png").write_bytes((TINY_VLM / "images" / "0000.png").read_bytes())
        question = [{"type": "image", "image": "pics/a.png"}, {"type": "text", "text": "What shape are they?"}]
        rows = [{"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": "circle"}]},
                {"prompt": "What is 2 + 2?", "answer": "4"}]  # fmt: skip
        path = tmp_path / "rows.jsonl"
        path.write_text("\n".join(json.dumps(r) for r in rows))
        image_row, text_row = read_prompt_rows([SourceSpec(str(path), kind="prompt")])
        where = str((tmp_path / "pics" / "a.png").resolve())
        assert image_row["images"] == [where] and image_row["answer"] == "circle"
        assert image_row["prompt"][0]["content"][0] == {"type": "image", "image": where}
        assert "images" not in text_row
        matched = read_prompt_rows([SourceSpec(str(path), kind="prompt", match="^What shape")])
        assert [r["answer"] for r in matched] == ["circle"], "match reads the text parts"

    def test_a_missing_image_names_the_row(self, tmp_path) -> None:
        row = {"messages": [{"role": "user", "content": [{"type": "image", "image": "gone.png"}]}]}
        path = tmp_path / "rows.jsonl"
        path.write_text(json.dumps(row))
        with pytest.raises(DataError, match=r"rows.jsonl:1: image .*gone.png does not exist"):
            read_prompt_rows([SourceSpec(str(path), kind="prompt")])


class TestRendering:
    def test_prompts_render_as_the_sft_path_encodes_them(self) -> None:
        tokenizer, vision = _tokenizer(), _vision()
        chat = ChatFormat(tokenizer, "chatml", vision=vision)
        sft = VisionChatTokenizeFn(tokenizer, ImageProcessorConfig(**SETTINGS), template="chatml")
        for row in _rows():
            ids = chat.prompt_ids(row["prompt"])
            assert ids == list(sft.encode({"messages": row["prompt"]}, add_generation_prompt=True)["input_ids"])
            assert ids.count(vision.image_token_id) == 16, "64x64 pixels, 8x8 patches, merged 2x2"
            images = vision.images(row["images"])
            assert images.pixel_values.shape == (64, 3 * 2 * 8 * 8) and images.image_grid_thw.tolist() == [[1, 8, 8]]
            assert vision.images(row["images"]) is images, "a prompt's images are processed once"


@pytest.mark.parametrize("variant", ["qwen3_vl", "qwen3_vl_moe"], scope="class")
class TestGenerationParity:
    @pytest.fixture(scope="class")
    def pair(self, tmp_path_factory, variant):
        return load_pair(save_tiny_vlm(variant, torch.float32, tmp_path_factory.mktemp("vlm")), torch.float32)

    @staticmethod
    def _batch() -> tuple[list[list[int]], list[dict[str, torch.Tensor]]]:
        g = torch.Generator().manual_seed(3)
        grids = [torch.tensor([[1, 4, 6]]), torch.tensor([[1, 4, 4], [1, 4, 4]])]
        prompts = [
            [5, 6, VISION_START, *[IMAGE] * 6, VISION_END, 7, 8, 9],
            [11, VISION_START, *[IMAGE] * 4, VISION_END, 12, VISION_START, *[IMAGE] * 4, VISION_END, 13, 14, 15, 16],
        ]
        images = [{"pixel_values": torch.randn(int(grid.prod(-1).sum()), PATCH_DIM, generator=g),
                   "image_grid_thw": grid} for grid in grids]  # fmt: skip
        return prompts, images

    def _transformers(self, hf, prompts, images, steps):
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        out = hf.generate(
            input_ids=ids, attention_mask=mask, mm_token_type_ids=(ids == IMAGE).int(),
            pixel_values=torch.cat([i["pixel_values"] for i in images]),
            image_grid_thw=torch.cat([i["image_grid_thw"] for i in images]),
            max_new_tokens=steps, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0,
        )  # fmt: skip
        return out.sequences[:, width:].tolist(), torch.stack(out.logits, dim=1)

    @pytest.mark.usefixtures("hf_impl")
    def test_greedy_decoding_with_images_equals_transformers(self, pair, variant) -> None:
        hf, model = pair
        prompts, images = self._batch()
        want, want_logits = self._transformers(hf, prompts, images, 10)
        padded = generate(model, prompts, GenerationConfig(max_new_tokens=10, prefill="padded"), images=images,
                          output_logits=True)  # fmt: skip
        assert padded.sequences == want
        assert torch.equal(torch.stack(padded.logits, dim=1), want_logits), "bitwise with the HF-parity ops"
        packed = generate(model, prompts, GenerationConfig(max_new_tokens=10), images=images, output_logits=True)
        assert packed.sequences == want
        torch.testing.assert_close(torch.stack(packed.logits, dim=1), want_logits, rtol=0, atol=PACKED_ATOL)

    def test_a_text_prompt_beside_one_with_images_decodes_as_alone(self, pair, variant) -> None:
        _, model = pair
        prompts, images = self._batch()
        config = GenerationConfig(max_new_tokens=8)
        mixed = generate(model, [prompts[0], [21, 22, 23]], config, images=[images[0], None]).sequences
        assert mixed[1] == generate(model, [[21, 22, 23]], config).sequences[0]
        assert mixed[0] == generate(model, [prompts[0]], config, images=[images[0]]).sequences[0]


@pytest.mark.parametrize("config", [MODEL_VL, MODEL_VL_MOE], ids=["qwen3_vl", "qwen3_vl_moe"])
class TestUpdateLogps:
    def test_the_update_scores_the_rollout_as_the_sampler_did(self, config) -> None:
        tokenizer, vision = _tokenizer(), _vision()
        chat = ChatFormat(tokenizer, "chatml", vision=vision)
        model = _model(config)
        rows = _rows()
        prompts = [chat.prompt_ids(row["prompt"]) for row in rows]
        images = [vision.images(row["images"]) for row in rows]
        rollouts = LocalRolloutEngine(model, logprobs=True).generate(
            prompts, SamplingSettings(max_new_tokens=5, temperature=0.7, seed=1), images=images
        )
        sequences = [(r.prompt_ids, r.response_ids) for r in rollouts]
        for pixels, same in ((images, True), (images[1:] + images[:1], False)):  # the rollout's images, others
            mb = pack_sequences(sequences, [1.0] * len(rows), images=pixels)
            with torch.no_grad():
                scores = score_tokens(model, mb.batch.seq_ctx, mb.batch.labels, temperature=0.7)
            logps = pack_values(scores, mb.positions)[mb.rows] * mb.mask
            sampled = torch.zeros_like(logps)
            for i, rollout in enumerate(rollouts):
                sampled[i, : len(rollout.logprobs)] = torch.tensor(rollout.logprobs)
            gap = (logps - sampled).abs().max().item()
            if same:
                assert gap < LOGP_ATOL, f"the update's log-probabilities vs the sampler's: {gap}"
                assert mb.images == [row["images"] for row in rows]
            else:
                assert gap > IMAGE_EFFECT, "with other images the log-probabilities differ"

    def test_a_checkpointed_micro_batch_reloads_its_images(self, config) -> None:
        vision, rows = _vision(), _rows(2)
        images = [vision.images(rows[0]["images"]), None, vision.images(rows[1]["images"])]
        mb = pack_sequences([([1542, *[1544] * 16, 1543, 7], [8]), ([5], [6]), ([1542, *[1544] * 16, 1543], [9])],
                            [1.0, 0.0, -1.0], images=images)  # fmt: skip
        state = mb.state()
        assert state["images"] == [rows[0]["images"], None, rows[1]["images"]]
        restored = RLMicroBatch.from_state(state, _vision())
        for key in ("pixel_values", "image_grid_thw"):
            assert torch.equal(restored.batch.seq_ctx.extras[key], mb.batch.seq_ctx.extras[key])
        with pytest.raises(ValueError, match="needs the policy's PromptVision"):
            RLMicroBatch.from_state(state)


def _capture_updates(module: GRPOModule) -> list:
    captured = []
    build = module.build_updates

    def recording(groups, stats):
        updates = build(groups, stats)
        captured.append(list(updates))  # training pops the pending updates
        return updates

    module.build_updates = recording
    return captured


class TestTraining:
    def test_old_logps_recomputed_at_production_equal_the_samplers(self, tmp_path) -> None:
        module = _module()
        module._start_engine = lambda: RecordingEngine(module.model, logprobs=True)
        captured = _capture_updates(module)
        steps, _ = _fit(module, 1, tmp_path, datamodule=_datamodule())
        second = captured[0][1]  # the second update's old log-probabilities are computed when the batch is produced
        for mb in second:
            assert mb.batch.seq_ctx.extras["pixel_values"].shape[0] == 64 * len(mb.sequences)
            gap = ((mb.old_logps - mb.sampling_logps) * mb.mask).abs().max().item()
            assert gap < LOGP_ATOL, gap
        assert steps[1]["train/ratio"] == 1.0 and torch.isfinite(torch.tensor(steps[1]["train/loss"]))

    def test_routing_replay_covers_the_vision_tokens(self, tmp_path) -> None:
        log = DispatchLog()
        module = _module(MODEL_VL_MOE, routing_replay=True)
        captured = _capture_updates(module)
        steps, _ = _fit(module, 2, tmp_path, [log], datamodule=_datamodule())
        for update in captured[0]:
            for mb in update:
                tokens = mb.batch.seq_ctx.seq_len
                vision = int((mb.batch.seq_ctx.input_ids == 1544).sum())
                assert vision == 16 * len(mb.sequences) and len(mb.routed_experts) == 2
                assert all(ids.shape == (tokens, 2) for ids in mb.routed_experts), "a route per token of the pack"
        assert steps[1]["train/ratio"] == 1.0
        recorded, second = log.dispatched[-3], log.dispatched[-1]
        assert torch.equal(second, recorded), "the second update is routed as recorded"

    def test_the_tool_loop_keeps_the_images_across_turns(self, tmp_path) -> None:
        """A scripted first turn calls the calculator; the second turn's context holds the prompt's placeholders
        once and goes to the engine with the same images."""
        tokenizer, vision = _tokenizer(), _vision()
        chat = ChatFormat(tokenizer, "chatml", stop_token_ids=(tokenizer.convert_tokens_to_ids("<|im_end|>"),),
                          vision=vision)  # fmt: skip
        call = chat.encode('<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call>')

        class Scripted(RecordingEngine):
            def generate(self, prompts, sampling, stop_token_ids=(), images=None):
                self.calls.append(([list(p) for p in prompts], images))
                first = len(self.calls) == 1
                return [Rollout(list(p), [*call, stop_token_ids[0]] if first else [7, stop_token_ids[0]], "stop")
                        for p in prompts]  # fmt: skip

        rows = _rows(2)
        engine = Scripted(None)
        context = AgentContext(chat, images=[vision.images(row["images"]) for row in rows])
        loop = ToolLoop(["xtl.agent_tools.calculator"], max_turns=3)
        trajectories = loop.rollout(rows, engine, SamplingSettings(max_new_tokens=40), context)
        assert len(engine.calls) == 2 and [t.stats["turns"] for t in trajectories] == [2, 2]
        for prompts, images in engine.calls:
            assert [entry.paths for entry in images] == [tuple(row["images"]) for row in rows]
            assert all(p.count(vision.image_token_id) == 16 for p in prompts), "the image stays in the context"
        assert "<tool_response>\n2\n</tool_response>" in tokenizer.decode(trajectories[0].segments[0].response_ids)

    def test_grpo_through_the_tool_loop_with_image_prompts(self, tmp_path) -> None:
        module = _module(agent=ToolLoop(["xtl.agent_tools.calculator"], max_turns=2))
        engine = RecordingEngine(None)
        module._start_engine = lambda: (setattr(engine, "model", module.model), engine)[1]
        steps, _ = _fit(module, 1, tmp_path, datamodule=_datamodule())
        assert engine.calls and all(images is not None and all(images) for _, images in engine.calls)
        assert torch.isfinite(torch.tensor(steps[1]["train/loss"]))

    def test_partial_rollouts_continue_with_the_prompts_images(self, tmp_path) -> None:
        module = _module(rollout=dict(partial_tokens=2, max_resumes=2))
        engine = RecordingEngine(None, logprobs=True)
        module._start_engine = lambda: (setattr(engine, "model", module.model), engine)[1]
        steps, _ = _fit(module, 4, tmp_path, datamodule=_datamodule())
        assert sum(m["rollout/resumed"] for m in steps.values()) > 0
        calls = [(p, entry) for prompts, images in engine.calls for p, entry in zip(prompts, images, strict=True)]
        assert all(entry is not None and prompt.count(1544) == 16 for prompt, entry in calls)
        assert all(len(entry.paths) == 1 for _, entry in calls), "every call, continuations included"

    def test_online_dpo_on_image_prompts(self, tmp_path) -> None:
        module = _module(cls=OnlineDPOModule, group_size=2)
        captured = _capture_updates(module)
        steps, _ = _fit(module, 1, tmp_path, datamodule=_datamodule())
        mb = captured[0][0][0]
        assert mb.batch.seq_ctx.extras["image_grid_thw"].shape[0] == len(mb.sequences) > 0
        assert abs(steps[1]["train/objective/kl"]) < 1e-6, "the reference scores the images as the policy does"
        assert steps[1]["train/loss"] == pytest.approx(math.log(2), abs=1e-6)

    def test_validation_decodes_with_the_images(self, monkeypatch) -> None:
        """The held-out evaluation's greedy answers are the cached sampler's with each prompt's images."""
        import lightning.pytorch as pl

        seen = []

        def spy(model, prompts, config, **kwargs):
            seen.append((len(prompts), kwargs.get("images")))
            return generate(model, prompts, config, **kwargs)

        monkeypatch.setattr("xtl.rl.module.generate", spy)
        trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                             enable_model_summary=False, limit_val_batches=1)  # fmt: skip
        metrics = trainer.validate(_module(), datamodule=_datamodule(val=True), verbose=False)[0]
        assert [count for count, _ in seen] == [8] and len(seen[0][1]) == 8
        assert all(entry["pixel_values"].shape == (64, 384) for entry in seen[0][1])
        assert 0.0 <= metrics["val/exact_match"] <= 1.0


def _sharded_worker(rank: int, port: int, out: str) -> None:
    """Rank 0 and rank 1 disagree on which forwards hold images; the image filler makes both run the vision tower."""
    import os
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    alone = _model()
    model = _model()
    for unit in model.shard_units():
        fully_shard(unit)
    fully_shard(model)
    vision, chat = _vision(), ChatFormat(_tokenizer(), "chatml", vision=_vision())
    row = _rows(1)[0]
    prompt, images = chat.prompt_ids(row["prompt"]), vision.images(row["images"])
    engine = LocalRolloutEngine(model, group=dist.group.WORLD, filler=vision.filler())
    greedy = GreedyEngine(model, group=dist.group.WORLD, filler=vision.filler())
    sampling, stop = SamplingSettings(max_new_tokens=3, temperature=1.0, seed=rank), (1,)
    got = {}
    if rank == 0:  # images against an idle rank, then text against images
        got["image"] = engine.generate([prompt], sampling, stop, images=[images])[0].response_ids
        got["text"] = greedy.generate([[5, 6, 7]], sampling, stop)[0].response_ids
    else:
        engine.idle_step(sampling, stop)
        got["image"] = greedy.generate([prompt], sampling, stop, images=[images])[0].response_ids
    got["alone"] = LocalRolloutEngine(alone).generate([prompt], sampling, stop, images=[images])[0].response_ids
    got["text_alone"] = GreedyEngine(alone).generate([[5, 6, 7]], sampling, stop)[0].response_ids
    sequences = [(prompt, got["image"])] if rank == 0 else []  # rank 1's micro-batch is empty
    mb = pack_sequences(sequences, [1.0] * len(sequences), images=[images] * len(sequences), filler=vision.filler())
    scores = score_tokens(model, mb.batch.seq_ctx, mb.batch.labels)
    (scores.logps.sum() + 0.0 * scores.logps.sum()).backward()  # a gradient for every rank's vision blocks
    got["grad"] = float(sum(p.grad.full_tensor().abs().sum() for p in model.visual.parameters() if p.grad is not None))
    got["filled"] = mb.filled
    torch.save(got, f"{out}.{rank}")
    dist.destroy_process_group()


@pytest.mark.distributed
class TestShardedImageFiller:
    def test_ranks_that_disagree_on_images_all_run_the_vision_tower(self, tmp_path) -> None:
        import torch.multiprocessing as mp

        from tests.train.test_step import _free_port

        mp.spawn(_sharded_worker, args=(_free_port(), str(tmp_path / "out")), nprocs=2, join=True)
        first, second = (torch.load(tmp_path / f"out.{rank}") for rank in range(2))
        assert first["filled"] is False and second["filled"] is True, "the empty micro-batch carries the filler"
        assert first["grad"] > 0 and first["grad"] == second["grad"], "the vision blocks' gradients reduced"
        assert first["image"] == first["alone"], "sampled as by the unsharded policy"
        assert first["text"] == first["text_alone"], "the filler beside a text prompt changes nothing of it"


class TestRefusals:
    def test_image_prompts_for_a_text_policy(self, tmp_path) -> None:
        text = {**_TEXT, "model_type": "qwen3"}
        text.pop("rope")
        module = _module(text)
        with pytest.raises(ConfigError, match=r"prompt rows have images .* but the policy is a text model"):
            _fit(module, 1, tmp_path, datamodule=_datamodule())

    def test_image_prompts_through_a_black_box_agent(self, tmp_path) -> None:
        module = _module(agent=BlackBoxAgentLoop(function=lambda task, url, key: ""))
        with pytest.raises(ConfigError, match="BlackBoxAgentLoop cannot run prompts with images"):
            _fit(module, 1, tmp_path, datamodule=_datamodule())


class TestRayEngine:
    def test_actors_sample_images_as_the_local_sampler_does(self, tmp_path) -> None:
        ray = pytest.importorskip("ray")

        from xtl.rl.remote import RayRolloutEngine

        policy = _model()
        policy.save_hf(tmp_path)
        vision, chat = _vision(), ChatFormat(_tokenizer(), "chatml", vision=_vision())
        rows = _rows(4)
        prompts = [chat.prompt_ids(row["prompt"]) for row in rows]
        images = [vision.images(row["images"]) for row in rows]
        sampling = SamplingSettings(max_new_tokens=4, seed=7)
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            remote = RayRolloutEngine(str(tmp_path), num_actors=2).generate(prompts, sampling, images=images)
        finally:
            ray.shutdown()
        local = []
        for i, share in enumerate((slice(0, 2), slice(2, 4))):
            engine = LocalRolloutEngine(policy)
            local += engine.generate(prompts[share], replace(sampling, seed=7 + i), images=images[share])
        assert [r.response_ids for r in remote] == [r.response_ids for r in local]


class TestVLLMRequests:
    def _engine(self, llm) -> VLLMRolloutEngine:
        return VLLMRolloutEngine("unused", VLLMSettings(), seed=3, llm=llm, params_class=dict, image_token_id=1544)

    def test_one_placeholder_per_image_and_the_decoded_images(self) -> None:
        vision, chat = _vision(), ChatFormat(_tokenizer(), "chatml", vision=_vision())
        row = _rows(1)[0]
        prompt = chat.prompt_ids(row["prompt"])
        images = vision.images(row["images"])
        request = self._engine(FakeLLM()).request(prompt, images)
        start = prompt.index(1542)
        assert request["prompt_token_ids"] == [*prompt[: start + 1], 1544, *prompt[start + 17 :]]
        assert request["prompt_token_ids"] == collapse_placeholders(prompt, 1544)
        pictures = request["multi_modal_data"]["image"]
        assert len(pictures) == 1 and pictures[0].size == (64, 64) and pictures[0].mode == "RGB"
        assert self._engine(FakeLLM()).request([5, 6]) == {"prompt_token_ids": [5, 6]}

    def test_rollouts_keep_the_expanded_prompt_and_a_mismatch_is_refused(self) -> None:
        vision, chat = _vision(), ChatFormat(_tokenizer(), "chatml", vision=_vision())
        row = _rows(1)[0]
        prompt, images = chat.prompt_ids(row["prompt"]), vision.images(row["images"])

        class Expanding(FakeLLM):
            """Reports the prompt it ran as vLLM does: placeholders expanded (``extra`` more or fewer of them)."""

            extra = 0

            def generate(self, prompts, params, use_tqdm=False):
                outs = super().generate(prompts, params, use_tqdm)
                for out, request in zip(outs, prompts):
                    ids = request["prompt_token_ids"]
                    if "multi_modal_data" in request:
                        at = ids.index(1544)
                        ids = [*ids[:at], *[1544] * (16 + self.extra), *ids[at + 1 :]]
                    out.prompt_token_ids = ids
                return outs

        sampling = SamplingSettings(max_new_tokens=3)
        out = self._engine(Expanding()).generate([prompt, [5, 6]], sampling, images=[images, None])
        assert out[0].prompt_ids == prompt and out[1].prompt_ids == [5, 6]
        llm = Expanding()
        llm.extra = 4
        message = f"images of a prompt to {len(prompt) + 4} tokens, xtl to {len(prompt)}"
        with pytest.raises(RuntimeError, match=message):
            self._engine(llm).generate([prompt], sampling, images=[images])
        plain = VLLMRolloutEngine("unused", VLLMSettings(), llm=FakeLLM(), params_class=dict)
        with pytest.raises(ConfigError, match="need the vLLM engine of a vision-language policy"):
            plain.generate([prompt], sampling, images=[images])
