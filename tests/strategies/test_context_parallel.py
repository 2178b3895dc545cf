"""Context parallelism: a packed sequence split over 2 gloo ranks trains as on one process.

Model level (one spawn): dense GQA, MoE, MLA, sinks + sliding window and Qwen3-VL (dense and MoE), on a pack
whose documents cross the split point, with one document shorter than a share and a length that needs padding (the
vision pack: an image whose placeholders straddle the split, and text after it whose M-RoPE positions depend on
it): the loss and every gradient equal the whole pack's on one process. Run level: ``xtl fit`` with
``context_parallel_size: 2`` on 2 processes logs the losses of one process training the same packs, for the dense
and the MoE recipe (the latter with EP 2 and activation checkpointing).
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.cli.test_cli import ROOT, SMALL_MODEL
from tests.strategies.test_expert_parallel import BASE, FAMILIES
from tests.train.test_step import _free_port
from xtl.data import IGNORE_INDEX, Pack, collate_pack
from xtl.data.collate import split_for_context_parallel
from xtl.data.multimodal import VisionPack
from xtl.errors import ConfigError
from xtl.strategies import SingleDevice
from xtl.strategies.layout import ParallelLayout, ParallelMeshes
from xtl.train import resolve_model_config

CP = 2
IMAGE, VISION_START, VISION_END = 90, 91, 92
_VL_TEXT = {
    **{k: v for k, v in BASE.items() if k != "attn_impl"},
    "intermediate_size": 48,
    "rope": {"rope_type": "default", "rope_theta": 10000.0, "params": {"mrope_section": [2, 1, 1]}},
}
_VL = {
    "image_token_id": IMAGE,
    "vision_start_token_id": VISION_START,
    "vision_end_token_id": VISION_END,
    "video_token_id": 93,
    "text_config": _VL_TEXT,
    "vision_config": {
        "depth": 2,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_heads": 2,
        "patch_size": 4,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": 32,
        "num_position_embeddings": 16,
        "deepstack_visual_indexes": [0],
    },
}
PATCH_DIM = 3 * 2 * 4 * 4
# the vision pack: doc 0 has a 4-token image, doc 1 a 6-token one at 21..26 across the split at 24, then text
_VL_DOCS = [[5, VISION_START, *[IMAGE] * 4, VISION_END], [*range(10, 23), VISION_START, *[IMAGE] * 6, VISION_END,
            30, 31, 32], [40, 41, 42], list(range(50, 60)), [60, 61, 62]]  # fmt: skip
MODELS = {
    "qwen3": {**BASE, "model_type": "qwen3", "intermediate_size": 48},
    # 3 query heads do not split over 2 ranks: all-gather-KV attention instead of Ulysses
    "qwen3_3_heads": {**BASE, "model_type": "qwen3", "intermediate_size": 48, "num_attention_heads": 3,
                      "num_key_value_heads": 1},
    **FAMILIES,
    **{name: {"model_type": name, **_VL} for name in ("qwen3_vl", "qwen3_vl_moe")},
}  # fmt: skip
MODELS["qwen3_vl_moe"]["text_config"] = {**_VL_TEXT, "num_experts": 4, "num_experts_per_tok": 2,
                                         "moe_intermediate_size": 16}  # fmt: skip
LENGTHS = [7, 20, 3, 10, 7]  # 47 tokens -> 48: document 2 crosses the split at 24, document 3 is shorter than 24
# fp32, the same sums split over 2 ranks: measured ~1e-7 relative on the loss, ~1e-6 on gradients
TOL = {"rtol": 1e-5, "atol": 1e-6}
EP2 = ["--trainer.strategy.init_args.expert_parallel_size", "2"]
LOGGED = ("train/loss", "train/balance_loss", "train/z_loss", "train/maxvio", "train/tokens_seen")
CP_YAML = (
    "trainer:\n  strategy:\n    class_path: xtl.strategies.FSDPStrategy\n    init_args:\n"
    "      context_parallel_size: {cp}\n      process_group_backend: gloo\n  precision: 32-true\n"
    "  val_check_interval: null\n  enable_progress_bar: false\n  callbacks: []\ndata:\n  val_sources: null\n"
)


class TestContextParallelLayout:
    def test_sizes(self):
        layout = ParallelLayout.for_world(8, cp=2)
        assert (layout.dp_shard, layout.cp, layout.dp_size, layout.world_size) == (4, 2, 4, 8)
        assert [layout.data_rank(r) for r in range(4)] == [0, 0, 1, 1]
        assert [layout.context_rank(r) for r in range(4)] == [0, 1, 0, 1]
        assert ParallelLayout.for_world(8, cp=2, ep=4).edp == 2, "experts shard over dp_shard x cp"

    @pytest.mark.parametrize(
        ("kwargs", "message"),
        [
            ({"world_size": 4, "cp": 3}, r"context_parallel_size \(3\) must divide the number of processes \(4"),
            ({"world_size": 8, "cp": 2, "dp_shard": 3}, r"x context_parallel_size \(2\) must equal"),
        ],
    )
    def test_a_bad_size_names_the_key(self, kwargs, message):
        with pytest.raises(ConfigError, match=message):
            ParallelLayout.for_world(**kwargs)


def spawned_results(worker: Callable[[int, int, str], None], folder: Path, nprocs: int = CP) -> list[dict]:
    """Run ``worker(rank, port, out_path)`` on ``nprocs`` spawned processes (one gloo group); each rank's results, as
    the worker saved them to ``f"{out_path}.{rank}"``."""
    out = folder / "results.pt"
    mp.spawn(worker, args=(_free_port(), str(out)), nprocs=nprocs, join=True)
    return [torch.load(f"{out}.{rank}") for rank in range(nprocs)]


@pytest.fixture(scope="module")
def cp_results(tmp_path_factory) -> list[dict]:
    """Each rank's loss and all-reduced gradients for every model, from one spawn of 2 processes."""
    return spawned_results(_worker, tmp_path_factory.mktemp("cp"))


