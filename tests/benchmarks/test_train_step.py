"""``benchmarks/train_step.py``: xtl and its peers compute the same loss on the same ids from the same weights.

One pack of the tiny recipe (xtl's collator, fused projections, its chunked head + loss) against the same documents
through ``transformers.Trainer.compute_loss`` (padded batch, full logits), TRL's ``SFTTrainer.compute_loss`` without
packing (padded batch) and with BFD packing + padding-free (one flattened row), each trainer built by the
benchmark's own functions, in fp32. Nothing is timed here.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.benchmarks import load_benchmark

# fp32: xtl's chunked head and fused projections against full logits and separate projections (measured ~1e-7)
RTOL = 1e-5


class TestTrainStepBenchmark:
    def test_xtl_transformers_and_trl_compute_the_same_loss_on_one_pack(self, tmp_path: Path) -> None:
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

        from xtl.cli import XTLCLI

        bench = load_benchmark("train_step")
        cfg = bench.BenchConfig(
            recipe="tiny",
            work_dir=str(tmp_path),
            steps=3,
            threads=1,
            precision="32-true",
            seed=0,
            hf_sampling="group_by_length",
            hf_accum=1,
            hf_batch=0,
        )
        cfg.xtl_args = bench.xtl_args(cfg, None, 0)
        cli = XTLCLI(args=cfg.xtl_args, run=False)
        dm, module = cli.datamodule, cli.model
        dm.prepare_data()
        dm.setup()
        split = dm.train_split
        cfg.hf = bench.peer_hparams(module, dm, cfg.steps)

        # xtl: the first pack through its collator and the forward of LanguageModule.training_step
        model = bench.initial_model(module)
        assert model.config.fused_projections
        (mb,) = dm.collator()([split.packs[0]])
        with torch.no_grad():
            out = model(seq_ctx=mb.seq_ctx, labels=mb.labels, return_logits=False)
        scored = int(mb.num_tokens)
        xtl_loss = float(out.loss_sum) / scored
        model.save_hf(tmp_path / "hf_model")

        # the same documents, as the benchmark gives them to the peers
        plan = split.plan
        ids, labels = bench.documents(split, list(range(int(plan.pack_offsets[0]), int(plan.pack_offsets[1]))))
        assert sum(bench._scored(x) for x in labels) == scored
        cfg.hf_batch = len(ids)
        tokenizer = AutoTokenizer.from_pretrained(Path(dm.load_tokenizer().name_or_path))
        masks = [[int(t != bench.IGNORE_INDEX) for t in x] for x in labels]

        def hf_model() -> torch.nn.Module:
            return AutoModelForCausalLM.from_pretrained(tmp_path / "hf_model", attn_implementation="sdpa").float()

        losses = {}
        peer = hf_model()
        trainer = Trainer(
            model=peer,
            args=TrainingArguments(**bench._hf_args(cfg)),
            processing_class=tokenizer,
            optimizers=bench.peer_optimizers(peer, cfg.hf),
        )
        batch = bench._hf_collator(tokenizer)(
            [{"input_ids": i, "attention_mask": [1] * len(i), "labels": y} for i, y in zip(ids, labels)]
        )
        with torch.no_grad():
            losses["transformers"] = float(trainer.compute_loss(peer, batch, num_items_in_batch=torch.tensor(scored)))
        for variant in ("trl", "trl-bfd"):
            peer = hf_model()
            data = bench._trl_columns(Dataset.from_dict({"input_ids": ids, "assistant_masks": masks}))
            trainer = bench._trl_trainer(cfg, peer, tokenizer, data, [], variant)
            rows = [trainer.train_dataset[k] for k in range(len(trainer.train_dataset))]
            assert len(rows) == (1 if variant == "trl-bfd" else len(ids))  # one pack's documents fill one BFD row
            batch = trainer.data_collator(rows)
            assert int((batch["labels"][:, 1:] != bench.IGNORE_INDEX).sum()) == scored
            with torch.no_grad():
                losses[variant] = float(trainer.compute_loss(peer, batch, num_items_in_batch=torch.tensor(scored)))

        for name, loss in losses.items():
            assert abs(loss - xtl_loss) <= RTOL * xtl_loss, f"{name} loss {loss!r} != xtl loss {xtl_loss!r}"
