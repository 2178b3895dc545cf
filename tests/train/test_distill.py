"""``DistillModule``: a tiny student and a larger tiny teacher (from-scratch Qwen3 configs sharing the vocabulary).

- With the dataset's completions the module's loss equals TRL's ``generalized_jsd_loss`` on transformers' logits of
  the same models (saved as HF directories, read back by ``Qwen3ForCausalLM``), per document, ``batchmean`` over the
  completion tokens: within ``1e-5`` relative (fp32 on both sides, different kernels; measured within ``1e-6``),
  chunked and plain heads.
- On-policy steps keep each document's prompt and replace its completion by the student's sample.
- The teacher never trains; a short fit lowers the loss on its first micro-batch.
- ``configs/tiny_distill.yaml`` through ``xtl fit`` (tiny models): a resumed run logs the uninterrupted run's
  steps; 2 FSDP ranks log the losses of one process (1e-5) and decode on-policy steps in lockstep.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from transformers import Qwen3ForCausalLM

from tests.inprocess import run_fit
from xtl.data.collate import MicroBatch, collate_pack
from xtl.data.item import IGNORE_INDEX
from xtl.data.packing import Pack
from xtl.errors import ConfigError
from xtl.train import AdamWConfig, DistillModule, OnPolicySampling
from xtl.train.distill import _check_tokenizer
from xtl.utils import TINY_ASSETS_DIR

from .conftest import TINY_MODEL
from .test_family import TINY_VL

ROOT = Path(__file__).resolve().parents[2]

with warnings.catch_warnings():  # "You are importing from 'trl.experimental'"
    warnings.simplefilter("ignore")
    from trl.experimental.gkd.gkd_trainer import GKDTrainer

TEACHER = {
    **TINY_MODEL,
    "hidden_size": 48,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "head_dim": 12,
    "tie_word_embeddings": False,
}
DOCS = [(100, 80), (90, 75)]  # (length, prompt length): 35 completion tokens of 190, the head runs on 128 rows


def _module(**kwargs) -> DistillModule:
    kwargs.setdefault("sampling", OnPolicySampling(max_new_tokens=8, temperature=1.0))
    module = DistillModule(dict(TINY_MODEL), teacher=dict(TEACHER), seed=kwargs.pop("seed", 0), **kwargs)
    module.configure_model()
    return module


def _pack(seed: int = 0) -> MicroBatch:
    rng = np.random.default_rng(seed)
    ids, labels = [], []
    for length, prompt in DOCS:
        tokens = rng.integers(0, TINY_MODEL["vocab_size"], length)
        ids.append(tokens)
        labels.append(np.concatenate([np.full(prompt, IGNORE_INDEX), tokens[prompt:]]))
    return collate_pack(Pack(0, np.concatenate(ids), np.concatenate(labels), [n for n, _ in DOCS]))


def _hf(model: torch.nn.Module, path: Path) -> Qwen3ForCausalLM:
    model.save_hf(path)
    return Qwen3ForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32).eval()


class TestLoss:
    @pytest.mark.parametrize("chunked", [True, False])
    @pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
    def test_equals_trl_on_transformers_logits(self, tmp_path, chunked, beta):
        module = _module(lmbda=0.0, beta=beta, temperature=0.9, chunked=chunked, chunk_bytes=4 * 1600 * 16)
        mb = _pack()
        assert mb.seq_ctx.loss_positions is not None
        student, teacher = _hf(module.model, tmp_path / "student"), _hf(module.teacher, tmp_path / "teacher")
        total, tokens, start = 0.0, 0, 0
        with torch.no_grad():
            for length, prompt in DOCS:
                ids = mb.seq_ctx.input_ids[:, start : start + length]
                labels = ids.clone()
                labels[:, :prompt] = IGNORE_INDEX
                s, t = student(input_ids=ids).logits[:, :-1], teacher(input_ids=ids).logits[:, :-1]
                total += GKDTrainer.generalized_jsd_loss(
                    s, t, labels[:, 1:], beta=beta, temperature=0.9, reduction="sum"
                ).item()
                tokens += length - prompt
                start += length
        got = module.distill_forward(mb).loss_sum / mb.num_tokens
        assert mb.num_tokens == tokens
        assert got.item() == pytest.approx(total / tokens, rel=1e-5)

    def test_the_teacher_gets_no_gradient(self):
        module = _module(lmbda=0.0)
        module.distill_forward(_pack()).loss_sum.backward()
        assert all(not p.requires_grad and p.grad is None for p in module.teacher.parameters())
        assert all(p.grad is not None for p in module.model.parameters())
        assert not any(key.startswith("reference.") for key in module.state_dict())


class TestOnPolicy:
    def test_the_student_completes_each_prompt(self):
        module = _module(lmbda=1.0)
        mb = _pack()
        (new,) = module.on_policy_batch([mb])
        (again,) = _module(lmbda=1.0).on_policy_batch([mb])  # a new run (a resume) at the same step
        assert torch.equal(new.seq_ctx.input_ids, again.seq_ctx.input_ids)  # seeded by the step
        bounds, old = new.seq_ctx.doc_bounds, mb.seq_ctx.input_ids[0]
        assert len(bounds) == len(DOCS) + 1
        start = 0
        for k, (length, prompt) in enumerate(DOCS):
            doc = new.seq_ctx.input_ids[0, bounds[k] : bounds[k + 1]]
            labels = new.labels[0, bounds[k] : bounds[k + 1]]
            assert torch.equal(doc[:prompt], old[start : start + prompt])
            completion = doc[prompt:]
            assert 1 <= completion.numel() <= 8
            assert not torch.equal(completion, old[start + prompt : start + prompt + completion.numel()])
            assert (labels[: prompt - 1] == IGNORE_INDEX).all()
            assert torch.equal(labels[prompt - 1 : -1], completion) and labels[-1] == IGNORE_INDEX
            start += length
        assert new.num_tokens == new.seq_ctx.input_ids.shape[1] - sum(p for _, p in DOCS)
        assert torch.isfinite(module.distill_forward(new).loss_sum)

    def test_the_draws_are_seeded_per_step(self):
        module, other = _module(lmbda=0.5), _module(lmbda=0.5)
        draws = [module.draws_on_policy(step) for step in range(400)]
        assert draws == [other.draws_on_policy(step) for step in range(400)]
        assert 0.4 < np.mean(draws) < 0.6
        assert not any(_module(lmbda=0.0).draws_on_policy(step) for step in range(50))
        assert all(_module(lmbda=1.0).draws_on_policy(step) for step in range(50))


class TestFit:
    def test_a_short_fit_lowers_the_loss_and_leaves_the_teacher(self, make_datamodule, make_trainer):
        """8 steps (on-policy and not): the loss on the first step's dataset micro-batch falls."""
        module = _module(lmbda=0.5, optimizer=AdamWConfig(lr=3e-3))
        first = _FirstBatch()
        teacher = {k: v.clone() for k, v in module.teacher.state_dict().items()}
        trainer = make_trainer(max_steps=8, callbacks=[first])
        trainer.fit(module, datamodule=make_datamodule())
        with torch.no_grad():
            after = module.distill_forward(first.batch).loss_sum.item()
        assert after < 0.8 * first.loss
        assert 0.0 < float(trainer.callback_metrics["train/on_policy"]) < 1.0
        for key, value in module.teacher.state_dict().items():
            assert torch.equal(value, teacher[key]), key