@pytest.mark.distributed
@pytest.mark.parametrize("family", sorted(MODELS))
class TestContextParallelModel:
    def test_loss_and_every_gradient_equal_the_whole_pack(self, cp_results, family):
        model = _model(family)
        batch = _micro_batch(family)
        out = model(seq_ctx=batch.seq_ctx, labels=batch.labels, return_logits=False)
        (out.loss_sum / batch.num_tokens).backward()
        heads = MODELS[family].get("text_config", MODELS[family])["num_attention_heads"]
        method = "allgather_kv" if heads % CP else "ulysses"
        for rank, results in enumerate(cp_results):
            got = results[family]
            assert got["methods"] == [method]
            torch.testing.assert_close(got["loss"], out.loss_sum.detach() / batch.num_tokens, rtol=1e-6, atol=0)
            for name, param in model.named_parameters():
                torch.testing.assert_close(got["grads"][name], param.grad, **TOL, msg=f"rank {rank} {name}")


@pytest.mark.slow
@pytest.mark.distributed
class TestContextParallelFit:
    @pytest.mark.parametrize(
        ("recipe", "cp_only"),
        [
            ("tiny_sft.yaml", []),
            ("tiny_moe_sft.yaml", [*EP2, "--config", str(ROOT / "callbacks/activation_checkpointing.yaml")]),
        ],
        ids=["dense", "moe-ep2-checkpointing"],
    )
    def test_two_ranks_log_the_losses_of_one_process(self, tmp_path, data_cache, recipe, cp_only):
        """Two ranks of one context-parallel group read the packs one process reads (one data-parallel rank)."""
        one = _fit(tmp_path / "one", recipe, data_cache, 1)
        two = _fit(tmp_path / "two", recipe, data_cache, CP, *cp_only)
        _same(two, one, range(3))

    def test_a_checkpoint_resumes_at_another_size(self, tmp_path, data_cache):
        """A DCP checkpoint of step 2 at CP=2 continues on one process (CP=1) to the uninterrupted run's losses."""
        every_2 = ["--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.dirpath=ckpt"]
        every_2 += ["--trainer.callbacks.every_n_train_steps=2", "--trainer.callbacks.save_top_k=-1"]
        steps = ["--trainer.max_steps", "4", "--model.init_args.schedule.decay_steps", "4"]
        full = _fit(tmp_path / "full", "tiny_sft.yaml", data_cache, CP, *every_2, *steps)
        (ckpt,) = (tmp_path / "full/runs/tiny_sft/ckpt").glob("*step=2.ckpt")
        resumed = _fit(tmp_path / "resumed", "tiny_sft.yaml", data_cache, 1, *steps, "--ckpt_path", str(ckpt))
        _same(resumed, full, range(2, 4))


