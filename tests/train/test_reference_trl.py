"""The reference policy against TRL's, through ``PreferenceModule`` and ``GRPOModule`` as they train (fp64, both
sides).

- A run that continues from a trained LoRA adapter (``LoRA.adapter_path``): TRL's ``DPOTrainer``, ``KTOTrainer`` and
  ``GRPOTrainer`` (with a KL term) given ``PeftModel.from_pretrained(base, adapter, is_trainable=True)`` and no
  ``ref_model`` keep a frozen copy of the starting adapter (their ``ref`` adapter). At the start the rewards are 0 and
  the DPO loss ``ln 2`` on both sides; after the policy's adapter moves (the same perturbation on both sides) the
  losses and metrics still agree within ``RTOL``: the reference stayed the starting adapter (the base model, which
  every reference mode used to resolve to, gives other numbers:
  :meth:`TestContinuedAdapter.test_the_base_model_is_not_the_reference`). For GRPO the old and reference
  log-probabilities are equal at the start (KL 0, ratio 1); after the adapter moved the reference's per-token
  log-probabilities equal TRL's ``ref`` adapter's (TRL's own scoring call, under its ``use_adapter``: no public API
  computes them) and the loss equals ``GRPOTrainer.compute_loss``'s.
- A separate reference model (``reference: {mode: model, model: <dir>}``, optionally ``adapter: <dir>``): TRL's
  ``ref_model`` (a transformers model, or a ``PeftModel`` of its own).

The batches are TRL's own (``data_collator`` on the rows of ``test_preference_trl`` / ``test_preference_kto_trl``),
packed for xtl as those tests pack them.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from types import SimpleNamespace

import datasets
import pytest
import torch
import trl
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import Qwen3ForCausalLM

from xtl.callbacks import LoRA
from xtl.model.hf.peft_adapter import load_peft_adapter
from xtl.train import PreferenceLoss, PreferenceModule
from xtl.train.preference import pair_count, sequence_logps
from xtl.train.preference_loss import METRICS
from xtl.train.scorer import score_tokens

from .test_preference_kto_trl import KTO_METRICS
from .test_preference_kto_trl import ROWS as KTO_ROWS
from .test_preference_kto_trl import _pairs as _kto_pairs
from .test_preference_trl import (  # noqa: F401 - fixtures
    CHAT_ROWS,
    RTOL,
    _common_args,
    _dpo_pairs,
    _offline_fp64_head,
    assert_rel,
    checkpoints,
    pack,
    tokenizer,
)

pytestmark = pytest.mark.filterwarnings("ignore:.*is deprecated and will be removed in v6:FutureWarning")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _hf(path: Path) -> Qwen3ForCausalLM:
    return Qwen3ForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float64).eval()


def _perturb(model: torch.nn.Module, marker: str, seed: int, scale: float) -> None:
    """Add seeded noise to every LoRA factor whose name holds ``marker`` (sorted by name: the same on both sides)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted((n, p) for n, p in model.named_parameters() if marker in n):
            param.add_(scale * torch.randn(param.shape, generator=generator, dtype=param.dtype))


@pytest.fixture(scope="module")
def adapter(checkpoints, tmp_path_factory) -> Path:  # noqa: F811
    """A trained PEFT LoRA adapter on the base model (random factors), saved by PEFT."""
    base = _hf(checkpoints[0])
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0))
    _perturb(model, "lora_", seed=5, scale=0.2)
    out = tmp_path_factory.mktemp("adapter") / "trained"
    model.save_pretrained(out)
    return out


def _module(model: Path, callbacks: tuple = (), **kwargs) -> PreferenceModule:
    """``PreferenceModule`` in fp64 with transformers' attention, built with the run's callbacks."""
    module = PreferenceModule(str(model), model_overrides={"attn_impl": "sdpa"}, param_dtype="float64", **kwargs)
    module._trainer = SimpleNamespace(callbacks=list(callbacks), strategy=None, global_step=0, ckpt_path=None)
    with pytest.warns(UserWarning, match="param_dtype float64"):
        module.configure_model()
    module._trainer = None
    return module


def _xtl(module: PreferenceModule, mb) -> tuple[float, dict[str, float]]:
    """One micro-batch's loss and metric means, as the module's step computes them."""
    with torch.no_grad():
        _, terms, _ = module._pair_terms(mb)
    pairs = pair_count(mb)
    loss = float(terms.loss_sum / pairs)
    return loss, {name: float(value / pairs) for name, value in terms.metric_sums.items()}


def _trl_dpo(trainer, rows) -> tuple[dict, float, dict[str, float]]:
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(rows))])
    trainer.model.eval()
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch)
    return batch, float(loss), {name: trainer._metrics["eval"][name][-1] for name in METRICS}


