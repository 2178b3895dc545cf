"""LanguageModule training behaviour: NaN steps are skipped, HF export matches, exact resume, MoE metrics."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.overrides import TorchFunctionMode
from transformers import AutoModelForCausalLM

from tests.composition.matrix import FAMILIES
from xtl.callbacks import HFExport
from xtl.errors import ConfigError
from xtl.ops import hf_impl
from xtl.strategies import AtomicCheckpointIO, SingleDevice
from xtl.strategies.capability import Refusal, check_context_parallel
from xtl.strategies.layout import ParallelLayout
from xtl.train import AdamWConfig, LanguageModule, RouterTraining, ScheduleConfig

from .conftest import TINY_MODEL


class LossRecorder(pl.Callback):
    """Keeps ``train/loss`` of every step (as logged, bit for bit)."""

    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses[trainer.global_step] = trainer.callback_metrics["train/loss"].item()


class StopAt(pl.Callback):
    """Stops fitting after ``step`` optimizer steps (an interrupted run with the full schedule)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


class NaNAtStep(LanguageModule):
    """Injects NaN into the loss of one optimizer step."""

    nan_batch = 2

    def training_step(self, batch, batch_idx):
        self._batch_idx = batch_idx
        return super().training_step(batch, batch_idx)

    def extra_loss(self, output, global_tokens):
        if self._batch_idx == self.nan_batch:
            return output.loss_sum * float("nan")  # a NaN loss: NaN gradients everywhere
        return None


class TestNaNSkip:
    def test_nan_loss_skips_the_update_and_training_continues(self, make_datamodule, make_trainer):
        snapshots = {}

        class Snapshot(pl.Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                snapshots[batch_idx] = copy.deepcopy(pl_module.model.state_dict())
                snapshots[f"adam_{batch_idx}"] = copy.deepcopy(pl_module.optimizers().optimizer.state_dict()["state"])

        module = NaNAtStep(model=TINY_MODEL, optimizer=AdamWConfig(lr=1e-2))
        trainer = make_trainer(5, callbacks=[Snapshot()], log_every_n_steps=1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(module, datamodule=make_datamodule())
        assert module.skipped_steps == 1
        assert any("1 optimizer step(s) skipped" in str(w.message) for w in caught)
        # batch 2 (the NaN step) left the weights and AdamW's moments and step count untouched, batch 3 changed
        # them again, and all stay finite
        before_nan, after_nan = snapshots[2], snapshots[3]
        assert all(torch.equal(before_nan[k], after_nan[k]) for k in before_nan)
        adam_before, adam_after = snapshots["adam_2"], snapshots["adam_3"]
        assert all(torch.equal(adam_before[i][k], adam_after[i][k]) for i in adam_before for k in adam_before[i])
        assert all(int(state["step"]) == 2 for state in adam_after.values())
        final = module.model.state_dict()
        assert all(torch.isfinite(v).all() for v in final.values())
        assert any(not torch.equal(final[k], v) for k, v in after_nan.items())
        # a skipped update still counts as a step (as with GradScaler): 5 batches, 5 steps
        assert trainer.global_step == 5
        assert trainer.callback_metrics["train/skipped_steps"].item() == 1.0


class _HostReads(TorchFunctionMode):
    """Records tensor methods that read a value back on the host (a device sync on a GPU)."""

    READS = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy"}

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.READS:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


class TestNoHostSync:
    def test_training_step_reads_nothing_back_on_steps_that_are_not_logged(self, make_datamodule, make_trainer):
        reads: dict[int, list[str]] = {}

        class Recorded(LanguageModule):
            def training_step(self, batch, batch_idx):
                with _HostReads() as mode:
                    loss = super().training_step(batch, batch_idx)
                reads[batch_idx] = mode.reads
                return loss

        module = Recorded(model=TINY_MODEL, optimizer=AdamWConfig(lr=1e-2))
        make_trainer(4, log_every_n_steps=2).fit(module, datamodule=make_datamodule())
        assert reads[0] == [] and reads[2] == [], f"host reads on unlogged steps: {reads}"
        assert reads[1] and reads[3], "logged steps read the loss and the skip counter (proves the mode records)"
        assert module.tokens_seen > 0 and module.skipped_steps == 0

    @pytest.mark.gpu
    @pytest.mark.skipif(not torch.cuda.is_available(), reason="device syncs are a CUDA notion")
    def test_no_cuda_sync_on_steps_that_are_not_logged(self, make_datamodule, make_trainer):
        errors: dict[int, str] = {}

        class Strict(LanguageModule):
            def training_step(self, batch, batch_idx):
                logged = self.trainer._logger_connector.should_update_logs
                torch.cuda.set_sync_debug_mode(0 if logged or batch_idx == 0 else "error")
                try:
                    return super().training_step(batch, batch_idx)
                except RuntimeError as exc:
                    errors[batch_idx] = str(exc)
                    raise
                finally:
                    torch.cuda.set_sync_debug_mode(0)

        module = Strict(model=TINY_MODEL, optimizer=AdamWConfig(lr=1e-2))
        make_trainer(4, accelerator="gpu", log_every_n_steps=4).fit(module, datamodule=make_datamodule())
        assert not errors


class TestHFExport:
    def test_exported_dir_loads_in_transformers_with_equal_logits(self, make_datamodule, make_trainer, tmp_path):
        export = HFExport(dirpath=str(tmp_path / "hf"), every_n_steps=2, at_end=True)
        module = LanguageModule(model=TINY_MODEL, optimizer=AdamWConfig(lr=1e-2))
        trainer = make_trainer(3, callbacks=[export])
        trainer.fit(module, datamodule=make_datamodule())
        assert [p.name for p in export.exported] == ["step_2", "final"]
        final = tmp_path / "hf" / "final"
        assert (final / "tokenizer.json").is_file() and (final / "config.json").is_file()
        reference = AutoModelForCausalLM.from_pretrained(final, attn_implementation="eager").eval()
        ids = torch.randint(0, 1024, (2, 20))
        module.model.eval()
        with hf_impl(), torch.no_grad():
            assert torch.equal(reference(input_ids=ids).logits, module.model(input_ids=ids).logits)


class TestExactResume:
    def _fit(self, make_datamodule, tmp_path, max_steps, ckpt_path=None, every=None, stop_at=None):
        recorder = LossRecorder()
        callbacks = [recorder] + ([StopAt(stop_at)] if stop_at else [])
        if every:
            callbacks.append(
                ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=every, save_last=True, save_top_k=-1)
            )
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=max_steps,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            enable_checkpointing=bool(every),
            default_root_dir=tmp_path,
            callbacks=callbacks,
            plugins=[AtomicCheckpointIO()],
        )
        pl.seed_everything(0)
        trainer.fit(
            LanguageModule(
                model=TINY_MODEL,
                optimizer=AdamWConfig(lr=5e-3),
                schedule=ScheduleConfig(warmup_steps=2),
                max_grad_norm=1.0,
            ),
            datamodule=make_datamodule(),
            ckpt_path=ckpt_path,
        )
        return recorder.losses

    def test_five_plus_five_equals_ten_bitwise(self, make_datamodule, tmp_path):
        uninterrupted = self._fit(make_datamodule, tmp_path / "a", 10)
        first = self._fit(make_datamodule, tmp_path / "b", 10, every=5, stop_at=5)  # "killed" after step 5
        resumed = self._fit(make_datamodule, tmp_path / "b", 10, ckpt_path=str(tmp_path / "b" / "ckpt" / "last.ckpt"))
        assert [first[s] for s in range(1, 6)] == [uninterrupted[s] for s in range(1, 6)]
        assert [resumed[s] for s in range(6, 11)] == [uninterrupted[s] for s in range(6, 11)]


