"""Context-parallel attention over 2 gloo ranks (Ulysses, and all-gather-KV where 2 does not divide the heads) equals
attention of the whole packed sequence on one process."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from tests.strategies.test_context_parallel import spawned_results
from xtl.ops.allgather_kv import AllGatherKVAttention
from xtl.ops.attention import AttentionMaskSpec, eager_attention, sdpa_attention
from xtl.ops.ulysses import UlyssesAttention, ulysses_kv_repeats

CP = 2
LENGTHS = [5, 11, 3, 5]  # 24 tokens: the second document crosses the split point at 12
DIM = 8
# name -> (kernel, query heads, key/value heads, sliding window, sinks); 3 heads do not split over 2 ranks
CASES = {
    "sdpa_gqa_repeated": (sdpa_attention, 4, 1, None, False),  # 1 key/value head for 2 ranks: repeated to 2
    "sdpa_gqa": (sdpa_attention, 4, 2, None, False),
    "eager_window_sinks": (eager_attention, 4, 2, 4, True),
    "allgather_mqa": (eager_attention, 3, 1, None, False),
    "allgather_window_sinks": (eager_attention, 3, 3, 4, True),
}


class TestKVRepeats:
    @pytest.mark.parametrize(
        ("heads", "kv_heads", "cp", "repeats"), [(4, 1, 2, 2), (8, 2, 4, 2), (8, 8, 2, 1), (32, 8, 8, 1), (4, 2, 4, 2)]
    )
    def test_the_smallest_repeat_that_splits_evenly(self, heads, kv_heads, cp, repeats):
        assert ulysses_kv_repeats(heads, kv_heads, cp) == repeats
        assert (kv_heads * repeats) % cp == 0 and heads % (kv_heads * repeats) == 0

    def test_query_heads_must_split(self):
        with pytest.raises(ValueError, match="6 query heads over the context-parallel size 4"):
            ulysses_kv_repeats(6, 2, 4)


@pytest.fixture(scope="module")
def cp_results(tmp_path_factory) -> list[dict]:
    """Each rank's output and gradients of every case, from one spawn of 2 processes."""
    return spawned_results(_worker, tmp_path_factory.mktemp("ulysses"))


@pytest.mark.distributed
@pytest.mark.parametrize("case", sorted(CASES))
class TestContextParallelAttention:
    def test_output_and_gradients_equal_the_whole_sequence(self, cp_results, case):
        want = _run(case, None)
        shard = sum(LENGTHS) // CP
        for rank, results in enumerate(cp_results):
            got = results[case]
            tokens = slice(rank * shard, (rank + 1) * shard)
            torch.testing.assert_close(got["out"], want["out"][:, tokens], rtol=1e-6, atol=1e-6)
            for name in ("q", "k", "v"):
                torch.testing.assert_close(got[name], want[name][:, :, tokens], rtol=1e-5, atol=1e-6, msg=name)
        if want["sinks"] is not None:  # each rank's sink gradient covers its heads; the sum is the whole
            total = sum(results[case]["sinks"] for results in cp_results)
            torch.testing.assert_close(total, want["sinks"], rtol=1e-5, atol=1e-6)


def _inputs(heads: int, kv_heads: int, sinks: bool) -> dict[str, torch.Tensor | None]:
    generator = torch.Generator().manual_seed(0)
    tokens = sum(LENGTHS)
    return {
        "q": torch.randn(1, heads, tokens, DIM, generator=generator),
        "k": torch.randn(1, kv_heads, tokens, DIM, generator=generator),
        "v": torch.randn(1, kv_heads, tokens, DIM, generator=generator),
        "grad": torch.randn(1, tokens, heads, DIM, generator=generator),
        "sinks": torch.randn(heads, generator=generator) if sinks else None,
    }


def _run(case: str, group: dist.ProcessGroup | None) -> dict[str, torch.Tensor | None]:
    """Forward and backward of ``case``: the whole sequence (``group`` None) or this rank's tokens."""
    kernel, heads, kv_heads, window, sinks = CASES[case]
    inputs = _inputs(heads, kv_heads, sinks)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    mask = AttentionMaskSpec(cu_seq_lens=cu, max_seq_len=max(LENGTHS)).with_window(window)
    grad = inputs["grad"]
    leaves = {name: inputs[name] for name in ("q", "k", "v")}
    attn = kernel
    if group is not None:
        rank, shard = dist.get_rank(group), sum(LENGTHS) // CP
        leaves = {name: x[:, :, rank * shard : (rank + 1) * shard] for name, x in leaves.items()}
        grad = grad[:, rank * shard : (rank + 1) * shard]
        attn = UlyssesAttention(kernel, group) if heads % CP == 0 else AllGatherKVAttention(group)
    leaves = {name: x.clone().requires_grad_(True) for name, x in leaves.items()}
    sink = inputs["sinks"].clone().requires_grad_(True) if sinks else None
    out = attn(leaves["q"], leaves["k"], leaves["v"], mask, DIM**-0.5, 0.0, sink)
    out.backward(grad)
    grads = {name: x.grad for name, x in leaves.items()}
    return {"out": out.detach(), **grads, "sinks": sink.grad if sink is not None else None}


def _worker(rank: int, port: int, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=CP)
    results = {case: _run(case, dist.group.WORLD) for case in CASES}
    torch.save(results, f"{out_path}.{rank}")
    dist.destroy_process_group()
