"""``Compile(scope="model")`` under the FSDP2 strategy on 2 gloo ranks: FSDP with a bf16 ``param_dtype`` (dense,
Qwen3-VL), expert parallelism 2 (Qwen3-MoE, DeepSeek-V3 MLA, GPT-OSS sinks) and context parallelism 2 (dense, MoE).

Each case builds its model twice through the strategy's own ``parallelize`` sequence, eagerly and with the language
model's whole forward compiled (``aot_eager``), and runs the same two steps on both: two micro-batches each (the
first without gradient sync, as the training step does), packs of one fixed length whose documents, images and
supervised rows differ. The loss and every gradient equal eager's bitwise, and the second step compiles nothing.

FSDP2's pre/post-forward hooks are ``torch._dynamo.disable``-d in torch (no option traces them): each is a graph
break inside the layer loop, so the loop runs eagerly, every layer call is its own compiled frame with FSDP's
unshard/reshard around it, and the backward is the compiled frames' backward joined by FSDP's eager autograd hooks.
Bitwise gradients hold with the bf16 ``param_dtype``; in fp32 the gradient contributions that meet at a graph break
(the eager attention and MoE blocks) are summed in another order: the last bits, as on one device (the fp32 case,
within ``FP32_TOL``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from tests.strategies.test_context_parallel import IMAGE, MODELS, PATCH_DIM, VISION_END, VISION_START
from tests.train.test_step import _free_port
from xtl.batch import ModelOutput
from xtl.callbacks import Compile
from xtl.callbacks.compile import compiled_frames
from xtl.data import IGNORE_INDEX, Pack, collate_pack
from xtl.data.collate import MicroBatch, loss_rows, split_for_context_parallel
from xtl.data.multimodal import VisionPack
from xtl.strategies import FSDPStrategy
from xtl.strategies.layout import ParallelLayout
from xtl.strategies.parallelize import WeightSource
from xtl.train import resolve_model_config
from xtl.train.step import forward_backward

WORLD = 2
PACK_LENGTH = 48  # every pack padded to it, as data.pad_to_max_length does
MICRO_BATCHES = 2
# the collate's 128 would run the head on every row of these short packs; with 4 every pack and share selects rows
# (a pack whose rows are all of them takes the forward's other branch: a second variant, compiled once)
ROW_MULTIPLE = 4
# fp32, eager attention: gradient sums at the graph breaks in another order; measured <= 4e-7 relative to each
# tensor's largest entry (the losses stay bitwise: the forward computes the same ops in the same order)
FP32_TOL = {"rtol": 1e-5, "atol": 1e-7}


@dataclass(frozen=True)
class Case:
    """A layout, a model family of :data:`MODELS` and the ``param_dtype`` (``None``: fp32)."""

    name: str
    family: str
    ep: int = 1
    cp: int = 1
    param_dtype: str | None = "bfloat16"


CASES = (
    Case("fsdp-dense", "qwen3"),
    Case("fsdp-dense-fp32", "qwen3", param_dtype=None),
    Case("fsdp-vlm", "qwen3_vl"),
    Case("ep-moe", "qwen3_moe", ep=2),
    Case("ep-mla", "deepseek_v3", ep=2),
    Case("ep-sinks", "gpt_oss", ep=2),
    Case("cp-dense", "qwen3", cp=2),
    Case("cp-moe-ep", "qwen3_moe", ep=2, cp=2),
)


def packs(family: str, seed: int, count: int) -> list[MicroBatch]:
    """``count`` collated packs of :data:`PACK_LENGTH` tokens: random documents (a vision family's with images of 4
    or 6 merged tokens, and a pack without any), about 30% of the labels masked, the rest padding; the head and
    loss run on the supervised rows topped up to a multiple of :data:`ROW_MULTIPLE` (:func:`with_loss_rows`)."""
    rng = np.random.default_rng(seed)
    vocab = MODELS[family].get("text_config", MODELS[family])["vocab_size"]
    batches = []
    for index in range(count):
        images = [] if "vl" not in family or index == 1 else list(rng.choice([4, 6], rng.integers(1, 3)))
        docs, grids = [], []
        for tokens in images:
            docs.append([*rng.integers(1, 80, rng.integers(1, 6)), VISION_START, *[IMAGE] * tokens, VISION_END, 7])
            grids.append([1, 4, tokens])  # 4 x tokens patches, merged 2 x 2
        while sum(map(len, docs)) < PACK_LENGTH - 12:
            docs.append(list(rng.integers(1, min(vocab, 80), rng.integers(3, 12))))
        ids = np.concatenate([np.array(doc) for doc in docs])
        labels = np.where((ids == IMAGE) | (rng.random(ids.size) < 0.3), IGNORE_INDEX, ids)
        lengths = [len(doc) for doc in docs]
        if not images:
            batches.append(with_loss_rows(collate_pack(Pack(index, ids, labels, lengths), pad_to=PACK_LENGTH)))
            continue
        grid = torch.tensor(grids)
        pixels = torch.from_numpy(rng.standard_normal((int(grid.prod(-1).sum()), PATCH_DIM)).astype(np.float32))
        extras = {"pixel_values": pixels, "image_grid_thw": grid}
        pack = VisionPack(index, ids, labels, lengths, extras)
        batches.append(with_loss_rows(collate_pack(pack, pad_to=PACK_LENGTH)))
    return batches


def with_loss_rows(batch: MicroBatch) -> MicroBatch:
    """``batch`` with the rows the head and loss run on chosen as the collate chooses them, to a multiple of
    :data:`ROW_MULTIPLE` (so their number changes from pack to pack)."""
    supervised = np.flatnonzero(batch.labels[0].numpy() != IGNORE_INDEX)
    rows = loss_rows(supervised, batch.labels.shape[1], ROW_MULTIPLE)
    batch.seq_ctx.loss_positions = None if rows is None else torch.from_numpy(rows)
    return batch


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    """One spawn of 2 processes running every case eagerly and compiled; each rank's results."""
    out = tmp_path_factory.mktemp("compile_parallel") / "results.pt"
    mp.spawn(_worker, args=(_free_port(), str(out)), nprocs=WORLD, join=True)
    return [torch.load(f"{out}.{rank}") for rank in range(WORLD)]


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
class TestWholeForwardUnderFSDP:
    def test_loss_and_every_gradient_equal_eager(self, results, case):
        """Bitwise with the bf16 ``param_dtype``; fp32 gradients within :data:`FP32_TOL`."""
        for rank, result in enumerate(results):
            eager, compiled = result[case.name]["eager"], result[case.name]["compiled"]
            for step, (want, got) in enumerate(zip(eager["steps"], compiled["steps"])):
                assert torch.equal(got["loss"], want["loss"]), (rank, step, got["loss"], want["loss"])
                assert got["grads"].keys() == want["grads"].keys()
                for name, grad in want["grads"].items():
                    message = f"rank {rank} step {step} {name}"
                    if case.param_dtype is None:
                        torch.testing.assert_close(got["grads"][name], grad, **FP32_TOL, msg=message)
                    else:
                        assert torch.equal(got["grads"][name], grad), message

    def test_the_forward_compiles_once_for_any_pack(self, results, case):
        """Catches a compile that does not act (no frames) and one that compiles again for a pack with other
        documents, images, padding or supervised rows (frames counted before each micro-batch and at the end)."""
        for result in results:
            eager, compiled = result[case.name]["eager"]["frames"], result[case.name]["compiled"]["frames"]
            assert eager == [eager[0]] * len(eager), "the eager model compiles nothing"
            assert compiled[1] > compiled[0] and compiled[1:] == [compiled[1]] * (len(compiled) - 1), compiled
            assert result[case.name]["compiled"]["forward_compiled"]


