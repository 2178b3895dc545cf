"""Preference optimization through ``xtl fit`` (``configs/tiny_dpo.yaml`` and ``configs/tiny_kto.yaml`` with a tiny
random model): FSDP on 2 ranks equals one process (DPO, KTO), context parallelism 2 equals one process (KTO), LoRA
trains against its adapters-off reference, MoE with expert parallelism, activation checkpointing and a precomputed
reference resumes exactly, and precomputed reference log-probabilities equal the live reference's (one process, 2 FSDP
ranks), are read back by later runs and resume exactly."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.inprocess import run_fit
from tests.train.conftest import TINY_MODEL
from xtl.utils import TINY_ASSETS_DIR

ROOT = Path(__file__).resolve().parents[2]
MOE = {
    **TINY_MODEL,
    "model_type": "qwen3_moe",
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
}
LOGGED = ("train/loss", "train/rewards/accuracies", "train/rewards/margins", "train/logps/chosen")
KTO_LOGGED = ("train/loss", "train/kl", "train/rewards/chosen", "train/rewards/rejected", "train/logps/rejected")
DPO = ("tiny_dpo.yaml", "{loss_type: sigmoid, beta: 0.1, rpo_alpha: 0.5}")
KTO = ("tiny_kto.yaml", "{loss_type: kto, beta: 0.1, desirable_weight: 1.2}")
FSDP = (
    "trainer:\n  devices: 2\n  precision: 32-true\n  strategy:\n    class_path: xtl.strategies.FSDPStrategy\n"
    "    init_args:\n"
    "      process_group_backend: gloo\n{extra}"
)
# fp32; 2 ranks x 2 micro-batches vs 1 x 4: the same pairs, only the order of sums differs
RTOL = 1e-5
# rewards and margins are means of beta times differences of fp32 log-probabilities of about -40 (ulp 4e-6): near 0
# they are compared within a few ulps times beta (one ulp apart is 4e-7; CPUs differ in which sums round where)
REWARD_ATOL = 1e-6


def _fit(
    work: Path, cache: Path, model: dict, *extra: str, fragment: str = "", recipe: tuple[str, str] = DPO
) -> tuple[dict[int, dict], str]:
    """``xtl fit`` of a tiny preference recipe (:data:`DPO`: the recipe and its objective) with ``model`` in ``work``;
    the logged rows by step and the output."""
    work.mkdir(parents=True, exist_ok=True)
    override = work / "override.yaml"
    override.write_text(
        f"model:\n  init_args:\n    model: {model}\n    objective: {recipe[1]}\n"
        "trainer:\n  precision: 32-true\n  val_check_interval: null\n  enable_progress_bar: false\n"
        "  num_sanity_val_steps: 0\n  callbacks: []\ndata:\n  val_sources: null\n  pack_max_length: 128\n"
    )
    args = ["fit", "--config", str(ROOT / "configs" / recipe[0]), "--config"]
    args += [str(override), "--data.cache_dir", str(cache), "--trainer.max_steps", "3"]
    if fragment:  # a file of its own: a second ``trainer:`` key in one YAML file would replace the first
        (work / "fragment.yaml").write_text(fragment)
        args += ["--config", str(work / "fragment.yaml")]
    return run_fit([*args, *extra], work, processes=bool(fragment))


def _close(
    got: dict[int, dict],
    want: dict[int, dict],
    steps: range,
    rel: float = RTOL,
    keys: tuple[str, ...] = LOGGED,
    abs_: float = 1e-7,
) -> None:
    for step in steps:
        for key in keys:
            assert got[step][key] == pytest.approx(want[step][key], rel=rel, abs=abs_), (step, key)


def _small_pairs(tmp_path: Path) -> list[str]:
    """Arguments training on the first 46 tiny preference pairs (31 packs of 128 tokens) with a held-out set of 16
    pairs (8 packs) validated at step 3: a reference table is a fraction of a second to compute, and 2 ranks share
    an odd number of training packs (one rank repeats one to keep the forwards of a sharded model matched)."""
    for name, rows in (("preference_train.jsonl", 46), ("preference_eval.jsonl", 16)):
        lines = (TINY_ASSETS_DIR / name).read_text().splitlines(keepends=True)[:rows]
        (tmp_path / name).write_text("".join(lines))
    train = f'[{{"path": "{tmp_path / "preference_train.jsonl"}", "kind": "preference"}}]'
    held_out = f'{{"heldout": [{{"path": "{tmp_path / "preference_eval.jsonl"}", "kind": "preference"}}]}}'
    return ["--data.sources", train, "--data.val_sources", held_out, "--trainer.val_check_interval", "3"]


def _val_rows(work: Path) -> list[dict]:
    rows = []
    for metrics in sorted(work.glob("runs/tiny_dpo/logs/version_*/metrics.csv")):
        rows += [
            {k: float(v) for k, v in row.items() if v} for row in csv.DictReader(metrics.open()) if row["val/loss"]
        ]
    return rows


def _tables(cache: Path) -> dict[int, np.ndarray]:
    """The stored reference tables of a cache, by number of pairs (46: the training set, 16: the held-out set)."""
    tables = {}
    for path in sorted((cache / "reference").glob("*.npz")):
        with np.load(path) as f:
            tables[f["logps"].shape[1]] = f["logps"]
    return tables


PRECOMPUTED = ("--model.init_args.reference", "precomputed")


@pytest.mark.slow
@pytest.mark.distributed
class TestPreferenceFit:
    @pytest.fixture(scope="class")
    def one_process(self, tmp_path_factory, data_cache) -> dict[int, dict]:
        """3 steps on one process, 4 packs per step (the packs 2 data-parallel ranks, or 1 context-parallel group,
        read)."""
        return _fit(tmp_path_factory.mktemp("one"), data_cache, TINY_MODEL, "--data.micro_batches_per_step", "4")[0]

    def test_fsdp_on_two_ranks_equals_one_process(self, tmp_path, data_cache, one_process):
        """DPO + an NLL term (normalized over the step's chosen tokens) with a live reference sharded like the
        policy: the same losses and reward metrics as one process reading the same pairs."""
        two = ["--data.micro_batches_per_step", "2"]
        sharded, err = _fit(tmp_path / "fsdp", data_cache, TINY_MODEL, *two, fragment=FSDP.format(extra=""))
        assert "reference: live" in err
        _close(sharded, one_process, range(3))
        assert one_process[0]["train/rewards/margins"] == 0, "step 0: the policy is its reference"
        assert one_process[2]["train/rewards/margins"] != 0

    def test_lora_uses_the_base_model_as_reference(self, tmp_path, data_cache):
        """Under LoRA the reference is the model with its adapters off (no second copy): at step 0 (``lora_B = 0``)
        policy and reference agree, then the adapters move the rewards."""
        rows, err = _fit(tmp_path, data_cache, TINY_MODEL, "--config", str(ROOT / "callbacks/lora.yaml"),
                         "--model.init_args.objective.rpo_alpha", "0")  # fmt: skip
        assert "reference: adapters_off" in err
        assert math.isclose(rows[0]["train/loss"], math.log(2), rel_tol=1e-6)
        assert rows[2]["train/rewards/margins"] != 0

    def test_moe_with_expert_parallelism_checkpointing_and_a_precomputed_reference_resumes_exactly(self, tmp_path):
        """Qwen3-MoE, EP 2, activation checkpointing, ``param_dtype: bfloat16`` (as the GPU recipes), the reference
        log-probabilities precomputed on both ranks (an odd number of packs: the all-to-alls of expert parallelism
        stay matched): at step 0 the policy is its reference; 4 steps with a checkpoint at step 2, and the resumed
        run reads the stored table and logs the uninterrupted run's steps 2 and 3."""
        fragment = FSDP.format(extra="      expert_parallel_size: 2\n      param_dtype: bfloat16\n")
        fragment += "  callbacks:\n    - class_path: xtl.callbacks.ActivationCheckpointing\n"
        every_2 = ["--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.dirpath=ckpt"]
        every_2 += ["--trainer.callbacks.every_n_train_steps=2", "--trainer.callbacks.save_top_k=-1"]
        steps = ["--trainer.max_steps", "4", "--model.init_args.schedule.decay_steps", "4", *PRECOMPUTED]
        steps += [*_small_pairs(tmp_path), "--data.micro_batches_per_step", "2"]
        cache = tmp_path / "cache"
        full, err = _fit(tmp_path / "full", cache, MOE, *every_2, *steps, fragment=fragment)
        assert "reference log-probabilities of train (46 pairs, 31 packs on 2 data rank(s)" in err
        assert abs(full[0]["train/rewards/chosen"]) < 1e-4 and abs(full[0]["train/rewards/rejected"]) < 1e-4
        (ckpt,) = (tmp_path / "full/runs/tiny_dpo/ckpt").glob("*step=2.ckpt")
        resumed, err = _fit(tmp_path / "resumed", cache, MOE, *steps, "--ckpt_path", str(ckpt), fragment=fragment)
        assert "reference log-probabilities of train (46 pairs) read from" in err
        assert all(math.isfinite(full[s]["train/loss"]) for s in range(4))
        assert [resumed[s]["train/loss"] for s in (2, 3)] == [full[s]["train/loss"] for s in (2, 3)]

    def test_precomputed_reference_equals_live_on_one_process_and_two_fsdp_ranks(self, tmp_path):
        """``reference: precomputed``: one pass before the first step (train and held-out sets) gives the losses and
        metrics of a live reference (fp32, 1e-6 relative); on 2 FSDP ranks each rank computes half of the packs and
        every rank gets the whole table: the same table and the same losses as one process (1e-5)."""
        data, one = _small_pairs(tmp_path), ["--data.micro_batches_per_step", "4"]
        live, _ = _fit(tmp_path / "live", tmp_path / "cache", TINY_MODEL, *data, *one)
        pre, err = _fit(tmp_path / "pre", tmp_path / "cache", TINY_MODEL, *data, *one, *PRECOMPUTED)
        assert "reference: precomputed" in err
        assert "reference log-probabilities of train (46 pairs, 31 packs on 1 data rank(s), from the policy" in err
        assert "reference log-probabilities of val set heldout (16 pairs, 8 packs on 1 data rank(s)" in err
        _close(pre, live, range(3), rel=1e-6, abs_=REWARD_ATOL)
        (val_live,), (val_pre,) = _val_rows(tmp_path / "live"), _val_rows(tmp_path / "pre")
        for key in ("val/loss", "val/rewards/margins", "val/rewards/chosen"):
            assert val_pre[key] == pytest.approx(val_live[key], rel=1e-6, abs=REWARD_ATOL), key
        assert pre[2]["train/rewards/margins"] != 0
        fsdp = FSDP.format(extra="")
        two = ["--data.micro_batches_per_step", "2"]
        sharded, err = _fit(
            tmp_path / "fsdp", tmp_path / "cache2", TINY_MODEL, *data, *two, *PRECOMPUTED, fragment=fsdp
        )
        assert "reference log-probabilities of train (46 pairs, 31 packs on 2 data rank(s)" in err
        _close(sharded, pre, range(3), abs_=REWARD_ATOL)
        one_process, two_ranks = _tables(tmp_path / "cache"), _tables(tmp_path / "cache2")
        assert sorted(two_ranks) == [16, 46]
        for pairs, table in two_ranks.items():
            np.testing.assert_allclose(table, one_process[pairs], rtol=1e-6)
            assert np.all(table < 0), "every pair's row was filled"

    def test_precomputed_reference_is_reused_and_resumes_exactly(self, tmp_path):
        """4 steps with a checkpoint at step 2; resumed runs log the uninterrupted run's steps 2 and 3, whether they
        read the stored table or (table removed) rebuild it from a fresh copy of the starting weights, never from the
        moved policy."""
        data, cache = _small_pairs(tmp_path), tmp_path / "cache"
        every_2 = ["--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.dirpath=ckpt"]
        every_2 += ["--trainer.callbacks.every_n_train_steps=2", "--trainer.callbacks.save_top_k=-1"]
        steps = ["--trainer.max_steps", "4", "--model.init_args.schedule.decay_steps", "4", *PRECOMPUTED]
        full, err = _fit(tmp_path / "full", cache, TINY_MODEL, *data, *every_2, *steps)
        assert "from the policy before its first step" in err
        (ckpt,) = (tmp_path / "full/runs/tiny_dpo/ckpt").glob("*step=2.ckpt")
        resumed, err = _fit(tmp_path / "resumed", cache, TINY_MODEL, *data, *steps, "--ckpt_path", str(ckpt))
        assert "reference log-probabilities of train (46 pairs) read from" in err and "computed in" not in err
        assert [resumed[s]["train/loss"] for s in (2, 3)] == [full[s]["train/loss"] for s in (2, 3)]
        for path in (cache / "reference").glob("*.npz"):
            path.unlink()
        rebuilt, err = _fit(tmp_path / "rebuilt", cache, TINY_MODEL, *data, *steps, "--ckpt_path", str(ckpt))
        assert "from a copy of the starting policy (the resumed policy has moved)) computed" in err
        assert [rebuilt[s]["train/loss"] for s in (2, 3)] == [full[s]["train/loss"] for s in (2, 3)]


@pytest.mark.slow
@pytest.mark.distributed
class TestReferenceModesFit:
    def test_precomputed_reference_under_context_parallelism_equals_one_process(self, tmp_path):
        """CP 2: the table is computed on the shares of every pack (one rank of the group contributing each pair)
        and the steps log one process's losses, metrics and gradient norms."""
        data = _small_pairs(tmp_path)
        one, _ = _fit(tmp_path / "one", tmp_path / "cache_one", TINY_MODEL, *data, *PRECOMPUTED)
        fragment = FSDP.format(extra="      context_parallel_size: 2\n")
        split, err = _fit(tmp_path / "cp", tmp_path / "cache_cp", TINY_MODEL, *data, *PRECOMPUTED, fragment=fragment)
        assert "reference log-probabilities of train (46 pairs, 31 packs on 1 data rank(s)" in err
        _close(split, one, range(3), keys=(*LOGGED, "train/grad_norm"), abs_=REWARD_ATOL)
        want, got = _tables(tmp_path / "cache_one"), _tables(tmp_path / "cache_cp")
        assert sorted(got) == sorted(want) == [16, 46]
        for pairs, table in got.items():
            np.testing.assert_allclose(table, want[pairs], rtol=1e-6)

    def test_a_synced_reference_is_training_state_and_resumes_exactly(self, tmp_path, data_cache):
        """TR-DPO (``sync_every: 1``): the checkpoint holds the moved reference, so a run resumed at step 2 logs the
        uninterrupted run's steps 2 and 3; the sync acts (other margins than a fixed reference)."""
        every_2 = ["--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.dirpath=ckpt"]
        every_2 += ["--trainer.callbacks.every_n_train_steps=2", "--trainer.callbacks.save_top_k=-1"]
        steps = ["--trainer.max_steps", "4", "--model.init_args.schedule.decay_steps", "4"]
        sync = ["--model.init_args.reference", "{mode: live, sync_every: 1, mixup_alpha: 0.5}"]
        fixed, _ = _fit(tmp_path / "fixed", data_cache, TINY_MODEL, *steps)
        full, _ = _fit(tmp_path / "full", data_cache, TINY_MODEL, *every_2, *steps, *sync)
        assert full[2]["train/rewards/margins"] != fixed[2]["train/rewards/margins"]
        (ckpt,) = (tmp_path / "full/runs/tiny_dpo/ckpt").glob("*step=2.ckpt")
        saved = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
        assert any(key.startswith("reference.frozen.") for key in saved)
        resumed, _ = _fit(tmp_path / "resumed", data_cache, TINY_MODEL, *steps, *sync, "--ckpt_path", str(ckpt))
        assert [resumed[s]["train/loss"] for s in (2, 3)] == [full[s]["train/loss"] for s in (2, 3)]


@pytest.mark.slow
@pytest.mark.distributed
class TestKTOFit:
    @pytest.fixture(scope="class")
    def one_process(self, tmp_path_factory, data_cache) -> dict[int, dict]:
        """KTO (desirable rows weighted 1.2), 3 steps on one process, 4 packs per step."""
        work = tmp_path_factory.mktemp("kto_one")
        return _fit(work, data_cache, TINY_MODEL, "--data.micro_batches_per_step", "4", recipe=KTO)[0]

    def test_fsdp_on_two_ranks_equals_one_process(self, tmp_path, data_cache, one_process):
        """Each micro-batch's KL reference point is its own estimate, so 2 FSDP ranks x 2 micro-batches give the
        losses and metrics of one process reading the same 4 packs."""
        two = ["--data.micro_batches_per_step", "2"]
        sharded, err = _fit(tmp_path, data_cache, TINY_MODEL, *two, fragment=FSDP.format(extra=""), recipe=KTO)
        assert "loss kto (beta 0.1), reference: live" in err
        _close(sharded, one_process, range(3), keys=KTO_LOGGED, abs_=REWARD_ATOL)
        assert one_process[0]["train/kl"] == 0 and one_process[0]["train/rewards/chosen"] == 0
        assert one_process[2]["train/kl"] > 0, "the reference point moved off 0 (the clamp did not hide it)"

    def test_context_parallel_two_ranks_equal_one_process(self, tmp_path, data_cache, one_process):
        """CP 2: the labels reach both shares, and each completion's log-probability (own and mismatched) is summed
        over the two shares of its pack (documents cross the cut): the losses and metrics of one process."""
        fragment = FSDP.format(extra="      context_parallel_size: 2\n")
        four = ["--data.micro_batches_per_step", "4"]
        split, _ = _fit(tmp_path, data_cache, TINY_MODEL, *four, fragment=fragment, recipe=KTO)
        _close(split, one_process, range(3), keys=KTO_LOGGED, abs_=REWARD_ATOL)