class TestRoutedExperts:
    def test_router_losses_and_metrics_are_logged(self, make_datamodule, make_trainer):
        model = {
            **TINY_MODEL,
            "model_type": "qwen3_moe",
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
        }
        module = LanguageModule(
            model=model,
            optimizer=AdamWConfig(lr=1e-2),
            routing=RouterTraining(balance_loss_coef=0.01, z_loss_coef=0.001),
        )
        trainer = make_trainer(3)
        trainer.fit(module, datamodule=make_datamodule())
        metrics = trainer.callback_metrics
        assert metrics["train/balance_loss"].item() > 0
        assert metrics["train/z_loss"].item() > 0
        assert metrics["train/maxvio"].item() >= 0

    def test_unknown_model_type_is_a_clear_error(self):
        with pytest.raises(ValueError, match="model.init_args.model.model_type 'mamba' is not supported"):
            LanguageModule(model={"model_type": "mamba"})

    def test_unknown_field_is_named(self):
        with pytest.raises(ValueError, match=r"unknown field\(s\) \['hiden_size'\]"):
            LanguageModule(model={"model_type": "qwen3", "hiden_size": 3})


class TestAtomicCheckpoint:
    def test_crash_mid_save_keeps_the_previous_checkpoint(self, tmp_path, monkeypatch):
        io = AtomicCheckpointIO()
        path = tmp_path / "last.ckpt"
        io.save_checkpoint({"step": 1}, path)

        def torn_save(obj, f, *args, **kwargs):
            Path(f).write_bytes(b"half a checkpoint")
            raise OSError("killed")

        monkeypatch.setattr(torch, "save", torn_save)
        with pytest.raises(OSError, match="killed"):
            io.save_checkpoint({"step": 2}, path)
        monkeypatch.undo()
        assert torch.load(path)["step"] == 1
        assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


