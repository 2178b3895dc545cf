"""xtl's preference objectives against TRL's own trainers, on the same weights and the same token ids, in fp64.

For each loss TRL implements, TRL (``DPOTrainer``; ``CPOTrainer`` with ``loss_type: simpo``; ``ORPOTrainer``)
tokenizes and collates a few pairs and computes its loss and logged metrics with its own code on its own batch. xtl
packs the same ids (one document per sequence, chosen then rejected; labels where TRL's completion mask / labels mark
the response), runs the same weights (a tiny Qwen3 saved by transformers, loaded with ``from_hf``) and computes
:func:`~xtl.train.preference.sequence_logps` and :meth:`~xtl.train.preference_loss.PreferenceLoss.terms`; the
step's loss is ``loss_sum / P + nll_weight * nll_sum / N`` (``P`` pairs, ``N`` chosen response tokens) and its
metrics ``metric_sums / P``. The losses and metrics are compared within ``RTOL`` = 1e-6 relative.

The policy differs from the reference (its weights are perturbed), so the DPO rewards are far from zero, and some
pairs are ranked right and some wrong.

Both sides run in float64, because the rewards, margins and losses are differences of log-probabilities (policy minus
reference, chosen minus rejected) one to three orders of magnitude smaller than them: in fp32 the log-probabilities'
1-2 ulps become up to ~2e-5 relative there. In fp64:

- TRL's configs default to ``bf16=True`` even on CPU, under which accelerate runs the (prepared) reference model in a
  bf16 autocast: every config sets ``bf16=False, fp16=False`` (each run checks accelerate's ``mixed_precision`` is
  ``no`` and that TRL's per-sequence log-probabilities come out in fp64).
- Attention is ``sdpa`` on both sides (transformers' eager attention, like xtl's, takes its softmax in fp32). The
  RMSNorm statistics and the rotary ``cos``/``sin`` are fp32 in transformers and in xtl alike, with the same ops on
  the same values: they round identically.
- ``DPOTrainer`` scores tokens with TRL's fused LM head (``trl.kernels.ChunkedLogProbFunction``), which folds the
  logits into fp32 statistics whatever their dtype: fp32 log-probabilities. For fp64 hidden states
  :class:`ExactLogProbs` stands in for it (TRL's ``selective_log_softmax`` on the full logits, as ``CPOTrainer`` and
  ``ORPOTrainer`` score theirs); the rest of the trainer (batch, masks, sums, loss, metrics) is TRL's own, and the
  stand-in is checked against TRL's kernel to fp32 precision (fp32 models keep TRL's kernel).
- ``ORPOTrainer.odds_ratio_loss`` casts the log-probabilities to fp32, so its logged rewards are fp32: its
  ``rewards/*`` are compared within 1e-6 relative plus one fp32 ulp of the rewards (:func:`fp32_reward_atol`).

Measured (fp64, xtl's own packed forward against TRL): per-sequence log-probabilities <= 2.5e-16 relative; DPO losses
and metrics (sigmoid, hinge, IPO, robust, sigmoid + RPO, cDPO) <= 5e-14, SimPO's (with and without NLL, smoothed)
<= 2e-14, the same formulas on TRL's own log-probabilities <= 2e-16; ORPO's loss <= 8e-8 (TRL's odds-ratio term is
fp32), its ``rewards/margins`` 8.9e-8 and 8.8e-9 off (2.3e-6 and 9e-7 relative; the allowance is 3.5e-7), its other
metrics <= 1.1e-7. TRL's fused kernel on the fp64 model is within 8.5e-8 of :class:`ExactLogProbs`. The fp32 path
(TRL's fused kernel and ``concatenated_forward``, xtl's fp32 forward) is checked on the per-sequence log-probabilities
(measured <= 1.7e-7), within ``RTOL``.

Two differences between xtl and TRL 1.16 are pinned here rather than hidden:

- ``DPOTrainer``'s ``sigmoid`` loss ignores ``label_smoothing``; xtl's is then conservative DPO (cDPO, which earlier
  TRL releases applied through ``label_smoothing``), checked against TRL's sigmoid loss on the batch and on the batch
  with chosen and rejected swapped: ``(1 - e) * L(batch) + e * L(swapped)``.
- ``ORPOTrainer``'s NLL term covers the prompt as well as the chosen response; xtl's covers the response (its labels).
  The whole loss is compared on one-token prompts (where the prompt has no target, so both cover the same tokens);
  with longer prompts the odds-ratio term (TRL's loss minus its logged ``nll_loss``) is compared.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from pathlib import Path

import datasets  # noqa: E402 - trl and datasets are dev dependencies: a missing one fails, never skips
import numpy as np
import pytest
import torch
import trl  # noqa: E402
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM  # noqa: E402

from xtl.data.collate import MicroBatch, collate_pack
from xtl.data.packing import Pack
from xtl.model import get_model_config_from_hf
from xtl.train.preference import pair_count, sequence_logps
from xtl.train.preference_loss import METRICS, PairTerms, PreferenceLoss, SequenceLogps
from xtl.train.scorer import score_tokens
from xtl.utils import resolve_pretrained

pytestmark = pytest.mark.filterwarnings("ignore:.*is deprecated and will be removed in v6:FutureWarning")

with warnings.catch_warnings():  # "You are importing from 'trl.experimental'"
    warnings.simplefilter("ignore")
    from trl.experimental.cpo import CPOConfig, CPOTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer
import trl.trainer.utils as trl_utils  # noqa: E402

# Every loss and metric of xtl against TRL's (module docstring: measured <= 5e-14 in fp64, but for ORPO's fp32 terms),
# and the fp32 per-sequence log-probabilities (sums of 9-31 token log-probs of about -7: 1-2 ulps, <= 1.7e-7 relative).
RTOL = 1e-6
# fp64 per-sequence log-probabilities, xtl's packed forward against TRL's padded one (measured <= 2.5e-16).
LOGPS_RTOL_FP64 = 1e-12
TINY_QWEN3 = dict(
    vocab_size=1600, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=256, initializer_range=0.1, tie_word_embeddings=False,
)  # fmt: skip


def _turns(prompt: str, chosen: str, rejected: str) -> dict:
    return {
        "prompt": [{"role": "user", "content": prompt}],
        "chosen": [{"role": "assistant", "content": chosen}],
        "rejected": [{"role": "assistant", "content": rejected}],
    }


# conversational pairs of different lengths (the chosen response is sometimes the longer, sometimes the shorter)
CHAT_ROWS = [
    _turns("What colour is the sky?", "Blue, on a clear day.", "Green."),
    _turns("Name a fruit.", "An apple.", "A chair is a fruit, obviously, and so is a table."),
    _turns("Two plus two?", "Four.", "Five, I think, or maybe six."),
    _turns("Say hello.", "Hello there, nice to meet you!", "No."),
]
# plain pairs whose prompt is one token: no prompt token is a target, so ORPO's NLL (prompt and response in TRL)
# covers the same tokens as xtl's (the response)
ONE_TOKEN_PROMPT_ROWS = [
    {"prompt": "The", "chosen": " sky is blue.", "rejected": " sky is green, or red."},
    {"prompt": "Q", "chosen": ": what is two plus two?", "rejected": ": no."},
    {"prompt": "The", "chosen": " cat sat on the mat.", "rejected": " mat sat on the cat, said the dog."},
]


TRL_FUSED_LOGPROBS = trl.kernels.ChunkedLogProbFunction  # what DPOTrainer's fused head calls (trl_utils imports it)


class ExactLogProbs:
    """Stands in for TRL's fused LM head (``trl.kernels.ChunkedLogProbFunction``, which ``DPOTrainer``'s patched
    forward calls) on fp64 hidden states: the kernel folds the logits into fp32 statistics (fp32 log-probabilities,
    ~5e-7 off at -7) whatever their dtype. Here the log-probabilities are TRL's ``selective_log_softmax`` of the full
    fp64 logits, with the entropy, mean logit and top-1 flag ``DPOTrainer`` logs; other dtypes go to the kernel."""

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, softcapping, logit_scale, outputs):  # noqa: ANN001, ANN205
        if hidden.dtype != torch.float64:
            return TRL_FUSED_LOGPROBS.apply(
                hidden, weight, bias, targets, temperature, chunk_size, softcapping, logit_scale, outputs
            )
        assert bias is None and softcapping is None and temperature == 1.0 and logit_scale == 1.0
        assert "log_sum_sq_probs" not in outputs
        logits = hidden @ weight.t()
        entropy = logits.logsumexp(-1) - (logits.softmax(-1) * logits).sum(-1) if "entropy" in outputs else None
        mean_logits = logits.mean(-1) if "mean_logits" in outputs else None
        is_top1 = logits.argmax(-1) == targets if "is_top1" in outputs else None
        return trl_utils.selective_log_softmax(logits, targets), entropy, None, mean_logits, is_top1


@pytest.fixture(autouse=True)
def _offline_fp64_head(monkeypatch: pytest.MonkeyPatch) -> None:
    """No hub access: everything is built locally. TRL's fused LM head computes in fp64 on fp64 models (TRL has no
    public hook for its kernel: the name its trainer calls, ``trl.trainer.utils._ChunkedLogProbFunction``, is
    replaced)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", ExactLogProbs)


