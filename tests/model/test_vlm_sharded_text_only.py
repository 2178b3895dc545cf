"""A sharded Qwen3-VL forward without images still runs the vision tower (a blank image, its features times zero).

Under FSDP2 the vision blocks gather their parameters from every rank in the forward and reduce their gradients over
every rank in the backward, so a rank whose micro-batch holds no image must run them too. Two gloo ranks, FSDP over
both: rank 0 trains a pack with an image, rank 1 a text-only pack; the loss and every gradient equal one process
computing both packs. On one device (parameters not sharded) a text-only forward does not touch the tower.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from tests.strategies.test_context_parallel import IMAGE, MODELS, PATCH_DIM, VISION_END, VISION_START
from tests.train.test_step import _free_port
from xtl.data import IGNORE_INDEX, Pack, collate_pack
from xtl.data.multimodal import VisionPack
from xtl.train import resolve_model_config

WORLD = 2
FAMILIES = ("qwen3_vl", "qwen3_vl_moe")
# fp32, the same sums split over 2 ranks (FSDP's reduce-scatter adds the ranks' gradients in its own order): measured
# <= 2e-7 relative on the loss and <= 1e-6 absolute on the gradients.
TOL = {"rtol": 1e-5, "atol": 1e-6}
DEADLINE_S = 120  # a rank stuck in a collective that the other never joins fails the test instead of hanging it


def _model(family: str) -> torch.nn.Module:
    config, _ = resolve_model_config(MODELS[family])
    model = config.build()
    torch.manual_seed(0)
    model.init_weights()
    return model


def _packs():
    """Rank 0's pack (a document with a 4-token image, a text document) and rank 1's (text only)."""
    rng = np.random.default_rng(0)
    docs = [[5, VISION_START, *[IMAGE] * 4, VISION_END, 6, 7, 8], list(range(10, 20))]
    ids = np.concatenate([np.array(doc) for doc in docs])
    labels = np.where((ids == IMAGE) | (rng.random(ids.size) < 0.2), IGNORE_INDEX, ids)
    pixels = torch.from_numpy(rng.standard_normal((16, PATCH_DIM)).astype(np.float32))
    extras = {"pixel_values": pixels, "image_grid_thw": torch.tensor([[1, 4, 4]])}
    image = collate_pack(VisionPack(0, ids, labels, [len(doc) for doc in docs], extras))
    text_ids = rng.integers(1, 80, 15)
    text = collate_pack(Pack(1, text_ids, np.where(rng.random(15) < 0.2, IGNORE_INDEX, text_ids), [9, 6]))
    return image, text


def _tower_calls(model) -> list[int]:
    """A counter of the vision tower's forwards (its only element)."""
    calls = [0]
    model.vision_tower().register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def _worker(rank: int, port: int, out_path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from xtl.strategies.parallelize import fully_shard_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (WORLD,))
    results = {}
    for family in FAMILIES:
        model = fully_shard_model(_model(family), mesh=mesh)
        calls = _tower_calls(model)
        batch = _packs()[rank]
        tokens = torch.tensor(float(batch.num_tokens))
        dist.all_reduce(tokens)
        out = model(seq_ctx=batch.seq_ctx, labels=batch.labels, return_logits=False)
        (out.loss_sum * WORLD / tokens).backward()  # FSDP averages the ranks' gradients: their sum / tokens
        loss = out.loss_sum.detach().clone()
        dist.all_reduce(loss)
        grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
        sharded = all(isinstance(p, DTensor) for p in model.parameters())
        results[family] = {"loss": loss / tokens, "grads": grads, "tower_calls": calls[0], "sharded": sharded}
    torch.save(results, f"{out_path}.{rank}")
    dist.destroy_process_group()


def _spawn(worker: Callable[[int, int, str], None], folder: Path) -> list[dict]:
    """Each rank's saved results of ``worker`` on 2 spawned processes; fails (killing them) past the deadline."""
    out = folder / "results.pt"
    context = mp.spawn(worker, args=(_free_port(), str(out)), nprocs=WORLD, join=False)
    deadline = time.monotonic() + DEADLINE_S
    while not context.join(timeout=max(1.0, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the ranks did not finish within {DEADLINE_S} s (a collective one rank never joined)")
    return [torch.load(f"{out}.{rank}") for rank in range(WORLD)]


@pytest.fixture(scope="module")
def sharded_results(tmp_path_factory) -> list[dict]:
    return _spawn(_worker, tmp_path_factory.mktemp("vlm_sharded_text_only"))


@pytest.mark.distributed
@pytest.mark.parametrize("family", FAMILIES)
class TestShardedForwardWithoutImages:
    def test_loss_and_every_gradient_equal_one_process(self, sharded_results, family):
        """Rank 0 (an image) and rank 1 (text only) train together; the text-only rank's blank image changes no
        value: the loss and every gradient, the vision tower's included, are one process's on both packs."""
        model = _model(family)
        packs = _packs()
        total = sum(batch.num_tokens for batch in packs)
        loss = 0.0
        for batch in packs:
            out = model(seq_ctx=batch.seq_ctx, labels=batch.labels, return_logits=False)
            (out.loss_sum / total).backward()
            loss += out.loss_sum.detach() / total
        for rank, results in enumerate(sharded_results):
            got = results[family]
            assert got["sharded"] and got["tower_calls"] == 1, "every rank ran the tower once"
            torch.testing.assert_close(got["loss"], loss, rtol=1e-6, atol=0)
            assert got["grads"].keys() == dict(model.named_parameters()).keys()
            for name, param in model.named_parameters():
                torch.testing.assert_close(got["grads"][name], param.grad, **TOL, msg=f"rank {rank} {name}")


@pytest.mark.parametrize("family", FAMILIES)
class TestUnshardedForwardWithoutImages:
    def test_the_tower_runs_only_for_images(self, family):
        model = _model(family)
        calls = _tower_calls(model)
        image, text = _packs()
        model(seq_ctx=text.seq_ctx, labels=text.labels, return_logits=False)
        assert calls[0] == 0, "no blank image on one device"
        model(seq_ctx=image.seq_ctx, labels=image.labels, return_logits=False)
        assert calls[0] == 1

    def test_the_blank_image_changes_no_value(self, family, monkeypatch):
        """Forced on one device, the blank image leaves the loss and the language model's gradients bitwise equal
        and gives the tower (every one of its parameters, DeepStack mergers included) zero gradients."""
        _, text = _packs()
        runs = []
        for blank in (False, True):
            model = _model(family)
            monkeypatch.setattr(type(model), "_vision_is_sharded", lambda self, blank=blank: blank)
            calls = _tower_calls(model)
            out = model(seq_ctx=text.seq_ctx, labels=text.labels, return_logits=False)
            (out.loss_sum / text.num_tokens).backward()
            assert calls[0] == int(blank)
            runs.append((out.loss_sum.detach(), {name: p.grad for name, p in model.named_parameters()}))
        (loss, grads), (blank_loss, blank_grads) = runs
        assert torch.equal(blank_loss, loss)
        for name, grad in blank_grads.items():
            if grads[name] is None:
                assert name.startswith("visual.") and torch.equal(grad, torch.zeros_like(grad)), name
            else:
                assert torch.equal(grad, grads[name]), name
        assert {name for name, grad in grads.items() if grad is None} == {
            name for name in grads if name.startswith("visual.")
        }, "without the blank image the tower has no gradient at all"
