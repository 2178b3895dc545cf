"""Preference training throughput of xtl's ``PreferenceModule`` vs TRL's ``DPOTrainer`` and ``KTOTrainer`` on the same
weights, the same token ids, the same objective and a precomputed reference, each side in its own process.

Usage::

    python benchmarks/preference_step.py [--objective dpo,kto --data tiny|spread --steps 0 --pairs 5 --warmup 1
                                          --threads 1 --precision auto --rows 0 --no-fused]
    python benchmarks/preference_step.py --data spread [--rows 400 --hidden 128 --layers 4 --pack 4096
                                                        --median 400 --sigma 0.8]

Method:

1. Recipes. ``dpo`` is ``configs/tiny_dpo.yaml`` (sigmoid DPO, beta 0.3, RPO NLL weight 1.0) and ``kto`` is
   ``configs/tiny_kto.yaml`` (KTO, beta 0.1, desirable/undesirable weights 1.0), each with ``reference: precomputed``
   (a table of the starting policy's log-probabilities, computed once before the first step), no validation, the
   recipe's optimizer, schedule, clipping and bf16-mixed precision. ``--data tiny`` trains the recipe's own rows
   (``tiny:preference_train.jsonl``, ``tiny:kto_train.jsonl``; the first ``--rows`` when given) on the tiny SFT
   recipe's model (Qwen3, vocab 1600, hidden 128, 4 layers, tied embeddings; from scratch, seed 0: the recipe's
   ``runs/tiny_sft_export`` model is a trained copy of it) in the recipe's packs (512 tokens, 4 per step).
   ``--data spread`` generates preference rows whose pairs (prompt + chosen and prompt + rejected, rendered) follow
   a log-normal of median ``--median`` tokens clipped to 50..2000, the prompt 10-40% of each side and the two
   responses of different lengths, trained on a Qwen3 of ``--hidden``/``--layers`` (as ``train_step.py``'s
   synthetic recipe) in packs of ``--pack`` tokens, one per step; KTO reads the same rows as
   ``kind: unpaired_preference`` (chosen desirable, rejected undesirable, as TRL unpairs them).
2. Setup (one spawned child, nothing timed): the recipe is parsed by xtl's CLI (``XTLCLI(..., run=False)``), xtl's
   tokenization cache is built and the model saved as an HF directory (every side starts from these weights). TRL
   trains on xtl's samples: every pair of xtl's pack plan becomes TRL's pre-tokenized row (``prompt_ids``,
   ``chosen_ids``/``rejected_ids``; KTO: ``completion_ids``, ``KL_completion_ids`` = xtl's mismatched completion,
   ``label``); the prompt is the tokens before the first scored one, the completion the scored tokens (asserted
   contiguous, and the two sides' prompts identical), so TRL scores exactly xtl's targets. TRL's own tokenization
   (``_prepare_dataset``) is skipped for these rows; nothing else of the trainer changes. Then, before anything is
   timed, the loss of one step is asserted equal on both sides (:func:`check_same_loss`): xtl runs ``trainer.fit``
   for one step of one pack with the starting weights' table, the policy replaced by perturbed weights before the
   step (so policy and reference differ); TRL computes the loss of the same pairs (one batch, its own precomputed
   reference from the starting weights, the same perturbed policy).
3. xtl (own spawned child per run): ``XTLCLI(..., run=False)`` with the recipe and the overrides, then
   ``trainer.fit`` -- what ``xtl fit`` runs. Fused q/k/v and gate/up projections unless ``--no-fused``. The
   reference table is computed in the warm-up run (the cache's ``reference`` folder is emptied first) and read from
   xtl's data cache by the later ones; its time is printed apart.
4. TRL (own spawned child per run): ``DPOTrainer``/``KTOTrainer`` with ``precompute_ref_log_probs=True`` (the
   reference table is computed at init in the warm-up run, read from the datasets cache later; printed apart),
   ``gradient_checkpointing=False``, ``padding_free=False`` (DPO: "temporarily unavailable" in TRL 1.16, it would
   fall back to padding; KTO has none), no truncation (every pair fits: ``max_length`` = the pack length),
   ``pad_to_multiple_of=None``, TRL's fused LM head (on CPU it scores every position), ``bf16=True`` (accelerate's
   CPU autocast) when xtl runs ``bf16-mixed``, xtl's optimizer groups and schedule (fused AdamW, ``LambdaLR``),
   ``per_device_train_batch_size`` = xtl's mean pairs per pack, xtl's packs per step as gradient accumulation, rows
   length-grouped (megabatches of 50 batches sorted longest first, as transformers' ``group_by_length``) and read
   sequentially (KTO's documented sampler), no logging, no saving.
5. Measured in each run: steps 2..N (step 1 is warm-up); useful tokens = non-padding tokens of both sequences of
   every pair (KTO: the row's and its mismatched KL sequence), processed tokens include padding, scored tokens are
   the targets of the forward(s) (completion tokens). Protocol: ``benchmarks/_paired.py`` (threads pinned,
   alternating order, median ratio with min..max).

The parent process stays stdlib-only (its children do all the work).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import random
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _paired import PairedResult, add_protocol_args, load_average, print_configs, run_pairs
from _peers import (
    WORDS,
    SideResult,
    StepTimer,
    breakdown,
    child_setup,
    cpu_has_bf16,
    describe,
    in_child,
    optimizer_hparams,
    peer_args,
    peer_clock,
    peer_optimizers,
    run_line,
)

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {"dpo": ROOT / "configs" / "tiny_dpo.yaml", "kto": ROOT / "configs" / "tiny_kto.yaml"}
TARGET = 1.5
IGNORE_INDEX = -100
MIN_PAIR, MAX_PAIR = 50, 2000
TEMPLATE_OVERHEAD = 20  # tokens the qwen3 template adds around one user/assistant turn
DEFAULT_STEPS = {"tiny": 21, "spread": 11}
# One-step loss, xtl vs TRL on the same pairs (relative): fp32 differs by summation order only; under bf16 autocast
# the two models' matmuls round differently (xtl: fused projections, its own head), so a looser bound.
LOSS_RTOL = {"32-true": 1e-4, "bf16-mixed": 2e-2}
PERTURB = 0.02  # std of the noise added to the policy's weights for the loss check


@dataclass
class PrefConfig:
    """Everything a child process needs (picklable); ``prepare`` fills the fields after ``xtl_args``."""

    objective: str
    data: str
    work_dir: str
    steps: int
    threads: int
    precision: str
    seed: int = 0
    rows: int = 0
    hidden: int = 128
    layers: int = 4
    pack: int = 4096
    micro_batches: int = 1
    median: float = 400.0
    sigma: float = 0.8
    fused: bool = True
    xtl_args: list[str] = field(default_factory=list)
    hf_dir: str = ""
    perturbed_dir: str = ""
    trl_data: str = ""
    tokenizer: str = ""
    trl_batch: int = 1
    hf: dict[str, Any] = field(default_factory=dict)
    objective_settings: dict[str, Any] = field(default_factory=dict)


# ---- data (stdlib only) ------------------------------------------------------------------------------------------


def write_spread_pairs(path: Path, rows: int, seed: int, median: float, sigma: float) -> None:
    """Preference rows whose rendered pair (prompt + chosen, prompt + rejected) has a clipped log-normal length."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(rows):
            total = int(min(MAX_PAIR, max(MIN_PAIR, rng.lognormvariate(math.log(median), sigma))))
            body = max(6, total - 2 * TEMPLATE_OVERHEAD)
            prompt = max(1, int(body / 2 * rng.uniform(0.1, 0.4)))
            responses = max(2, body - 2 * prompt)
            chosen = max(1, int(responses * rng.uniform(0.25, 0.75)))
            row = {
                "prompt": [{"role": "user", "content": _text(prompt, rng)}],
                "chosen": [{"role": "assistant", "content": _text(chosen, rng)}],
                "rejected": [{"role": "assistant", "content": _text(max(1, responses - chosen), rng)}],
            }
            f.write(json.dumps(row) + "\n")