@dataclass
class Weights:
    """The reference and the (perturbed) policy, as transformers checkpoints and as xtl models."""

    reference_dir: Path
    policy_dir: Path
    dtype: torch.dtype
    reference: torch.nn.Module
    policy: torch.nn.Module

    @classmethod
    def load(cls, reference_dir: Path, policy_dir: Path, dtype: torch.dtype) -> Weights:
        return cls(reference_dir, policy_dir, dtype, _load_xtl(reference_dir, dtype), _load_xtl(policy_dir, dtype))

    def hf(self, which: str) -> Qwen3ForCausalLM:
        """A fresh transformers copy (each TRL trainer patches the forward of the models it gets)."""
        path = self.policy_dir if which == "policy" else self.reference_dir
        return Qwen3ForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=self.dtype).eval()


def _load_xtl(path: Path, dtype: torch.dtype) -> torch.nn.Module:
    config = get_model_config_from_hf(path)
    config.attn_impl = "sdpa"  # as transformers' (module docstring)
    with torch.device("meta"):
        model = config.build()
    model.from_hf(path)
    return model.to(dtype).eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The reference and the policy, saved (fp32) by transformers."""
    root = tmp_path_factory.mktemp("preference_trl")
    torch.manual_seed(0)
    reference = Qwen3ForCausalLM(Qwen3Config(**TINY_QWEN3, attn_implementation="eager")).eval()
    policy = copy.deepcopy(reference)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.03 * torch.randn(p.shape, generator=g))
    reference.save_pretrained(root / "reference")
    policy.save_pretrained(root / "policy")
    return root / "reference", root / "policy"


@pytest.fixture(scope="module")
def weights(checkpoints) -> Weights:
    """Both sides in fp64 (the comparisons of losses and metrics)."""
    return Weights.load(*checkpoints, torch.float64)


@pytest.fixture(scope="module")
def weights32(checkpoints) -> Weights:
    """Both sides in fp32 (TRL's fused kernel and xtl's forward as they train)."""
    return Weights.load(*checkpoints, torch.float32)


WEIGHTS = {"fp32": "weights32", "fp64": "weights"}  # fixture by dtype, for tests run in both


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_pretrained("tiny:", "tokenizer"))


# ---- TRL side --------------------------------------------------------------------------------------------------

Sequence = tuple[np.ndarray, np.ndarray]  # (ids, unshifted labels: the id on response tokens, -100 elsewhere)


@dataclass
class TrlRun:
    """What TRL computed on its batch: its loss, its logged metrics, its per-sequence log-probabilities (with its
    response token counts), and its sequences as (chosen, rejected) pairs for xtl to pack."""

    trainer: object
    batch: dict
    loss: float
    metrics: dict[str, float]
    policy: SequenceLogps
    reference: SequenceLogps | None
    pairs: list[tuple[Sequence, Sequence]]


def logged_metrics(trainer: object) -> dict[str, float]:
    """What a TRL trainer in eval mode logs of the ``compute_loss`` calls since its last log (their mean, here of
    one call), read back through the public ``Trainer.log`` and ``state.log_history``, without the ``eval_``
    prefix."""
    trainer.log({})
    logged = trainer.state.log_history[-1]
    return {key.removeprefix("eval_"): value for key, value in logged.items() if key.startswith("eval_")}


def _common_args(tmp_path: Path, rows: list[dict]) -> dict:
    return dict(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False, fp16=False,
        per_device_train_batch_size=len(rows), save_strategy="no", logging_strategy="no", disable_tqdm=True,
    )  # fmt: skip


def _dpo_pairs(batch: dict) -> list[tuple[Sequence, Sequence]]:
    """DPO rows are [chosen of every pair, rejected of every pair]; labels where ``completion_mask`` is set."""
    ids, attention, completion = batch["input_ids"], batch["attention_mask"].bool(), batch["completion_mask"].bool()
    half = ids.shape[0] // 2

    def sequence(row: int) -> Sequence:
        keep = attention[row]
        row_ids = ids[row][keep]
        return row_ids.numpy(), torch.where(completion[row][keep], row_ids, -100).numpy()

    return [(sequence(k), sequence(half + k)) for k in range(half)]


def _cpo_pairs(batch: dict) -> list[tuple[Sequence, Sequence]]:
    """CPO/ORPO batches hold ``chosen_*`` and ``rejected_*`` tensors; labels are their ``*_labels``."""

    def sequence(side: str, k: int) -> Sequence:
        keep = batch[f"{side}_attention_mask"][k].bool()
        return batch[f"{side}_input_ids"][k][keep].numpy(), batch[f"{side}_labels"][k][keep].numpy()

    return [(sequence("chosen", k), sequence("rejected", k)) for k in range(len(batch["chosen_input_ids"]))]


def run_dpo(weights: Weights, tokenizer, tmp_path: Path, rows: list[dict], **config) -> TrlRun:
    """``DPOTrainer.compute_loss`` on the collated rows (policy in eval mode: its metrics are logged as ``eval_``);
    the per-sequence log-probabilities from its ``compute_ref_log_probs`` (the same fused-head call and sum)."""
    args = trl.DPOConfig(**_common_args(tmp_path, rows), **config)
    trainer = trl.DPOTrainer(
        model=weights.hf("policy"),
        ref_model=weights.hf("reference"),
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tokenizer,
    )
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(rows))])
    trainer.model.eval()
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch)
    logged = logged_metrics(trainer)
    metrics = {name: logged[name] for name in METRICS}
    chosen_tokens, rejected_tokens = batch["completion_mask"].sum(dim=1).float().chunk(2)
    policy, reference = (
        SequenceLogps(*trainer.compute_ref_log_probs(model, batch), chosen_tokens, rejected_tokens)
        for model in (trainer.model, trainer.ref_model)
    )
    return _checked(TrlRun(trainer, batch, float(loss), metrics, policy, reference, _dpo_pairs(batch)), weights)


def run_reference_free(kind: str, weights: Weights, tokenizer, tmp_path: Path, rows: list[dict], **config) -> TrlRun:
    """``CPOTrainer`` / ``ORPOTrainer.compute_loss`` (which returns its logged metrics) on the collated rows; the
    per-sequence log-probabilities from their ``concatenated_forward`` (averaged per token for SimPO and ORPO)."""
    config_cls, trainer_cls = (CPOConfig, CPOTrainer) if kind == "cpo" else (ORPOConfig, ORPOTrainer)
    args = config_cls(**_common_args(tmp_path, rows), max_length=256, **config)
    trainer = trainer_cls(
        model=weights.hf("policy"),
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tokenizer,
    )
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(rows))])
    trainer.model.eval()
    with torch.no_grad():
        loss, metrics = trainer.compute_loss(trainer.model, batch, return_outputs=True)
        chosen, rejected = trainer.concatenated_forward(trainer.model, batch)[:2]
    metrics = {name: float(value) for name, value in metrics.items()}
    chosen_tokens, rejected_tokens = (
        (batch[f"{s}_labels"][:, 1:] != -100).sum(1).float() for s in ("chosen", "rejected")
    )
    policy = SequenceLogps(chosen * chosen_tokens, rejected * rejected_tokens, chosen_tokens, rejected_tokens)
    return _checked(TrlRun(trainer, batch, float(loss), metrics, policy, None, _cpo_pairs(batch)), weights)


def _checked(run: TrlRun, weights: Weights) -> TrlRun:
    """No autocast in TRL's forward: accelerate's mixed precision is off and the log-probabilities are in the
    weights' dtype."""
    assert run.trainer.accelerator.mixed_precision == "no"
    assert run.policy.chosen.dtype == weights.dtype
    return run