def _dpo_trainer(tmp_path: Path, tokenizer, policy, ref_model=None, **config):  # noqa: F811
    args = trl.DPOConfig(**_common_args(tmp_path, CHAT_ROWS), **config)
    return trl.DPOTrainer(
        model=policy,
        ref_model=ref_model,
        args=args,
        train_dataset=datasets.Dataset.from_list(CHAT_ROWS),
        processing_class=tokenizer,
    )


def _assert_same(xtl: tuple[float, dict[str, float]], loss: float, metrics: dict[str, float], names) -> None:
    assert_rel(xtl[0], loss, "loss", RTOL)
    for name in names:
        assert_rel(xtl[1][name], metrics[name], name, RTOL)


class TestContinuedAdapter:
    """DPO and KTO continued from a trained adapter: the reference is the starting adapter, as in TRL."""

    def test_dpo_starts_at_zero_and_keeps_the_starting_adapter(self, checkpoints, adapter, tokenizer, tmp_path):  # noqa: F811
        base = checkpoints[0]
        trainer = _dpo_trainer(tmp_path, tokenizer, PeftModel.from_pretrained(_hf(base), adapter, is_trainable=True))
        assert "ref" in trainer.model.peft_config, "TRL keeps a frozen copy of the starting adapter"
        module = _module(base, callbacks=(LoRA(adapter_path=str(adapter)),), objective=PreferenceLoss(beta=0.1))
        assert module.reference.mode == "live" and module.reference.frozen is None, "a view, no second model"
        batch, loss, metrics = _trl_dpo(trainer, CHAT_ROWS)
        mb = pack(_dpo_pairs(batch), padding=7)
        start = _xtl(module, mb)
        assert start[1]["rewards/chosen"] == start[1]["rewards/margins"] == 0.0
        assert start[0] == pytest.approx(math.log(2), rel=1e-12) and loss == pytest.approx(math.log(2), rel=1e-12)
        _assert_same(start, loss, metrics, METRICS)

        _perturb(trainer.model, ".default.", seed=11, scale=0.1)  # the policy's adapter trains, the reference stays
        trainer.model.save_pretrained(tmp_path / "moved", selected_adapters=["default"])
        load_peft_adapter(module.model, tmp_path / "moved")
        _, loss, metrics = _trl_dpo(trainer, CHAT_ROWS)
        moved = _xtl(module, mb)
        assert abs(metrics["rewards/margins"]) > 1e-3, "the policy moved away from the reference"
        _assert_same(moved, loss, metrics, METRICS)

    def test_the_base_model_is_not_the_reference(self, checkpoints, adapter, tokenizer, tmp_path):  # noqa: F811
        """What every mode used to resolve to: the base model gives rewards far from 0 at the start, and
        ``adapters_off`` is refused naming ``live``."""
        base = checkpoints[0]
        lora = LoRA(adapter_path=str(adapter))
        with pytest.raises(Exception, match="adapters_off, but LoRA.adapter_path .* use live"):
            _module(base, callbacks=(lora,), reference="adapters_off")
        module = _module(base, callbacks=(lora,))
        trainer = _dpo_trainer(tmp_path, tokenizer, PeftModel.from_pretrained(_hf(base), adapter, is_trainable=True))
        batch, _, _ = _trl_dpo(trainer, CHAT_ROWS)
        mb = pack(_dpo_pairs(batch), padding=7)
        views = lora.reference_views(module.model)
        with torch.no_grad():
            with views.base():
                base_logps = sequence_logps(score_tokens(module.model, mb.seq_ctx, mb.labels), mb)[0]
            with views.start():
                start_logps = sequence_logps(score_tokens(module.model, mb.seq_ctx, mb.labels), mb)[0]
            policy_logps = sequence_logps(score_tokens(module.model, mb.seq_ctx, mb.labels), mb)[0]
        torch.testing.assert_close(start_logps.chosen, policy_logps.chosen, rtol=0, atol=0)
        assert (base_logps.chosen - start_logps.chosen).abs().max() > 1e-2, "base rewards would be far from 0"

    @pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
    def test_kto_keeps_the_starting_adapter(self, checkpoints, adapter, tokenizer, tmp_path, loss_type):  # noqa: F811
        base = checkpoints[0]
        config = dict(loss_type=loss_type, beta=0.5)
        args = trl.KTOConfig(**_common_args(tmp_path, KTO_ROWS), **config)
        trainer = trl.KTOTrainer(
            model=PeftModel.from_pretrained(_hf(base), adapter, is_trainable=True),
            ref_model=None,
            args=args,
            train_dataset=datasets.Dataset.from_list(KTO_ROWS),
            processing_class=tokenizer,
        )
        assert "ref" in trainer.model.peft_config
        _perturb(trainer.model, ".default.", seed=12, scale=0.1)
        trainer.model.save_pretrained(tmp_path / "moved", selected_adapters=["default"])
        batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(KTO_ROWS))])
        trainer.model.eval()
        with torch.no_grad():
            loss = float(trainer.compute_loss(trainer.model, batch))
        metrics = {name: values[-1] for name, values in trainer._metrics["eval"].items()}

        module = _module(base, callbacks=(LoRA(adapter_path=str(adapter)),), objective=PreferenceLoss(**config))
        load_peft_adapter(module.model, tmp_path / "moved")
        mb = pack(_kto_pairs(batch), padding=5)
        mb.doc_tags = tuple(t for label in batch["label"].tolist() for t in (int(label), int(label)))
        with torch.no_grad():
            _, terms, _ = module._pair_terms(mb)
        rows = torch.tensor(float(len(KTO_ROWS)), dtype=torch.float64)
        means = module.objective.metric_means(terms.metric_sums, rows)
        assert abs(metrics["rewards/chosen"]) > 1e-3, "the policy moved away from the reference"
        assert_rel(float(terms.loss_sum / rows), loss, "loss", RTOL)
        for name in KTO_METRICS if loss_type == "kto" else KTO_METRICS[1:]:
            assert_rel(float(means[name]), metrics[name], name, RTOL)