def _text(num_tokens: int, rng: random.Random) -> str:
    """About ``num_tokens`` tokens of the tiny tokenizer's words."""
    words = [rng.choice(WORDS) for _ in range(num_tokens)]
    return " ".join(words).capitalize()


def xtl_args(cfg: PrefConfig, data: Path | None) -> list[str]:
    """The ``xtl fit`` arguments of a run: the recipe with a precomputed reference, no validation, the saved model."""
    work = Path(cfg.work_dir)
    kind = "preference" if cfg.objective == "dpo" else "unpaired_preference"
    args = [
        "--config",
        str(RECIPES[cfg.objective]),
        f"--model.init_args.model={work / 'hf_model'}",
        "--model.init_args.reference=precomputed",
        f"--trainer.max_steps={cfg.steps}",
        f"--trainer.precision={cfg.precision}",
        f"--trainer.default_root_dir={work / 'xtl_prepare'}",
        "--trainer.enable_progress_bar=false",
        "--trainer.val_check_interval=null",
        "--trainer.limit_val_batches=0",
        "--data.val_sources=null",
        f"--data.cache_dir={work / 'xtl_cache'}",
        "--data.progress=false",
    ]
    if cfg.fused:
        args.append('--model.init_args.model_overrides={"fused_projections": true}')
    if data is not None:
        args += [
            "--data.sources=" + json.dumps([{"path": str(data), "kind": kind}]),
            f"--data.pack_max_length={cfg.pack}",
            f"--data.micro_batches_per_step={cfg.micro_batches}",
        ]
    return args