# ---- xtl side --------------------------------------------------------------------------------------------------


def pack(pairs: list[tuple[Sequence, Sequence]], padding: int = 0) -> MicroBatch:
    """One packed micro-batch: chosen, rejected, chosen, rejected, ... (labels unshifted; collate shifts them),
    then ``padding`` padding tokens."""
    sequences = [s for pair in pairs for s in pair]
    ids = np.concatenate([s[0] for s in sequences]).astype(np.int64)
    labels = np.concatenate([s[1] for s in sequences]).astype(np.int64)
    return collate_pack(Pack(0, ids, labels, [len(s[0]) for s in sequences]), 0, len(ids) + padding)


def logps(model: torch.nn.Module, mb: MicroBatch) -> tuple[SequenceLogps, torch.Tensor]:
    with torch.no_grad():
        return sequence_logps(score_tokens(model, mb.seq_ctx, mb.labels), mb)


def step(
    objective: PreferenceLoss, policy: SequenceLogps, reference: SequenceLogps | None, nll_sum: torch.Tensor
) -> tuple[float, dict[str, float]]:
    """The step's loss and logged metrics when one micro-batch holds every pair (as ``PreferenceModule``)."""
    terms = objective.terms(policy, reference, nll_sum)
    pairs = policy.chosen.numel()
    loss = terms.loss_sum / pairs + objective.nll_weight * terms.nll_sum / policy.chosen_tokens.sum()
    return float(loss), {name: float(value / pairs) for name, value in terms.metric_sums.items()}