class _FirstBatch(pl.Callback):
    """Keeps the first training micro-batch and the module's loss on it before the first step."""

    def on_train_batch_start(self, trainer, module, batch, batch_idx):  # noqa: ANN001, D102
        if batch_idx == 0:
            self.batch = batch[0]
            with torch.no_grad():
                self.loss = module.distill_forward(self.batch).loss_sum.item()


class TestRefusals:
    def test_a_teacher_with_another_vocabulary(self):
        with pytest.raises(ConfigError, match="vocab_size"):
            DistillModule(dict(TINY_MODEL), teacher={**TEACHER, "vocab_size": 1700})

    @pytest.mark.parametrize(
        ("setting", "match"), [({"lmbda": 1.5}, "lmbda"), ({"beta": -0.1}, "beta"), ({"top_k": 0}, "top_k")]
    )
    def test_settings_out_of_range(self, setting, match):
        with pytest.raises(ConfigError, match=match):
            DistillModule(dict(TINY_MODEL), teacher=dict(TEACHER), **setting)

    def test_vision_language_models(self):
        """A vision-language student or teacher (qwen3_vl; the teacher with the student's vocabulary size)."""
        with pytest.raises(ConfigError, match="vision-language student"):
            DistillModule(dict(TINY_VL), teacher=dict(TEACHER))
        teacher = {**TINY_VL, "text_config": {**TINY_VL["text_config"], "vocab_size": TINY_MODEL["vocab_size"]}}
        with pytest.raises(ConfigError, match="teacher is a vision-language model"):
            DistillModule(dict(TINY_MODEL), teacher=teacher)

    def test_a_teacher_directory_with_another_tokenizer(self, tmp_path, make_datamodule):
        """The teacher's directory carries a tokenizer: the data's passes, one with two ids swapped is refused."""
        teacher = tmp_path / "teacher"
        _module(lmbda=0.0).teacher.save_hf(teacher)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(TINY_ASSETS_DIR / name, teacher / name)
        module, datamodule = DistillModule(dict(TINY_MODEL), teacher=str(teacher)), make_datamodule()
        assert Path(module.teacher_dir) == teacher
        _check_tokenizer(teacher, datamodule)
        tokenizer = json.loads((teacher / "tokenizer.json").read_text())
        vocab = tokenizer["model"]["vocab"]
        first, second = sorted(vocab)[100:102]
        vocab[first], vocab[second] = vocab[second], vocab[first]
        (teacher / "tokenizer.json").write_text(json.dumps(tokenizer))
        with pytest.raises(ConfigError, match="tokenizer"):
            _check_tokenizer(teacher, datamodule)