# ---- setup -------------------------------------------------------------------------------------------------------


def _save_models(cfg: PrefConfig, work: Path) -> None:
    """The starting weights (tiny: the tiny SFT recipe's architecture, tied; spread: ``--hidden``/``--layers``) and a
    perturbed copy (the policy of the loss check)."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from xtl.data import tiny_assets_dir

    tokenizer = AutoTokenizer.from_pretrained(tiny_assets_dir())
    if cfg.data == "tiny":
        dims = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4)
        dims |= dict(num_key_value_heads=2, head_dim=32, max_position_embeddings=512, tie_word_embeddings=True)
    else:
        heads = max(1, cfg.hidden // 64)
        dims = dict(hidden_size=cfg.hidden, intermediate_size=3 * cfg.hidden, num_hidden_layers=cfg.layers)
        dims |= dict(num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=64)
        dims |= dict(max_position_embeddings=4096, tie_word_embeddings=False)
    config = Qwen3Config(
        vocab_size=1600,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        **dims,
    )
    torch.manual_seed(cfg.seed)
    model = Qwen3ForCausalLM(config)
    model.save_pretrained(work / "hf_model")
    g = torch.Generator().manual_seed(cfg.seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(PERTURB * torch.randn(p.shape, generator=g))
    model.save_pretrained(work / "hf_perturbed")


def _pair_rows(split: Any, objective: str) -> list[dict[str, Any]]:
    """TRL's pre-tokenized row of every pair of xtl's plan (pack order): the prompt is the tokens before the first
    target, the completion the targets; asserts that the targets are contiguous and that both documents of a pair
    share the prompt."""
    plan = split.plan
    rows = []
    for k in range(0, len(plan.seg_sample), 2):
        sides = []
        for j in (k, k + 1):
            ids, labels = split.data.tokens(int(plan.seg_sample[j]), int(plan.seg_start[j]), int(plan.seg_end[j]))
            ids, labels = ids.tolist(), labels.tolist()
            scored = [t for t, label in enumerate(labels) if label != IGNORE_INDEX and t > 0]  # unshifted labels
            first, last = scored[0], scored[-1]
            assert scored == list(range(first, last + 1)), "xtl's targets of a response are not contiguous"
            assert labels[first : last + 1] == ids[first : last + 1], "xtl's labels are not the tokens"
            sides.append((ids[:first], ids[first : last + 1], len(ids)))
        (prompt, chosen, len_a), (prompt_b, rejected, len_b) = sides
        assert prompt == prompt_b, "the two documents of a pair do not share their prompt"
        row = {"prompt_ids": prompt, "xtl_tokens": len_a + len_b, "pair": k // 2}
        if objective == "dpo":
            row |= {"chosen_ids": chosen, "rejected_ids": rejected}
        else:
            tags = split.data.tags
            row |= {"completion_ids": chosen, "KL_completion_ids": rejected, "label": bool(tags[plan.seg_sample[k]])}
        rows.append(row)
    return rows


def _length_grouped(rows: list[dict[str, Any]], batch: int, seed: int) -> list[dict[str, Any]]:
    """Rows shuffled, then each megabatch of 50 batches sorted longest first (transformers' ``group_by_length``)."""
    rng = random.Random(seed)
    order = list(range(len(rows)))
    rng.shuffle(order)
    mega = 50 * batch
    out = []
    for a in range(0, len(order), mega):
        out += sorted(order[a : a + mega], key=lambda i: -rows[i]["xtl_tokens"])
    return [rows[i] for i in out]


def prepare(cfg: PrefConfig) -> dict[str, Any]:
    """Save the weights, parse the recipe with xtl's CLI, warm xtl's cache, write TRL's rows (xtl's pairs), and
    assert one step's loss equal on both sides."""
    child_setup(cfg.threads)
    import dataclasses

    from datasets import Dataset

    from xtl.cli import XTLCLI

    work = Path(cfg.work_dir)
    _save_models(cfg, work)
    with contextlib.redirect_stdout(io.StringIO()):
        cli = XTLCLI(args=cfg.xtl_args, run=False)
    dm, module = cli.datamodule, cli.model
    dm.prepare_data()
    dm.setup()
    split = dm.train_split
    rows = _pair_rows(split, cfg.objective)
    pairs_per_pack = len(rows) / len(split.plan)
    trl_batch = max(1, round(pairs_per_pack))
    ordered = _length_grouped(rows, trl_batch, cfg.seed)
    Dataset.from_list(ordered).save_to_disk(str(work / "trl_data"))
    objective = module.objective
    hf = {
        **optimizer_hparams(module, cfg.steps),
        "max_length": dm.pack_max_length,
        "micro_batches": dm.micro_batches_per_step,
    }
    settings = {
        "loss_type": objective.loss_type,
        "beta": objective.beta,
        "rpo_alpha": objective.rpo_alpha,
        "desirable_weight": objective.desirable_weight,
        "undesirable_weight": objective.undesirable_weight,
    }
    full = dataclasses.replace(
        cfg,
        hf_dir=str(work / "hf_model"),
        perturbed_dir=str(work / "hf_perturbed"),
        trl_data=str(work / "trl_data"),
        tokenizer=str(Path(dm.load_tokenizer().name_or_path)),
        trl_batch=trl_batch,
        hf=hf,
        objective_settings=settings,
    )
    check = check_same_loss(full)
    shutil.rmtree(work / "xtl_cache" / "reference", ignore_errors=True)  # the warm-up run computes the table again
    report = split.plan.report()
    lengths = [r["xtl_tokens"] for r in rows]
    return {
        "cfg": full,
        "check": check,
        "model": describe(module.model_config),
        "params": sum(p.numel() for p in module.model_config.build().parameters()),
        "pairs": len(rows),
        "packs": len(split.plan),
        "pairs_per_pack": pairs_per_pack,
        "fill": report["fill_ratio"],
        "tokens": sum(lengths),
        "pair_median": statistics.median(lengths),
        "pair_min": min(lengths),
        "pair_max": max(lengths),
        "template": dm.template,
    }


# ---- the loss check ----------------------------------------------------------------------------------------------


def xtl_step_loss(cfg: PrefConfig) -> tuple[float, list[int]]:
    """``trainer.fit`` of xtl for one step of one pack: the reference table from the starting weights, the policy
    replaced by the perturbed weights before the step. Returns the step's loss and the pairs it trained (plan
    indices)."""
    import lightning.pytorch as pl

    from xtl.cli import XTLCLI

    seen: dict[str, Any] = {}

    class Capture(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, *_: Any) -> None:
            module.model.from_hf(cfg.perturbed_dir)
            seen["packs"] = [mb.pack_index for mb in batch]

        def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, *_: Any) -> None:
            seen["loss"] = float(outputs["loss"])

    root = tempfile.mkdtemp(prefix="xtl_check_", dir=cfg.work_dir)
    args = [*cfg.xtl_args, "--trainer.max_steps=1", "--data.micro_batches_per_step=1"]
    with contextlib.redirect_stdout(io.StringIO()):
        cli = XTLCLI(args=[*args, f"--trainer.default_root_dir={root}"], run=False)
        cli.trainer.callbacks.append(Capture())
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    offsets = cli.datamodule.train_split.plan.pack_offsets
    (pack,) = seen["packs"]
    return seen["loss"], list(range(int(offsets[pack]) // 2, int(offsets[pack + 1]) // 2))


def trl_step_loss(cfg: PrefConfig, pairs: list[int]) -> float:
    """TRL's loss of one batch of ``pairs`` (its own precomputed reference from the starting weights; the policy
    then loaded with the perturbed weights)."""
    import torch
    from datasets import Dataset, load_from_disk
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = {r["pair"]: r for r in load_from_disk(cfg.trl_data)}
    subset = Dataset.from_list([rows[k] for k in pairs])
    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer)
    model = AutoModelForCausalLM.from_pretrained(cfg.hf_dir, attn_implementation="sdpa", dtype=torch.float32)
    trainer = _trl_trainer(cfg, model, tokenizer, subset, [], batch=len(pairs), accumulation=1, name="check")
    state = load_file(str(Path(cfg.perturbed_dir) / "model.safetensors"))
    missing, unexpected = trainer.model.load_state_dict(state, strict=False)
    assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)
    batch = trainer._prepare_inputs(trainer.data_collator([trainer.train_dataset[i] for i in range(len(pairs))]))
    trainer.model.train()
    with torch.no_grad(), trainer.compute_loss_context_manager(), trainer.accelerator.autocast():
        return float(trainer.compute_loss(trainer.model, batch))