def xtl_step(weights: Weights, objective: PreferenceLoss, pairs: list) -> tuple[float, dict[str, float]]:
    """:func:`step` on xtl's own forward of the pairs, packed (with padding) into one micro-batch."""
    mb = pack(pairs, padding=7)
    assert pair_count(mb) == len(pairs)
    policy, nll_sum = logps(weights.policy, mb)
    reference = logps(weights.reference, mb)[0] if objective.needs_reference else None
    return step(objective, policy, reference, nll_sum)


def trl_logps_step(objective: PreferenceLoss, run: TrlRun) -> tuple[float, dict[str, float]]:
    """:func:`step` on TRL's own per-sequence log-probabilities (the NLL sum is minus the chosen ones, as in
    :func:`sequence_logps`)."""
    return step(objective, run.policy, run.reference, -run.policy.chosen.sum())


def assert_rel(actual: float, expected: float, what: str, rtol: float, atol: float = 0.0) -> None:
    """``|actual - expected| <= rtol * |expected| + atol`` (an exact match for a zero without ``atol``)."""
    assert abs(actual - expected) <= rtol * abs(expected) + atol, f"{what}: xtl {actual!r} vs TRL {expected!r}"


def assert_matches(
    result: tuple[float, dict[str, float]],
    run: TrlRun,
    rtol: float,
    expected_loss: float | None = None,
    reward_atol: float = 0.0,
) -> None:
    """xtl's ``(loss, metrics)`` equal TRL's (or ``expected_loss``) within ``rtol`` (plus ``reward_atol`` on the
    ``rewards/*`` metrics)."""
    loss, metrics = result
    assert_rel(loss, run.loss if expected_loss is None else expected_loss, "loss", rtol)
    for name in METRICS:
        atol = reward_atol if name.startswith("rewards/") else 0.0
        assert_rel(metrics[name], run.metrics[name], name, rtol, atol)