class TestRecipe:
    def test_xtl_fit_trains_and_resumes_exactly(self, tmp_path):
        """``configs/tiny_distill.yaml`` with tiny models: 4 steps (on-policy ones among them) with a checkpoint at
        step 2; the resumed run logs the uninterrupted run's steps 2 and 3 (losses and the on-policy share)."""
        draws = [bool(np.random.default_rng([0, step]).random() < 0.5) for step in range(4)]
        assert any(draws) and not all(draws), draws
        every_2 = ["--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.dirpath=ckpt"]
        every_2 += ["--trainer.callbacks.every_n_train_steps=2", "--trainer.callbacks.save_top_k=-1"]
        full, err = _fit(tmp_path / "full", tmp_path / "cache", *every_2)
        assert "xtl distill: generalized JSD (beta 0.5" in err
        for step in range(4):
            assert full[step]["train/on_policy"] == pytest.approx(sum(draws[: step + 1]) / (step + 1), rel=1e-6)
        (ckpt,) = (tmp_path / "full/runs/tiny_distill/ckpt").glob("*step=2.ckpt")
        resumed, _ = _fit(tmp_path / "resumed", tmp_path / "cache", "--ckpt_path", str(ckpt))
        for step in (2, 3):
            for key in ("train/loss", "train/on_policy", "train/grad_norm"):
                assert resumed[step][key] == full[step][key], (step, key)

    @pytest.mark.distributed
    def test_two_fsdp_ranks_train_as_one_process(self, tmp_path):
        """Dataset completions (``lmbda: 0``): 2 FSDP ranks x 1 micro-batch log the losses and gradient norms of 1
        process x 2 (the sharded student's head runs in its forward, the teacher's head on its gathered weight), fp32,
        1e-5."""
        steps = ["--model.init_args.lmbda", "0", "--trainer.max_steps", "3"]
        one, _ = _fit(tmp_path / "one", tmp_path / "cache", *steps, "--data.micro_batches_per_step", "2")
        fsdp = (
            "trainer:\n  devices: 2\n  strategy:\n    class_path: xtl.strategies.FSDPStrategy\n    init_args:\n"
            "      process_group_backend: gloo\n"
        )
        two, _ = _fit(tmp_path / "two", tmp_path / "cache2", *steps, "--data.micro_batches_per_step", "1",
                      fragment=fsdp)  # fmt: skip
        for step in range(3):
            for key in ("train/loss", "train/grad_norm"):  # the gradient too: Adam would hide a wrong scale
                assert two[step][key] == pytest.approx(one[step][key], rel=1e-5), (step, key)
        # on-policy steps: the two ranks decode their own prompts in lockstep (sharded parameters)
        steps = ["--model.init_args.lmbda", "1", "--trainer.max_steps", "2", "--data.micro_batches_per_step", "1"]
        sampled, _ = _fit(tmp_path / "sampled", tmp_path / "cache2", *steps, fragment=fsdp)
        assert [sampled[step]["train/on_policy"] for step in range(2)] == [1.0, 1.0]
        assert all(0 < sampled[step]["train/loss"] < float("inf") for step in range(2))


def _fit(work: Path, cache: Path, *extra: str, fragment: str = "") -> tuple[dict[int, dict], str]:
    """``xtl fit`` of ``configs/tiny_distill.yaml`` with the tiny student and teacher, 4 steps, in ``work``: the logged
    rows by step and the output."""
    work.mkdir(parents=True, exist_ok=True)
    override = work / "override.yaml"
    override.write_text(
        f"model:\n  init_args:\n    model: {dict(TINY_MODEL)}\n    teacher: {dict(TEACHER)}\n"
        "    lmbda: 0.5\n    beta: 0.5\n    sampling: {temperature: 1.0, max_new_tokens: 8}\n"
        "    schedule: {warmup_steps: 1, kind: cosine, decay_steps: 4}\n"
        "trainer:\n  precision: 32-true\n  val_check_interval: null\n  enable_progress_bar: false\n"
        "  num_sanity_val_steps: 0\n  callbacks: []\ndata:\n  val_sources: null\n  pack_max_length: 128\n"
    )
    args = ["fit", "--config", str(ROOT / "configs" / "tiny_distill.yaml"), "--config", str(override)]
    if fragment:  # a file of its own: a second ``trainer:`` key in one YAML file would replace the first
        (work / "fragment.yaml").write_text(fragment)
        args += ["--config", str(work / "fragment.yaml")]
    args += ["--data.cache_dir", str(cache), "--trainer.max_steps", "4", *extra]
    return run_fit(args, work, processes=bool(fragment))  # a second rank re-runs the command line