def check_same_loss(cfg: PrefConfig) -> str:
    """Assert that xtl's and TRL's loss of one step on the same pairs, weights and reference agree within
    :data:`LOSS_RTOL`; returns the printed line."""
    xtl_loss, pairs = xtl_step_loss(cfg)
    trl_loss = trl_step_loss(cfg, pairs)
    rtol = LOSS_RTOL[cfg.precision]
    diff = abs(xtl_loss - trl_loss) / max(abs(trl_loss), 1e-12)
    assert diff <= rtol, f"{cfg.objective}: xtl's loss {xtl_loss:.6f} != TRL's {trl_loss:.6f} (rel {diff:.1e})"
    return (
        f"same loss (asserted): one step of {len(pairs)} pairs (xtl's first pack), policy perturbed (std {PERTURB}) "
        f"from the weights of the precomputed reference: xtl {xtl_loss:.6f}, TRL {trl_loss:.6f}, relative diff "
        f"{diff:.1e} <= {rtol:g} ({cfg.precision})"
    )


# ---- TRL ---------------------------------------------------------------------------------------------------------


def _trl_trainer(
    cfg: PrefConfig,
    model: Any,
    tokenizer: Any,
    dataset: Any,
    callbacks: list[Any],
    batch: int,
    accumulation: int,
    name: str = "trl",
    timings: dict[str, float] | None = None,
) -> Any:
    """TRL's ``DPOTrainer`` or ``KTOTrainer`` on xtl's pre-tokenized rows, with a precomputed reference."""
    import trl

    settings = cfg.objective_settings
    common = {
        **peer_args(cfg, name),
        "per_device_train_batch_size": batch,
        "gradient_accumulation_steps": accumulation,
        "max_length": cfg.hf["max_length"],
        "pad_to_multiple_of": None,
        "precompute_ref_log_probs": True,
        "precompute_ref_batch_size": batch,
        "gradient_checkpointing": False,
        "disable_dropout": True,
        "beta": settings["beta"],
        "train_sampling_strategy": "sequential",
        "use_liger_kernel": False,
    }
    if cfg.objective == "dpo":
        weight = float(settings["rpo_alpha"] or 0.0)
        args = trl.DPOConfig(
            **common,
            padding_free=False,
            truncation_mode="keep_start",
            loss_type=["sigmoid", "sft"] if weight else ["sigmoid"],
            loss_weights=[1.0, weight] if weight else None,
        )
        base = trl.DPOTrainer
    else:
        args = trl.KTOConfig(
            **common,
            loss_type=settings["loss_type"],
            desirable_weight=settings["desirable_weight"],
            undesirable_weight=settings["undesirable_weight"],
        )
        base = trl.KTOTrainer

    class PreTokenized(base):  # xtl's ids: TRL's own tokenization of raw rows is skipped
        def _prepare_dataset(self, dataset: Any, *args: Any, **kwargs: Any) -> Any:
            return dataset.remove_columns([c for c in ("xtl_tokens", "pair") if c in dataset.column_names])

        def _precompute_ref_logps(self, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            result = super()._precompute_ref_logps(*args, **kwargs)
            if timings is not None:
                timings["precompute"] = time.perf_counter() - start
            return result

    return PreTokenized(
        model=model,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        optimizers=peer_optimizers(model, cfg.hf),
        callbacks=callbacks,
    )


def _counting(collate: Any, counts: list[tuple[int, int, int]]) -> Any:
    """Wrap TRL's collator to record (useful, processed, scored) tokens of every batch, both sequences (KTO: KL)."""

    def wrapped(features: list[dict[str, Any]]) -> Any:
        batch = collate(features)
        useful = processed = scored = 0
        for prefix in ("", "KL_"):
            if f"{prefix}input_ids" in batch:
                useful += int(batch[f"{prefix}attention_mask"].sum())
                processed += batch[f"{prefix}input_ids"].numel()
                scored += int(batch[f"{prefix}completion_mask"].sum())
        counts.append((useful, processed, scored))
        return batch

    return wrapped


def run_trl(cfg: PrefConfig) -> SideResult:
    """Train with TRL's ``DPOTrainer``/``KTOTrainer`` on xtl's pairs, reference log-probabilities precomputed."""
    child_setup(cfg.threads, uses_lightning=False)
    import torch
    from datasets import load_from_disk
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback

    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer)
    counts: list[tuple[int, int, int]] = []
    timer = StepTimer()
    model = AutoModelForCausalLM.from_pretrained(cfg.hf_dir, attn_implementation="sdpa", dtype=torch.float32)
    timer.watch(model)
    clock = peer_clock(timer, counts, cfg.hf["micro_batches"])
    timings: dict[str, float] = {}
    trainer = _trl_trainer(
        cfg,
        model,
        tokenizer,
        load_from_disk(cfg.trl_data),
        [clock],
        cfg.trl_batch,
        cfg.hf["micro_batches"],
        timings=timings,
    )
    trainer.data_collator = _counting(trainer.data_collator, counts)
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    result = timer.result("trl")
    result.first_step_seconds = timings.get("precompute", 0.0)  # this benchmark reports the precompute there
    return result