def fp32_reward_atol(run: TrlRun) -> float:
    """One fp32 ulp (at most) of TRL's rewards: ``ORPOTrainer.odds_ratio_loss`` casts the log-probabilities to fp32,
    so each reward (``beta`` times one, rounded twice) is up to an ulp off, and ``rewards/margins``, their difference
    (40-150x smaller here), up to the sum of both (the rewards are all negative: means bound them)."""
    return 2.0**-23 * (abs(run.metrics["rewards/chosen"]) + abs(run.metrics["rewards/rejected"]))


# ---- tests -----------------------------------------------------------------------------------------------------

DPO_CASES = {
    "sigmoid": (dict(loss_type=["sigmoid"], beta=0.1), PreferenceLoss("sigmoid", beta=0.1)),
    "hinge": (dict(loss_type=["hinge"], beta=0.5), PreferenceLoss("hinge", beta=0.5)),  # two of four pairs at 0
    "ipo": (dict(loss_type=["ipo"], beta=0.3), PreferenceLoss("ipo", beta=0.3)),
    "robust": (
        dict(loss_type=["robust"], beta=0.1, label_smoothing=0.1),
        PreferenceLoss("robust", beta=0.1, label_smoothing=0.1),
    ),
    "sigmoid_rpo": (
        dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5], beta=0.1),
        PreferenceLoss("sigmoid", beta=0.1, rpo_alpha=0.5),
    ),
}
SIMPO_CASES = {
    "simpo": (dict(beta=2.0, simpo_gamma=0.8, cpo_alpha=0.0), PreferenceLoss("simpo", beta=2.0, gamma=0.8)),
    "simpo_nll": (
        dict(beta=2.0, simpo_gamma=0.8, cpo_alpha=0.5),
        PreferenceLoss("simpo", beta=2.0, gamma=0.8, rpo_alpha=0.5),
    ),
    "simpo_smoothed": (
        dict(beta=2.0, simpo_gamma=0.8, cpo_alpha=0.0, label_smoothing=0.1),
        PreferenceLoss("simpo", beta=2.0, gamma=0.8, label_smoothing=0.1),
    ),
}


