"""Under sharded parameters every rank joins every engine call: a rank whose trajectories have finished idles through
the turns another rank still samples (2 gloo processes, FSDP2-sharded tiny policy; without the idle step the
ranks' all-gathers would not pair up and the collective would time out)."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.rl.agent.test_training import CallsFirst
from tests.rl.test_module import MODEL
from tests.train.test_step import _free_port


def _worker(rank: int, port: int, out: str) -> None:
    from torch.distributed.fsdp import fully_shard

    from tests.rl.agent.scripted import tiny_chat
    from xtl.model import MODEL_TYPES
    from xtl.rl import SamplingSettings
    from xtl.rl.agent import AgentContext, ToolLoop

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    with torch.device("meta"):
        model = MODEL_TYPES["qwen3"](**{k: v for k, v in MODEL.items() if k != "model_type"}).build()
    model.materialize("cpu")
    torch.manual_seed(0)
    model.init_weights()
    for layer in model.decoder_layers():
        fully_shard(layer)
    fully_shard(model)
    chat = tiny_chat()
    engine = CallsFirst(model, chat.tokenizer)
    engine.group = dist.group.WORLD
    if rank == 1:  # this rank's conversations answer at once: one turn, then it idles
        engine.call_ids = engine.call_ids[-1:]

    def agree(count: int) -> int:
        most = torch.tensor(count)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        return int(most)

    rows = [{"prompt": [{"role": "user", "content": "What is 2+3?"}], "answer": "5"}] * 2
    loop = ToolLoop(["xtl.agent_tools.calculator"], max_turns=3)
    trajectories = loop.rollout(rows, engine, SamplingSettings(max_new_tokens=4), AgentContext(chat, agree))
    torch.save([t.stats for t in trajectories], f"{out}.{rank}")
    dist.destroy_process_group()


@pytest.mark.distributed
class TestLockstep:
    def test_a_finished_rank_idles_through_the_turns_of_another(self, tmp_path) -> None:
        mp.spawn(_worker, args=(_free_port(), str(tmp_path / "stats")), nprocs=2, join=True)
        ranks = [torch.load(tmp_path / f"stats.{rank}") for rank in range(2)]
        assert [s["turns"] for s in ranks[0]] == [2, 2] and [s["tool_calls"] for s in ranks[0]] == [1, 1]
        assert [s["turns"] for s in ranks[1]] == [1, 1] and all("tool_calls" not in s for s in ranks[1])