# ---- xtl ---------------------------------------------------------------------------------------------------------


def run_xtl(cfg: PrefConfig) -> SideResult:
    """Build the ``xtl fit`` objects of the recipe, add a step clock, train ``cfg.steps`` steps."""
    child_setup(cfg.threads, uses_datasets=False)
    import lightning.pytorch as pl

    from xtl.cli import XTLCLI

    timer = StepTimer()
    timings: dict[str, float] = {}

    class Clock(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            timer.watch(module.model)

        def on_train_batch_start(self, *args: Any) -> None:
            timer.step_start()

        def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, batch: Any, *_: Any) -> None:
            timer.step_end(
                sum(mb.num_real_tokens for mb in batch),
                sum(mb.seq_ctx.seq_len for mb in batch),
                sum(mb.num_tokens for mb in batch),
            )

    root = tempfile.mkdtemp(prefix="xtl_run_", dir=cfg.work_dir)
    with contextlib.redirect_stdout(io.StringIO()):
        cli = XTLCLI(args=[*cfg.xtl_args, f"--trainer.default_root_dir={root}"], run=False)
        precomputed = cli.model.precomputed
        prepare = precomputed.prepare

        def timed_prepare() -> None:
            start = time.perf_counter()
            prepare()
            timings["precompute"] = time.perf_counter() - start

        precomputed.prepare = timed_prepare
        cli.trainer.callbacks.append(Clock())
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    result = timer.result("xtl")
    result.first_step_seconds = timings.get("precompute", 0.0)
    return result