class TestDPOLossesMatchTRL:
    """DPO family: TRL's ``DPOTrainer`` loss and reward metrics on its batch equal xtl's within ``RTOL``, computed
    from TRL's per-sequence log-probabilities and from xtl's own packed forward (fp64)."""

    @pytest.mark.parametrize("case", sorted(DPO_CASES))
    def test_loss_and_metrics(self, case, weights, tokenizer, tmp_path):
        config, objective = DPO_CASES[case]
        run = run_dpo(weights, tokenizer, tmp_path, CHAT_ROWS, **config)
        assert_matches(trl_logps_step(objective, run), run, RTOL)
        result = xtl_step(weights, objective, run.pairs)
        assert_matches(result, run, RTOL)
        assert 0 < result[1]["rewards/accuracies"] < 1  # some pairs ranked right, some wrong

    def test_conservative_sigmoid_is_trl_sigmoid_mixed_with_swapped_pairs(self, weights, tokenizer, tmp_path):
        """xtl's ``sigmoid`` with ``label_smoothing`` e (cDPO) is ``(1 - e) L(d) + e L(-d)``. TRL 1.16's sigmoid
        ignores ``label_smoothing``, so ``L(-d)`` is its own loss on its batch with the chosen and rejected rows
        swapped. Within ``RTOL``, as above."""
        smoothing = 0.1
        run = run_dpo(weights, tokenizer, tmp_path, CHAT_ROWS, loss_type=["sigmoid"], beta=0.1, label_smoothing=0.1)
        half = run.batch["input_ids"].shape[0] // 2
        swapped = {key: torch.cat([value[half:], value[:half]]) for key, value in run.batch.items()}
        with torch.no_grad():
            flipped = float(run.trainer.compute_loss(run.trainer.model, swapped))
        expected = (1 - smoothing) * run.loss + smoothing * flipped
        assert abs(expected - run.loss) > 1e-3 * run.loss  # TRL's own loss is the unsmoothed one
        objective = PreferenceLoss("sigmoid", beta=0.1, label_smoothing=smoothing)
        assert_matches(trl_logps_step(objective, run), run, RTOL, expected_loss=expected)
        assert_matches(xtl_step(weights, objective, run.pairs), run, RTOL, expected_loss=expected)

    @pytest.mark.parametrize("dtype", sorted(WEIGHTS))
    def test_sequence_logps(self, dtype, request, tokenizer, tmp_path):
        """Each response's summed log-probability (policy and reference) and token count equal TRL's: the packed
        forward (with padding and a head restricted to the supervised rows) scores the same tokens as TRL's padded
        fused-head one. In fp32 (TRL's fused kernel) within ``RTOL``; in fp64 within ``LOGPS_RTOL_FP64``, where
        TRL's own kernel on the same fp64 model (fp32 statistics) agrees with :class:`ExactLogProbs` within
        ``RTOL``."""
        weights = request.getfixturevalue(WEIGHTS[dtype])
        run = run_dpo(weights, tokenizer, tmp_path, CHAT_ROWS, loss_type=["sigmoid"])
        mb = pack(run.pairs, padding=7)
        assert mb.seq_ctx.loss_positions is not None and mb.seq_ctx.num_padding == 7
        model_dtype = weights.dtype
        rtol = LOGPS_RTOL_FP64 if model_dtype == torch.float64 else RTOL
        for ours, theirs in (
            (logps(weights.policy, mb)[0], run.policy),
            (logps(weights.reference, mb)[0], run.reference),
        ):
            assert ours.chosen.dtype == model_dtype, "xtl's per-sequence log-probabilities not in the model dtype"
            torch.testing.assert_close(ours.chosen, theirs.chosen, rtol=rtol, atol=0)
            torch.testing.assert_close(ours.rejected, theirs.rejected, rtol=rtol, atol=0)
            assert torch.equal(ours.chosen_tokens, theirs.chosen_tokens)
            assert torch.equal(ours.rejected_tokens, theirs.rejected_tokens)
        if model_dtype == torch.float64:
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(trl_utils, "_ChunkedLogProbFunction", TRL_FUSED_LOGPROBS)
                fused = run.trainer.compute_ref_log_probs(run.trainer.model, run.batch)
            assert fused[0].dtype == torch.float32
            for kernel, exact in zip(fused, (run.policy.chosen, run.policy.rejected), strict=True):
                torch.testing.assert_close(kernel.double(), exact, rtol=RTOL, atol=0)