def _worker(rank: int, port: int, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    results = {}
    for case in CASES:
        results[case.name] = {"eager": _run(rank, case, compiled=False), "compiled": _run(rank, case, compiled=True)}
    torch.save(results, f"{out_path}.{rank}")
    dist.destroy_process_group()


def _run(rank: int, case: Case, compiled: bool) -> dict:
    """Two steps of the case's model (eager or compiled): each step's loss and full gradients, and the frames Dynamo
    had compiled before each micro-batch's forward and at the end."""
    torch._dynamo.reset()
    strategy = FSDPStrategy(
        param_dtype=case.param_dtype, process_group_backend="gloo", expert_parallel_size=case.ep,
        context_parallel_size=case.cp,
    )  # fmt: skip
    strategy.parallel_devices = [torch.device("cpu")]
    strategy.layout = ParallelLayout.for_world(WORLD, ep=case.ep, cp=case.cp)
    strategy.meshes = strategy.layout.build("cpu")
    config, _ = resolve_model_config(MODELS[case.family])
    with torch.device("meta"):
        model = config.build()
    transforms = [Compile(backend="aot_eager", scope="model")] if compiled else []
    model = strategy.parallelize(model, transforms, WeightSource(seed=0))
    text = model.text_model()
    data_rank = strategy.layout.data_rank(rank)
    frames, steps = [], []

    def forward(batch: MicroBatch) -> ModelOutput:
        frames.append(compiled_frames())
        return model(seq_ctx=batch.seq_ctx, labels=batch.labels, return_logits=False)

    for step in range(2):
        batches = packs(case.family, seed=10 * step + data_rank, count=MICRO_BATCHES)
        if case.cp > 1:
            share = strategy.layout.context_rank(rank)
            batches = [with_loss_rows(split_for_context_parallel(b, share, case.cp)) for b in batches]
        result = forward_backward(
            forward=forward,
            micro_batches=batches,
            num_tokens=lambda b: b.num_tokens,
            dp_world_size=WORLD,
            backward=lambda loss: loss.backward(),
            device=torch.device("cpu"),
            group=strategy.data_group(),
            gradient_sync=model.set_requires_gradient_sync,
        )
        loss = result.loss_sum.clone()
        dist.all_reduce(loss, group=strategy.data_group())
        grads = {name: _full(p.grad) for name, p in model.named_parameters()}
        steps.append({"loss": loss / result.global_tokens, "grads": grads})
        model.zero_grad(set_to_none=True)
    frames.append(compiled_frames())
    return {"steps": steps, "frames": frames, "forward_compiled": "forward" in vars(text)}  # the compiled one


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