class TestPrecision:
    def test_bf16_mixed_keeps_fp32_masters_and_computes_in_bf16(self, make_datamodule, make_trainer):
        seen: list[torch.dtype] = []

        class LayerDtype(pl.Callback):
            def on_train_start(self, trainer, pl_module):
                proj = pl_module.model.layers[0].mlp.down_proj
                proj.register_forward_hook(lambda mod, args, out: seen.append(out.dtype))

        module = LanguageModule(model=TINY_MODEL, optimizer=AdamWConfig(lr=1e-2))
        trainer = make_trainer(3, callbacks=[LayerDtype(), LossRecorder()], precision="bf16-mixed")
        trainer.fit(module, datamodule=make_datamodule())
        assert set(seen) == {torch.bfloat16}, "matmuls compute in bf16 (autocast; the residual stream stays fp32)"
        assert {p.dtype for p in module.model.parameters()} == {torch.float32}, "fp32 master weights"
        states = [s for state in module.optimizers().optimizer.state.values() for s in state.values() if s.dim()]
        assert states and {s.dtype for s in states} == {torch.float32}, "fp32 optimizer state"
        assert trainer.callbacks[1].losses[3] < trainer.callbacks[1].losses[1]

    def test_pure_bf16_without_fsdp_is_warned(self, make_datamodule, make_trainer):
        module = LanguageModule(model=TINY_MODEL, param_dtype="bfloat16")
        with pytest.warns(UserWarning, match="no fp32 master weights"):
            make_trainer(1).fit(module, datamodule=make_datamodule())
        assert {p.dtype for p in module.model.parameters()} == {torch.bfloat16}

    def test_fsdp_cpu_offload_on_cpu_is_refused_clearly(self, make_datamodule, make_trainer):
        from xtl.errors import ConfigError
        from xtl.strategies import FSDPStrategy

        trainer = make_trainer(1, strategy=FSDPStrategy(cpu_offload=True, process_group_backend="gloo"))
        with pytest.raises(ConfigError, match="cpu_offload .* remove cpu_offload"):
            trainer.fit(LanguageModule(model=TINY_MODEL), datamodule=make_datamodule())


class TestContextParallelDeclarations:
    """What ``LanguageModule`` declares under context parallelism (asked once at startup by the strategy):
    next-token training (with multi-token prediction), validation and test run; the decoding of ``predict`` does
    not."""

    CP2 = ParallelLayout(dp_shard=2, cp=2)

    def test_training_runs_and_predict_is_refused(self):
        module = LanguageModule(TINY_MODEL)
        for stage in ("fit", "validate", "test"):
            check_context_parallel(self.CP2, [module], stage)
        with pytest.raises(
            ConfigError, match="but xtl predict / generate decode whole prompts on each process; leave"
        ):
            check_context_parallel(self.CP2, [module], "predict")

    def test_multi_token_prediction_runs(self):
        """A share scores its last positions on the next share's tokens and labels (tests/model/test_mtp.py)."""
        (mla,) = [family.model for family in FAMILIES if family.name == "mla"]
        check_context_parallel(self.CP2, [LanguageModule({**mla, "mtp_layers": 1})], "fit")

    def test_an_objective_declares_per_instance(self):
        """An objective whose refusal depends on its settings (e.g. a mode computed whole packs per rank) declares
        it on the instance."""

        class Objective(LanguageModule):
            def __init__(self, whole_packs: bool, **kwargs) -> None:
                super().__init__(**kwargs)
                self.whole_packs = whole_packs

            def context_parallel_refusal(self, stage: str) -> Refusal | None:
                return Refusal("Objective.whole_packs computes whole packs") if self.whole_packs else None

        check_context_parallel(self.CP2, [Objective(False, model=TINY_MODEL)], "fit")
        with pytest.raises(ConfigError, match="but Objective.whole_packs computes whole packs; leave it out"):
            check_context_parallel(self.CP2, [Objective(True, model=TINY_MODEL)], "fit")


class TestDataRanks:
    def test_setup_gives_the_data_module_the_layouts_data_rank(self, make_datamodule):
        """Rank 3 of ``dp_shard 2 x cp 2`` reads the share of data rank 1 of 2 (ranks 2 and 3 share a sequence),
        not the share of its process rank."""
        strategy = SingleDevice()
        strategy.layout = ParallelLayout(dp_shard=2, cp=2)
        datamodule = make_datamodule()
        module = LanguageModule(TINY_MODEL)
        module._trainer = SimpleNamespace(strategy=strategy, datamodule=datamodule, global_rank=3, world_size=4)
        module.setup("fit")
        assert datamodule.data_parallel_rank() == (1, 2)