class TestSimPOMatchesTRL:
    """SimPO: TRL's ``CPOTrainer(loss_type="simpo")`` loss (``cpo_alpha`` is xtl's ``rpo_alpha``) and metrics equal
    xtl's within ``RTOL``, computed from TRL's per-sequence log-probabilities and from xtl's forward (fp64)."""

    @pytest.mark.parametrize("case", sorted(SIMPO_CASES))
    def test_loss_and_metrics(self, case, weights, tokenizer, tmp_path):
        config, objective = SIMPO_CASES[case]
        run = run_reference_free("cpo", weights, tokenizer, tmp_path, CHAT_ROWS, loss_type="simpo", **config)
        assert_matches(trl_logps_step(objective, run), run, RTOL)
        result = xtl_step(weights, objective, run.pairs)
        assert_matches(result, run, RTOL)
        assert 0 < result[1]["rewards/accuracies"] < 1

    @pytest.mark.parametrize("dtype", sorted(WEIGHTS))
    def test_average_logps(self, dtype, request, tokenizer, tmp_path):
        """Each response's log-probability per token (TRL's ``concatenated_forward``) equals xtl's summed
        log-probability over its token count, within ``RTOL`` (fp32) or ``LOGPS_RTOL_FP64``; the token counts are
        equal."""
        weights = request.getfixturevalue(WEIGHTS[dtype])
        rtol = LOGPS_RTOL_FP64 if weights.dtype == torch.float64 else RTOL
        run = run_reference_free("cpo", weights, tokenizer, tmp_path, CHAT_ROWS, loss_type="simpo")
        ours = logps(weights.policy, pack(run.pairs, padding=7))[0]
        for side in ("chosen", "rejected"):
            tokens = getattr(ours, f"{side}_tokens")
            assert torch.equal(tokens, getattr(run.policy, f"{side}_tokens"))
            expected = getattr(run.policy, side) / tokens
            torch.testing.assert_close(getattr(ours, side) / tokens, expected, rtol=rtol, atol=0)


