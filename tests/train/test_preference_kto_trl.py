"""xtl's KTO against TRL's ``KTOTrainer``, on the same weights and the same token ids, in fp64.

TRL tokenizes and collates a few unpaired rows (each with its mismatched KL completion, the previous row's, rotated
within the batch) and computes its loss and logged metrics with its own code on its own batch. xtl packs the same ids
(each row's own sequence, then its KL sequence; labels where TRL's ``completion_mask`` marks the completion), runs the
same weights, and computes :func:`~xtl.train.preference.sequence_logps`, the KL reference point
(:meth:`~xtl.train.preference_loss.PreferenceLoss.kl_point`, the batch's mean clamped at 0) and
:meth:`~xtl.train.preference_loss.PreferenceLoss.terms` with the rows' labels; the step's loss is ``loss_sum / rows``
and its metrics :meth:`~xtl.train.preference_loss.PreferenceLoss.metric_means`. Everything is compared within
``RTOL`` (fp64 on both sides, as the DPO comparison: ``tests/train/test_preference_trl.py`` says why; measured
<= 5.1e-13 relative).

The KL reference point is positive only when the policy puts more mass on the mismatched completions than the
reference: the "policy" of the ``kl_positive`` cases is the unperturbed model and the "reference" the perturbed one,
so that the point is not clamped to 0 (each case checks which way it went).
"""

from __future__ import annotations

from pathlib import Path

import datasets  # noqa: E402 - trl and datasets are dev dependencies: a missing one fails, never skips
import pytest
import torch
import trl  # noqa: E402
from transformers import Qwen3ForCausalLM

from xtl.train.preference_loss import PreferenceLoss

from .test_preference_trl import (  # noqa: F401 - fixtures
    RTOL,
    Sequence,
    Weights,
    _common_args,
    _offline_fp64_head,
    assert_rel,
    checkpoints,
    logged_metrics,
    logps,
    pack,
    pair_count,
    tokenizer,
    weights,
)

pytestmark = pytest.mark.filterwarnings("ignore:.*is deprecated and will be removed in v6:FutureWarning")


def _row(prompt: str, completion: str, label: bool) -> dict:
    return {
        "prompt": [{"role": "user", "content": prompt}],
        "completion": [{"role": "assistant", "content": completion}],
        "label": label,
    }


ROWS = [
    _row("What colour is the sky?", "Blue, on a clear day.", True),
    _row("Name a fruit.", "A chair is a fruit, obviously, and so is a table.", False),
    _row("Two plus two?", "Four.", True),
    _row("Say hello.", "No.", False),
    _row("Count to three.", "One, two, three.", True),
]
KTO_METRICS = ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")
CASES = {
    "kto": (dict(loss_type="kto", beta=0.1), True),
    "kto_kl_positive": (dict(loss_type="kto", beta=0.5), False),
    "kto_weighted_kl_positive": (dict(loss_type="kto", beta=0.2, desirable_weight=1.3, undesirable_weight=0.7), False),
    "apo_zero_unpaired": (dict(loss_type="apo_zero_unpaired", beta=0.3), True),
}


def run_kto(policy: Path, reference: Path, tokenizer, tmp_path: Path, **config) -> tuple[float, dict, dict]:  # noqa: F811
    """``KTOTrainer.compute_loss`` on the collated rows (policy in eval mode: its metrics are logged as ``eval_``)."""
    hf = {
        name: Qwen3ForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float64).eval()
        for name, path in (("policy", policy), ("reference", reference))
    }
    args = trl.KTOConfig(**_common_args(tmp_path, ROWS), **config)
    trainer = trl.KTOTrainer(
        model=hf["policy"],
        ref_model=hf["reference"],
        args=args,
        train_dataset=datasets.Dataset.from_list(ROWS),
        processing_class=tokenizer,
    )
    assert trainer.accelerator.mixed_precision == "no"
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(ROWS))])
    trainer.model.eval()
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch)
    metrics = logged_metrics(trainer)
    return float(loss), metrics, batch


def _pairs(batch: dict) -> list[tuple[Sequence, Sequence]]:
    """(own sequence, KL sequence) per row, labels where TRL's completion masks are set (``apo_zero_unpaired``
    needs no KL sequence: the own one stands in)."""

    def sequence(prefix: str, row: int) -> Sequence:
        keep = batch[f"{prefix}attention_mask"][row].bool()
        ids = batch[f"{prefix}input_ids"][row][keep]
        return ids.numpy(), torch.where(batch[f"{prefix}completion_mask"][row][keep].bool(), ids, -100).numpy()

    kl = "KL_" if "KL_input_ids" in batch else ""
    return [(sequence("", k), sequence(kl, k)) for k in range(len(batch["input_ids"]))]


class TestKTOMatchesTRL:
    @pytest.mark.parametrize("case", sorted(CASES))
    def test_loss_and_metrics(self, case, checkpoints, tokenizer, tmp_path):  # noqa: F811 - the imported fixtures
        config, as_saved = CASES[case]
        reference_dir, policy_dir = checkpoints if as_saved else checkpoints[::-1]
        loss, metrics, batch = run_kto(policy_dir, reference_dir, tokenizer, tmp_path, **config)
        assert batch["label"].tolist() == [r["label"] for r in ROWS]
        objective = PreferenceLoss(**config)
        sides = Weights.load(reference_dir, policy_dir, torch.float64)
        mb = pack(_pairs(batch), padding=5)
        assert pair_count(mb) == len(ROWS)
        policy, nll_sum = logps(sides.policy, mb)
        reference, _ = logps(sides.reference, mb)
        kl = objective.kl_point(policy, reference) if config["loss_type"] == "kto" else None
        terms = objective.terms(policy, reference, nll_sum, batch["label"].bool(), kl)
        rows = torch.tensor(float(len(ROWS)), dtype=torch.float64)
        means = objective.metric_means(terms.metric_sums, rows)
        assert_rel(float(terms.loss_sum / rows), loss, "loss", RTOL)
        if config["loss_type"] == "kto":
            assert (metrics["kl"] > 0) == ("positive" in case), metrics["kl"]  # the clamp went the intended way
            assert_rel(float(means["kl"]), metrics["kl"], "kl", RTOL)
        for name in KTO_METRICS[1:]:
            assert_rel(float(means[name]), metrics[name], name, RTOL)