# ---- main --------------------------------------------------------------------------------------------------------


def run_objective(args: argparse.Namespace, objective: str, precision: str, steps: int) -> dict[str, Any]:
    """Prepare one objective, run the pairs, print its results; returns the speed ratios."""
    with tempfile.TemporaryDirectory(prefix=f"xtl-pref-bench-{objective}-") as tmp:
        work = Path(tmp)
        cfg = PrefConfig(
            objective=objective,
            data=args.data,
            work_dir=str(work),
            steps=steps,
            threads=args.threads,
            precision=precision,
            seed=args.seed,
            rows=args.rows,
            hidden=args.hidden,
            layers=args.layers,
            pack=args.pack,
            micro_batches=args.micro_batches,
            median=args.median,
            sigma=args.sigma,
            fused=not args.no_fused,
        )
        data = None
        if args.data == "spread":
            data = work / "pairs.jsonl"
            write_spread_pairs(data, args.rows or 400, args.seed, args.median, args.sigma)
        elif args.rows:  # the recipe's first rows
            from importlib.resources import files  # stdlib: the tiny assets are package data of xtl

            source = (
                files("xtl")
                / "assets"
                / "tiny"
                / ("preference_train.jsonl" if objective == "dpo" else "kto_train.jsonl")
            )
            data = work / "rows.jsonl"
            data.write_text("".join(source.read_text().splitlines(keepends=True)[: args.rows]))
            cfg.pack, cfg.micro_batches = 512, 4
        cfg.xtl_args = xtl_args(cfg, data)
        info = in_child(prepare, cfg)
        cfg = info["cfg"]
        _print_setup(cfg, info)
        runs: dict[str, list[SideResult]] = {"xtl": [], "trl": []}

        def side(name: str, fn: Any) -> Any:
            def run() -> float:
                runs[name].append(in_child(fn, cfg))
                return runs[name][-1].useful_tok_s

            return run

        def on_pair(i: int, a: float, b: float) -> None:
            print(f"repetition {i + 1} ({'xtl' if (args.warmup + i) % 2 == 0 else 'trl'} first):", flush=True)
            for name, results in runs.items():
                print(run_line(name, results[-1]).split("; step 1")[0], flush=True)

        speed = run_pairs(
            side("xtl", run_xtl), side("trl", run_trl), args.pairs, args.warmup, "useful tokens/s", True, on_pair
        )
    timed = {name: results[args.warmup :] for name, results in runs.items()}
    scored = PairedResult(
        "scored tokens/s",
        [r.scored_tokens / r.seconds for r in timed["xtl"]],
        [r.scored_tokens / r.seconds for r in timed["trl"]],
        True,
    )
    cpu = PairedResult(
        "useful tokens per CPU second",
        [r.useful_tok_cpu_s for r in timed["xtl"]],
        [r.useful_tok_cpu_s for r in timed["trl"]],
        True,
    )
    print(f"\n{objective} results ({args.pairs} timed repetitions after {args.warmup} warm-up(s), order alternating):")
    for result in (speed, scored, cpu):
        print("  " + result.summary("xtl", "trl"))
    for name, results in runs.items():
        first = results[0].first_step_seconds
        later = [r.first_step_seconds for r in results[1:]]
        print(
            f"  reference precompute, {name}: {first:.2f} s computed (warm-up run, all {info['pairs']} pairs); "
            f"later runs read the stored table: median {statistics.median(later) if later else 0:.2f} s"
        )
    print("  where the time goes (median per timed step):")
    for name, results in timed.items():
        print("  " + breakdown(name, results))
    ratio = statistics.median(speed.ratios)
    print(
        f"  {objective} {args.data}: xtl/TRL useful tok/s {ratio:.2f}x (min {min(speed.ratios):.2f} .. max "
        f"{max(speed.ratios):.2f}); target >= {TARGET}: {'reached' if ratio >= TARGET else 'NOT reached'}"
    )
    return {"ratio": ratio, "min": min(speed.ratios), "max": max(speed.ratios)}