class TestORPOMatchesTRL:
    """ORPO: TRL's ``ORPOTrainer`` loss and metrics equal xtl's within ``RTOL`` (its fp32 ``rewards/*`` within one
    fp32 ulp more: :func:`fp32_reward_atol`), computed from TRL's per-sequence log-probabilities and from xtl's
    forward (fp64)."""

    def test_loss_and_metrics(self, weights, tokenizer, tmp_path):
        """The whole loss, NLL included, on one-token prompts (TRL's NLL also covers the prompt, which then has no
        target)."""
        run = run_reference_free("orpo", weights, tokenizer, tmp_path, ONE_TOKEN_PROMPT_ROWS, beta=0.2)
        assert all(int((s[1] == -100).sum()) == 1 for pair in run.pairs for s in pair)  # the prompt token only
        objective, atol = PreferenceLoss("orpo", beta=0.2), fp32_reward_atol(run)
        assert_matches(trl_logps_step(objective, run), run, RTOL, reward_atol=atol)
        result = xtl_step(weights, objective, run.pairs)
        assert_matches(result, run, RTOL, reward_atol=atol)
        assert 0 < result[1]["rewards/accuracies"] < 1

    def test_odds_ratio_term_with_prompts(self, weights, tokenizer, tmp_path):
        """On chat prompts, TRL's loss minus its NLL (which covers the prompt too) is xtl's loss without its NLL
        (the odds-ratio term ``loss_sum / P``); the metrics are equal."""
        run = run_reference_free("orpo", weights, tokenizer, tmp_path, CHAT_ROWS, beta=0.2)
        objective, atol = PreferenceLoss("orpo", beta=0.2), fp32_reward_atol(run)
        expected = run.loss - run.metrics["nll_loss"]
        nll = -run.policy.chosen.sum() / run.policy.chosen_tokens.sum()  # xtl's NLL term: the responses only
        assert abs(float(nll) - run.metrics["nll_loss"]) > 1e-3 * run.metrics["nll_loss"]
        loss, metrics = trl_logps_step(objective, run)
        assert_matches((loss - float(nll), metrics), run, RTOL, expected_loss=expected, reward_atol=atol)
        mb = pack(run.pairs)
        policy, nll_sum = logps(weights.policy, mb)
        loss, metrics = step(objective, policy, None, nll_sum)
        loss -= float(nll_sum / policy.chosen_tokens.sum())
        assert_matches((loss, metrics), run, RTOL, expected_loss=expected, reward_atol=atol)


PACKING_OBJECTIVES = {
    "sigmoid_rpo": PreferenceLoss("sigmoid", beta=0.1, rpo_alpha=0.5),
    "ipo": PreferenceLoss("ipo", beta=0.3),
    "robust": PreferenceLoss("robust", beta=0.1, label_smoothing=0.1),
    "simpo": PreferenceLoss("simpo", beta=2.0, gamma=0.8),
    "orpo": PreferenceLoss("orpo", beta=0.2),
}


@pytest.fixture(scope="module")
def chat_pairs(weights32, tokenizer, tmp_path_factory) -> list[tuple[Sequence, Sequence]]:
    """The chat pairs as ``DPOTrainer`` tokenizes and collates them."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        return run_dpo(weights32, tokenizer, tmp_path_factory.mktemp("dpo"), CHAT_ROWS).pairs


class TestPackedEqualsUnpacked:
    """All pairs in one padded pack give the same loss, NLL and metric sums as one pair per pack (summed), within
    ``RTOL`` (1e-6 relative; the same tokens, in fp32, through attention and head calls of other shapes, which on CPU
    give the same bits)."""

    @pytest.mark.parametrize("name", sorted(PACKING_OBJECTIVES))
    def test_sums(self, name, weights32, chat_pairs):
        weights = weights32
        objective = PACKING_OBJECTIVES[name]

        def terms(mb: MicroBatch) -> PairTerms:
            policy, nll_sum = logps(weights.policy, mb)
            reference = logps(weights.reference, mb)[0] if objective.needs_reference else None
            return objective.terms(policy, reference, nll_sum)

        packed = terms(pack(chat_pairs, padding=7))
        singles = [terms(pack([pair])) for pair in chat_pairs]
        assert_rel(float(packed.loss_sum), float(sum(t.loss_sum for t in singles)), "loss_sum", RTOL)
        assert_rel(float(packed.nll_sum), float(sum(t.nll_sum for t in singles)), "nll_sum", RTOL)
        for key in METRICS:
            total = float(sum(t.metric_sums[key] for t in singles))
            assert_rel(float(packed.metric_sums[key]), total, key, RTOL)