def _fit(work: Path, recipe: str, cache: Path, cp: int, *extra: str) -> dict[int, dict[str, str]]:
    """``xtl fit`` on ``cp`` processes forming one context-parallel group; the logged rows by step."""
    work.mkdir()
    (work / "cp.yaml").write_text(CP_YAML.format(cp=cp))
    command = [sys.executable, "-m", "xtl", "fit", "--config", str(ROOT / "configs" / recipe)]
    command += ["--config", str(work / "cp.yaml"), *SMALL_MODEL, "--data.cache_dir", str(cache)]
    command += ["--data.pack_max_length", "128", "--trainer.max_steps", "3", "--trainer.devices", str(cp), *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr and "on_before_batch_transfer" not in proc.stderr
    return _read(work)


def _same(got: dict[int, dict[str, str]], want: dict[int, dict[str, str]], steps: range) -> None:
    """The loss and the router's logged losses (summed over the shares) of ``steps`` agree within 1e-5."""
    assert set(steps) <= set(got) and set(steps) <= set(want)
    for step in steps:
        for key in LOGGED:
            if key in want[step]:
                assert float(got[step][key]) == pytest.approx(float(want[step][key]), rel=1e-5), (step, key)


def _read(work: Path) -> dict[int, dict[str, str]]:
    (metrics,) = work.glob("runs/*/logs/version_*/metrics.csv")
    return {
        int(r["step"]): {k: v for k, v in r.items() if v} for r in csv.DictReader(metrics.open()) if r["train/loss"]
    }


def _model(family: str) -> torch.nn.Module:
    config, _ = resolve_model_config(MODELS[family])
    model = config.build()
    torch.manual_seed(0)
    model.init_weights()
    return model


def _micro_batch(family: str):
    rng = np.random.default_rng(0)
    if "vl" not in family:
        ids = rng.integers(1, BASE["vocab_size"], sum(LENGTHS))
        labels = np.where(rng.random(ids.size) < 0.25, IGNORE_INDEX, ids)
        return collate_pack(Pack(0, ids, labels, LENGTHS))
    ids = np.concatenate([np.array(doc) for doc in _VL_DOCS])
    labels = np.where((ids == IMAGE) | (rng.random(ids.size) < 0.25), IGNORE_INDEX, ids)
    grid = torch.tensor([[1, 4, 4], [1, 4, 6]])  # 4 and 6 merged tokens
    pixels = torch.from_numpy(rng.standard_normal((16 + 24, PATCH_DIM)).astype(np.float32))
    extras = {"pixel_values": pixels, "image_grid_thw": grid}
    return collate_pack(VisionPack(0, ids, labels, [len(doc) for doc in _VL_DOCS], extras))


def _worker(rank: int, port: int, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=CP)
    results = {}
    for family in MODELS:
        model = _model(family)
        for module in model.attention_modules():
            module.use_context_parallel(dist.group.WORLD)
        share = split_for_context_parallel(_micro_batch(family), rank, CP)
        tokens = torch.tensor(float(share.num_tokens))
        dist.all_reduce(tokens)
        out = model(seq_ctx=share.seq_ctx, labels=share.labels, return_logits=False)
        (out.loss_sum / tokens).backward()
        loss = out.loss_sum.detach().clone()
        dist.all_reduce(loss)
        grads = {}
        for name, param in model.named_parameters():
            grad = param.grad.clone()
            dist.all_reduce(grad)
            grads[name] = grad
        methods = sorted({module.context_parallel_method for module in model.attention_modules()})
        results[family] = {"loss": loss / tokens, "grads": grads, "methods": methods}
    torch.save(results, f"{out_path}.{rank}")
    dist.destroy_process_group()


def join_one_group(rank: int, port: int, cp: int = CP) -> SingleDevice:
    """Join this spawned process (one thread) to the gloo group of ``cp`` processes; :func:`one_group_strategy`."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=cp)
    return one_group_strategy(cp)


def one_group_strategy(cp: int) -> SingleDevice:
    """A strategy whose ``cp`` processes (the default group, initialized) form one context-parallel group, laid out as
    ``FSDPStrategy`` lays out ``cp`` processes (the group is also the data group); parameters are not sharded."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    strategy = SingleDevice()
    strategy.layout = ParallelLayout(cp=cp)
    strategy.meshes = ParallelMeshes(strategy.layout, mesh, None, None, None, mesh)
    return strategy


def averaged_over_ranks(
    loss_sum: torch.Tensor, grads: dict[str, torch.Tensor], group: dist.ProcessGroup | None, world: int
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The step's loss sum over the ranks and its gradients averaged over them, as FSDP reduces them (``group`` None:
    one process, unchanged)."""
    loss_sum, grads = loss_sum.clone(), {name: grad.clone() for name, grad in grads.items()}
    if group is not None:
        dist.all_reduce(loss_sum, group=group)
        for grad in grads.values():
            dist.all_reduce(grad, group=group)
            grad /= world
    return loss_sum, grads