def main() -> None:
    """Parse arguments, then for each objective prepare, check, run the pairs and print the comparison."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_protocol_args(parser, pairs=5, warmup=1)
    parser.add_argument("--objective", default="dpo,kto", help="comma-separated among dpo, kto")
    parser.add_argument("--data", default="tiny", choices=["tiny", "spread"])
    parser.add_argument("--steps", type=int, default=0, help="optimizer steps per run, the first excluded (0: auto)")
    parser.add_argument("--precision", default="auto", choices=["auto", "bf16-mixed", "32-true"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rows", type=int, default=0, help="rows (tiny: the recipe's first; spread: default 400)")
    parser.add_argument("--no-fused", action="store_true", help="xtl with separate q/k/v and gate/up projections")
    spread = parser.add_argument_group("spread data")
    spread.add_argument("--hidden", type=int, default=128, help="hidden size (heads = hidden/64, head_dim 64)")
    spread.add_argument("--layers", type=int, default=4)
    spread.add_argument("--pack", type=int, default=4096, help="xtl pack length")
    spread.add_argument("--micro-batches", type=int, default=1, help="xtl packs per step (TRL: accumulation)")
    spread.add_argument("--median", type=float, default=400.0, help="median rendered pair length in tokens")
    spread.add_argument("--sigma", type=float, default=0.8, help="log-normal sigma of pair lengths")
    args = parser.parse_args()
    objectives = [o.strip() for o in args.objective.split(",") if o.strip()]
    if not objectives or any(o not in RECIPES for o in objectives):
        parser.error("--objective: choose among dpo, kto")
    steps = args.steps or DEFAULT_STEPS[args.data]
    if steps < 2:
        parser.error("--steps must be >= 2 (step 1 is excluded as warm-up)")
    precision = args.precision if args.precision != "auto" else ("bf16-mixed" if cpu_has_bf16() else "32-true")
    print(f"load average before: {load_average()}")
    start = time.perf_counter()
    results = {o: run_objective(args, o, precision, steps) for o in objectives}
    print("\nsummary:")
    for objective, r in results.items():
        print(
            f"  {objective} {args.data}: xtl/TRL useful tok/s median {r['ratio']:.2f}x "
            f"(min {r['min']:.2f} .. max {r['max']:.2f})"
        )
    print(f"total {time.perf_counter() - start:.0f} s; load average after: {load_average()}")


def _print_setup(cfg: PrefConfig, info: dict[str, Any]) -> None:
    s, hf = cfg.objective_settings, cfg.hf
    if cfg.objective == "dpo":
        objective = f"sigmoid DPO, beta {s['beta']}, RPO NLL weight {s['rpo_alpha']}"
        trl_loss = f"loss_type=['sigmoid', 'sft'], loss_weights=[1.0, {s['rpo_alpha']}], beta={s['beta']}"
    else:
        objective = f"KTO, beta {s['beta']}, weights {s['desirable_weight']}/{s['undesirable_weight']}"
        trl_loss = (
            f"loss_type={s['loss_type']}, beta={s['beta']}, desirable_weight={s['desirable_weight']}, "
            f"undesirable_weight={s['undesirable_weight']}"
        )
    precision = "bf16-mixed (fp32 weights, CPU autocast bf16)" if cfg.precision == "bf16-mixed" else "fp32"
    if cfg.precision == "32-true":
        precision += " [CPU fallback: the recipe's bf16-mixed; this CPU has no native bf16 (--precision bf16-mixed)]"
    optimizer = (
        f"fused AdamW lr {hf['lr']}, betas {tuple(hf['betas'])}, eps {hf['eps']}, wd {hf['weight_decay']}, clip "
        f"{hf['max_grad_norm']}; {hf['schedule']} schedule, warmup {hf['warmup_steps']}, min lr ratio "
        f"{hf['min_lr_ratio']}"
    )
    print(f"\n=== {cfg.objective} on {cfg.data} data: {objective} ===")
    print(f"model {info['model']}, {info['params'] / 1e6:.2f}M params")
    print(
        f"data: {info['pairs']} pairs, {info['tokens']} tokens (pair median {info['pair_median']:.0f}, min "
        f"{info['pair_min']}, max {info['pair_max']}); xtl: {info['packs']} packs of {hf['max_length']}, "
        f"{info['pairs_per_pack']:.1f} pairs per pack, fill {info['fill']:.3f}"
    )
    print(f"check: {info['check']}")
    print(f"{cfg.steps} steps per run (step 1 excluded), threads {cfg.threads} per child")
    print_configs(
        xtl={
            "runs": f"xtl fit --config {RECIPES[cfg.objective].relative_to(ROOT)} " + " ".join(cfg.xtl_args[2:]),
            "precision": precision,
            "batch": f"{hf['micro_batches']} packs x {hf['max_length']} tokens per step",
            "reference": "precomputed (table from the starting policy before step 1, stored in the data cache)",
            "packing": "best-fit packs of whole pairs, no padding inside [xtl-only]",
            "forward": "DPO: one forward + backward per pack for chosen + rejected; KTO: the rows forward + backward, "
            "their mismatched KL sequences packed apart, forward without gradient",
            "attention": "sdpa per document (varlen) [xtl-only]",
            "projections": "q/k/v fused, gate/up fused [xtl-only]" if cfg.fused else "separate (as TRL)",
            "head+loss": "LM head on the scored rows only (topped up to a multiple of 128), fp32 log-softmax",
            "gradient checkpointing": "off",
            "optimizer": optimizer,
            "logging": "every step (recipe)",
        },
        trl={
            "runs": f"trl.{'DPOTrainer' if cfg.objective == 'dpo' else 'KTOTrainer'} (use_cpu=True), {trl_loss}",
            "precision": "bf16=True (accelerate CPU autocast bf16, fp32 weights)"
            if cfg.precision == "bf16-mixed"
            else "bf16=False: fp32 (as xtl)",
            "batch": f"per_device_train_batch_size={cfg.trl_batch} pairs x gradient_accumulation_steps="
            f"{hf['micro_batches']}",
            "reference": f"precompute_ref_log_probs=True, precompute_ref_batch_size={cfg.trl_batch}",
            "padding": "pad to longest in batch (padding_free=False: unavailable in DPO 1.16, absent in KTO), "
            "pad_to_multiple_of=None",
            "truncation": f"max_length={hf['max_length']} (no row is longer), truncation_mode=keep_start",
            "forward": "one forward of chosen+rejected rows concatenated (DPO); KTO: a no-grad forward of the KL "
            "rows + one of the rows",
            "ordering": "length-grouped (megabatches of 50 batches longest first), sequential sampler",
            "data": "xtl's ids, pre-tokenized (prompt_ids + completion ids = xtl's targets)",
            "head+loss": "TRL fused LM head (on CPU every position of the padded batch), + entropy/logit metrics",
            "gradient checkpointing": "gradient_checkpointing=False, use_liger_kernel=False",
            "optimizer": optimizer + " (xtl's groups and lr_lambda)",
            "logging": "none",
        },
    )


if __name__ == "__main__":
    main()