class TestSeparateReferenceModel:
    """``reference: {mode: model}`` equals TRL's ``ref_model``."""

    def test_a_model_directory(self, checkpoints, tokenizer, tmp_path):  # noqa: F811
        reference_dir, policy_dir = checkpoints
        trainer = _dpo_trainer(tmp_path, tokenizer, _hf(policy_dir), _hf(reference_dir), beta=0.1)
        batch, loss, metrics = _trl_dpo(trainer, CHAT_ROWS)
        module = _module(policy_dir, reference={"mode": "model", "model": str(reference_dir)})
        assert module.reference.mode == "model" and module.reference.frozen is not None
        assert abs(metrics["rewards/margins"]) > 1e-3
        _assert_same(_xtl(module, pack(_dpo_pairs(batch), padding=7)), loss, metrics, METRICS)

    def test_a_model_with_its_own_adapter(self, checkpoints, adapter, tokenizer, tmp_path):  # noqa: F811
        """TRL's ``ref_model`` the reference with the adapter merged by PEFT (``merge_and_unload``: TRL's fused LM head
        patch does not take a ``PeftModel`` as ``ref_model``); xtl merges it into the reference's weights at load."""
        reference_dir, policy_dir = checkpoints
        ref = PeftModel.from_pretrained(_hf(reference_dir), adapter, autocast_adapter_dtype=False)  # fp64 factors
        ref = ref.merge_and_unload().eval()
        trainer = _dpo_trainer(tmp_path, tokenizer, _hf(policy_dir), ref, beta=0.1)
        batch, loss, metrics = _trl_dpo(trainer, CHAT_ROWS)
        spec = {"mode": "model", "model": str(reference_dir), "adapter": str(adapter)}
        module = _module(policy_dir, reference=spec)
        plain = _module(policy_dir, reference={"mode": "model", "model": str(reference_dir)})
        mb = pack(_dpo_pairs(batch), padding=7)
        assert abs(_xtl(module, mb)[1]["rewards/chosen"] - _xtl(plain, mb)[1]["rewards/chosen"]) > 1e-3
        _assert_same(_xtl(module, mb), loss, metrics, METRICS)


class GRPOHeadStandIn(torch.nn.Module):
    """Answers ``GRPOTrainer.compute_loss``'s scoring call with given per-token log-probabilities of the completions
    (as TRL's fused LM head returns them: ``GRPOTrainer`` has no entry that takes log-probabilities)."""

    def __init__(self, logps: torch.Tensor, prompt: int) -> None:
        super().__init__()
        self.logps, self.prompt = logps, prompt

    def forward(self, input_ids, attention_mask, labels=None, fused_lm_head=False, **kwargs):  # noqa: ANN001, ANN201
        pad = torch.zeros(self.logps.shape[0], self.prompt, dtype=self.logps.dtype)
        logps = torch.cat([pad, self.logps], 1)
        return SimpleNamespace(log_probs=logps, entropy=torch.zeros_like(logps))


class TestGRPOContinuedAdapter:
    """GRPO with a KL term, continued from a trained adapter: TRL's ``GRPOTrainer`` keeps the starting adapter as
    its ``ref`` adapter; xtl's reference is the same. At the start the KL is 0 and the ratio 1; once the adapter
    moved, the per-token reference and policy log-probabilities and the loss equal TRL's."""

    PROMPT, COMPLETION = 5, 6

    def test_the_reference_stays_the_starting_adapter(self, checkpoints, adapter, tokenizer, tmp_path):  # noqa: F811
        from trl.trainer.utils import use_adapter

        from xtl.rl import GRPOModule, PolicyLossConfig
        from xtl.rl.loss import loss_normalizer
        from xtl.rl.packing import pack_sequences
        from xtl.rl.rollout import SamplingSettings

        base, (prompt, completion) = checkpoints[0], (self.PROMPT, self.COMPLETION)
        generator = torch.Generator().manual_seed(4)
        ids = torch.randint(3, 1500, (4, prompt + completion), generator=generator)
        advantages = torch.tensor([1.0, -0.5, 0.7, -1.2], dtype=torch.float64)
        args = trl.GRPOConfig(
            output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False, fp16=False, beta=0.04,
            use_bias_correction_kl=False, max_completion_length=completion, num_generations=2,
            per_device_train_batch_size=2, save_strategy="no", logging_strategy="no", disable_tqdm=True,
        )  # fmt: skip
        trainer = trl.GRPOTrainer(
            model=PeftModel.from_pretrained(_hf(base), adapter, is_trainable=True),
            reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
            args=args,
            train_dataset=datasets.Dataset.from_list([{"prompt": "a"}, {"prompt": "b"}]),
            processing_class=tokenizer,
        )
        assert "ref" in trainer.model.peft_config, "TRL keeps a frozen copy of the starting adapter"

        def trl_logps(reference: bool) -> torch.Tensor:  # TRL's own scoring, as its rollout step computes them
            model = trainer.model
            with torch.no_grad(), use_adapter(model, adapter_name="ref") if reference else contextlib.nullcontext():
                return trainer._get_per_token_logps_and_entropies(model, ids, torch.ones_like(ids), completion)[0]

        trl_start = trl_logps(False)
        sampling = SamplingSettings(group_size=2, max_new_tokens=completion)
        module = GRPOModule(str(base), objective=PolicyLossConfig(beta=0.04), sampling=sampling,
                            model_overrides={"attn_impl": "sdpa"}, param_dtype="float64")  # fmt: skip
        module._trainer = SimpleNamespace(callbacks=[LoRA(adapter_path=str(adapter))], strategy=None, global_step=0,
                                          ckpt_path=None, global_rank=0)  # fmt: skip
        with pytest.warns(UserWarning, match="param_dtype float64"):
            module.configure_model()
        assert module.reference.mode == "live" and module.reference.frozen is None
        mb = pack_sequences([(row[:prompt].tolist(), row[prompt:].tolist()) for row in ids], advantages.tolist())
        mb.num_items = float(loss_normalizer("grpo", len(ids), int(mb.mask.sum()), completion))
        module._fill_logps(mb)
        assert torch.equal(mb.old_logps, mb.ref_logps), "at the start the reference is the policy: KL 0, ratio 1"
        torch.testing.assert_close(mb.old_logps, trl_start, rtol=1e-12, atol=1e-12)

        _perturb(trainer.model, ".default.", seed=13, scale=0.1)  # the policy's adapter trains
        trainer.model.save_pretrained(tmp_path / "moved", selected_adapters=["default"])
        load_peft_adapter(module.model, tmp_path / "moved")
        trl_policy, trl_reference = trl_logps(False), trl_logps(True)
        torch.testing.assert_close(trl_reference, trl_start, rtol=0, atol=0)
        device_mb = module._on_device(mb)
        with torch.no_grad(), module.reference.computing(module.model) as reference:
            xtl_reference = module._token_logps(reference, device_mb)[0]
        torch.testing.assert_close(xtl_reference, trl_reference, rtol=1e-12, atol=1e-12)

        forward, _ = module.step_objective()
        with torch.no_grad():
            xtl_loss = float(forward(device_mb).loss_sum / mb.num_items)
        inputs = {
            "prompt_ids": ids[:, :prompt], "prompt_mask": torch.ones_like(ids[:, :prompt]),
            "completion_ids": ids[:, prompt:], "completion_mask": torch.ones_like(ids[:, prompt:]),
            "advantages": advantages, "old_per_token_logps": trl_start, "ref_per_token_logps": trl_reference,
            "num_items_in_batch": torch.tensor(ids[:, prompt:].numel()),
        }  # fmt: skip
        trainer.model.eval()
        with torch.no_grad():
            trl_loss = float(trainer.compute_loss(GRPOHeadStandIn(trl_policy, prompt), inputs))
        assert abs(trl_loss) > 1e-4, "the policy moved: a KL and ratios off 1"
        assert_rel(xtl_loss, trl_loss, "loss", RTOL)
