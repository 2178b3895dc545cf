"""Training throughput and peak memory of xtl vs ``transformers.Trainer`` and TRL's ``SFTTrainer`` on the same
objective, each side in its own process.

Usage::

    python benchmarks/train_step.py [--recipe tiny --steps 51 --pairs 5 --warmup 1 --threads 1 --precision auto
                                     --peers transformers,trl,trl-bfd --hf-sampling group_by_length --hf-accum 1
                                     --no-fused --compile none|layers|model]
    python benchmarks/train_step.py --recipe synthetic [--steps 21 --hidden 256 --layers 4 --samples 1000
                                                        --pack 2048]

Method:

1. Recipes. ``tiny`` (default) is exactly ``configs/tiny_sft.yaml``: its model (Qwen3, vocab 1600, hidden 128,
   4 layers, 4 heads, 2 kv heads, head_dim 32, tied embeddings, from scratch with seed 0), its data
   (``tiny:sft_train.jsonl``, ``qwen3`` template, embedded tokenizer, best-fit packs of 512 tokens, 2 packs per
   step) and its trainer, optimizer and schedule. ``synthetic`` keeps the recipe's trainer and optimizer but
   trains a larger Qwen3 (``--hidden``/``--layers``, loaded from a saved HF directory) on a generated chat SFT
   mix with a long-tailed length distribution (log-normal, median ~``--median`` tokens, clipped to 32..1024, 20%
   two-turn) in packs of ``--pack`` tokens, one pack per step.
2. Setup (one spawned child; nothing in it is timed): the recipe is parsed by xtl's own CLI classes, xtl's tokenization
   cache is built (warm for every xtl run) and the model's initial weights are saved as an HF directory (every side
   starts from the same weights). The peers train on xtl's own samples: every document of xtl's pack plan (tokenized by
   xtl's chat tokenize function with the recipe's template, truncated as xtl truncates), saved as one dataset with
   ``input_ids``, ``labels`` (-100 outside xtl's loss mask: the assistant turns) and the same mask as
   ``assistant_masks``. Setup asserts that every side scores the same tokens: the supervised targets per document
   (labels after the causal shift) of xtl's collator (total), of the transformers collator (per sample) and of each TRL
   row's prepared, collated dataset (per document, BFD packs split by ``seq_lengths``, matched by token ids) are
   identical; that the ``trl`` row's sampler is length-grouped and no TRL row checkpoints activations; that TRL's own
   chat route (``assistant_only_loss=True`` with a copy of the tokenizer's chat template carrying ``{% generation %}``
   markers) yields the same ids and mask on every sample; that TRL's padding-free batches give the per-document logits
   on CPU SDPA (transformers derives a block-diagonal mask from packed ``position_ids``; a control with attention
   across documents must differ); and that the peers' parameter groups (sizes and weight decay, against
   ``xtl.train.optim.param_groups`` on xtl's own model) and learning-rate schedule equal xtl's. The transformers (and
   trl) batch size is ``round(xtl useful tokens per step / mean sample length)`` so both sides see about the same
   number of useful tokens per optimizer step; transformers' length-grouped sampler serves megabatches of 50 batches
   longest first, so its tokens per step match xtl's only over whole megabatches: the tiny default of 51 steps times 50
   (a note is printed otherwise).
3. xtl (own spawned child per run): the ``xtl fit`` objects (``XTLCLI(..., run=False)`` on the recipe with
   ``--trainer.max_steps``, ``--trainer.precision``, a fresh temporary ``default_root_dir``, the warm cache dir
   and the progress bar off; fused q/k/v and gate/up projections, ``model_overrides: {fused_projections: true}``,
   unless ``--no-fused``; with ``--compile layers|model`` the ``Compile`` callback, inductor, per decoder layer
   or over the whole forward), then ``trainer.fit`` -- what ``xtl fit`` runs, logging every step included.
   Step 1 (excluded from the timing, printed apart) holds the cold compile; the Dynamo frames compiled after it
   (recompiles) are printed per run.
   Each child imports only what its side uses (the xtl child never imports ``datasets``: it would add ~80 MiB
   to its RSS; the peers never import Lightning).
4. Peers (own spawned child per run; ``AutoModelForCausalLM`` with SDPA from the saved weights, CPU, ``bf16=True``
   when xtl runs ``bf16-mixed`` (accelerate's CPU autocast), fused AdamW over xtl's parameter groups (no decay on
   norms, biases, embeddings) with the recipe's lr/betas/eps/weight decay, xtl's warmup + cosine schedule to the
   min lr ratio as a ``LambdaLR``, the recipe's clipping, no logging, no saving, no gradient checkpointing, no
   ``torch_compile``, no Liger kernels, no dataloader workers; every one of these set explicitly, and each peer's
   effective ``TrainingArguments`` / ``SFTConfig`` printed: the fields that differ from the class default plus every
   speed-relevant field):

   - ``transformers``: ``transformers.Trainer`` with ``train_sampling_strategy=group_by_length`` (its
     length-grouped sampler), pad-to-longest batches (``DataCollatorForSeq2Seq``, labels padded with -100).
   - ``trl``: ``trl.SFTTrainer`` as a TRL user configures it on a CPU, on the pre-tokenized samples (``input_ids``
     + ``assistant_masks``: TRL builds the labels from the mask). ``gradient_checkpointing=False`` (SFTConfig
     defaults it to True: every layer's forward recomputed in backward, ~20% slower for nothing on this model), no
     packing, the transformers peer's batch size, accumulation and length-grouped sampler, TRL's collator padding to
     the longest sample. Why not packing: TRL's packing is BFD with ``padding_free`` (forced on with ``bfd``), built
     for varlen flash attention; CPU SDPA has none, so transformers turns the packed ``position_ids`` into a
     block-diagonal mask over the whole row and computes full-row attention (``trl-bfd`` below). With the tiny
     recipe's documents (mean 32 tokens) in 512-token rows that is ~16x the attention work of per-document
     attention; measured (tiny, fp32, 5 pairs), ``trl-bfd`` ran 3674 useful tokens per CPU second against this
     row's 5417 (515.6 vs 293.8 ms per step), so length grouping without packing is what a TRL user picks here.
   - ``trl-bfd``: ``SFTTrainer`` with ``packing=True``, ``packing_strategy="bfd"`` at the pack length,
     ``padding_free=True`` (one flattened row with ``position_ids``), one packed row per micro-batch and xtl's
     micro-batches per step as gradient accumulation, random row order: TRL's packing recipe, labelled with its CPU
     fallback (masked full-row SDPA).

   Both TRL rows run TRL's LM head, which ``SFTTrainer`` always installs (``add_fused_lm_head``; no config field
   turns it off, and Liger's fused cross-entropy is refused): it scores only the supervised positions where Triton
   runs (CUDA, XPU), but ``trl.kernels.chunked_logprob._use_triton`` is false on CPU, so there it projects and scores
   every position of the batch (prompts and padding included, masked afterwards), folds the vocabulary tiles in torch
   ops, computes entropy and top-1 for every position (its per-step metrics, even with logging off) and accumulates
   the head's gradient GEMMs in fp32. Setup reads ``_use_triton`` from the installed trl and prints the fallback.
5. Measured in each run: the clock runs from the end of step 1 (warm-up, excluded) to the end of the last step;
   useful tokens are the non-padding tokens of steps 2..N (``MicroBatch.num_real_tokens``; the collated
   ``attention_mask.sum()``; every token of a padding-free row), processed tokens include padding (``fill`` =
   useful / processed), scored tokens are the supervised targets. Peak RSS is the child's ``VmHWM`` (its own
   address space; a spawned child's ``ru_maxrss`` would start from its parent's peak). Where the time goes, per
   step: forward (hooks on the model; xtl's and TRL's fused head + loss compute here), backward
   (``torch.Tensor.backward``, wrapped), optimizer step (torch's global optimizer step hooks), the rest of the step
   body (train-batch start to end hooks: clipping, zero-grad, scheduler, logging) and the time between steps (data
   loading, loop and callback overhead). Whether forward ran under autocast (and its dtype) is recorded from inside
   the model.
6. Protocol (``benchmarks/_paired.py``): threads pinned in every child (``--threads``, default 1), ``--warmup`` untimed
   repetitions, then ``--pairs`` (>= 5) timed ones whose order alternates (xtl, transformers, trl, trl-bfd; then
   trl-bfd, trl, transformers, xtl; ...). Printed: every configuration, every repetition, and per peer the median ratio
   xtl/peer with its min..max for useful tokens/s, for useful tokens per CPU second (process CPU time: with one thread
   it barely moves when a shared machine deschedules a run, where wall-clock tokens/s can halve) and for peak RSS; the
   median breakdown per side; the strongest peer (highest median useful tokens per CPU second, the default
   reference); and the acceptance check against it (tiny, bf16: useful tokens/s >= 1.3x at peak RSS <= 0.6x).

The parent process stays stdlib-only (its children do all the work).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import random
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
    lr_factor,
    optimizer_hparams,
    peer_args,
    peer_clock,
    peer_optimizers,
    peer_param_groups,
    run_line,
)

ROOT = Path(__file__).resolve().parents[1]
TINY_RECIPE = ROOT / "configs" / "tiny_sft.yaml"
TARGET_SPEED, TARGET_MEMORY = 1.3, 0.6
IGNORE_INDEX = -100
PEERS = ("transformers", "trl", "trl-bfd")
DEFAULT_STEPS = {"tiny": 51, "synthetic": 21}
HF_MEGABATCH = 50  # transformers' LengthGroupedSampler sorts megabatches of 50 batches, longest batch first
MIN_TOKENS, MAX_TOKENS = 32, 1024
TEMPLATE_OVERHEAD = 20  # tokens the qwen3 template adds around one user/assistant turn (roles, empty think block)
# Words of the tiny tokenizer's training corpus (scripts/make_tiny_assets.py): one token each after a space.


@dataclass
class BenchConfig:
    """Everything a child process needs (picklable); ``prepare`` fills the fields after ``xtl_args``."""

    recipe: str
    work_dir: str
    steps: int
    threads: int
    precision: str
    seed: int
    hf_sampling: str
    hf_accum: int
    hf_batch: int
    peers: list[str] = field(default_factory=list)
    xtl_args: list[str] = field(default_factory=list)
    hidden: int = 0
    layers: int = 0
    fused: bool = True
    compile: str = "none"
    hf_dir: str = ""
    hf_data: str = ""
    tokenizer: str = ""
    hf: dict[str, Any] = field(default_factory=dict)


# ---- synthetic data (stdlib only) --------------------------------------------------------------------------------


def write_sft_mix(path: Path, samples: int, seed: int, median: float, sigma: float) -> None:
    """Write ``samples`` chat records whose rendered lengths follow a clipped log-normal."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(samples):
            target = int(min(MAX_TOKENS, max(MIN_TOKENS, rng.lognormvariate(math.log(median), sigma))))
            turns = 2 if rng.random() < 0.2 and target >= 4 * TEMPLATE_OVERHEAD else 1
            budget = max(2 * turns, target - TEMPLATE_OVERHEAD * turns)
            messages: list[dict[str, str]] = []
            for turn_budget in _split(budget, turns, rng):
                user = max(1, int(turn_budget * rng.uniform(0.15, 0.5)))
                messages.append({"role": "user", "content": _text(user, rng)})
                messages.append({"role": "assistant", "content": _text(max(1, turn_budget - user), rng)})
            f.write(json.dumps({"messages": messages}) + "\n")


def _split(total: int, parts: int, rng: random.Random) -> list[int]:
    if parts == 1:
        return [total]
    first = int(total * rng.uniform(0.3, 0.7))
    return [first, total - first]


def _text(num_tokens: int, rng: random.Random) -> str:
    """About ``num_tokens`` tokens: words in sentences of 6..14 (each period is one more token)."""
    words: list[str] = []
    while len(words) < num_tokens:
        sentence = [rng.choice(WORDS) for _ in range(rng.randint(6, 14))]
        words.extend(sentence[:-1] + [sentence[-1] + "."])
    words = words[: max(1, num_tokens - num_tokens // 10)]
    return " ".join(words).capitalize()


def xtl_args(cfg: BenchConfig, data: Path | None, pack: int) -> list[str]:
    """The ``xtl fit`` arguments of a run: the tiny recipe, plus the synthetic overrides."""
    work = Path(cfg.work_dir)
    args = [
        "--config",
        str(TINY_RECIPE),
        f"--trainer.max_steps={cfg.steps}",
        f"--trainer.precision={cfg.precision}",
        f"--trainer.default_root_dir={work / 'xtl_prepare'}",  # each run overrides it with a fresh folder
        "--trainer.enable_progress_bar=false",
        f"--data.cache_dir={work / 'xtl_cache'}",
        "--data.progress=false",
    ]
    if cfg.fused:
        args.append('--model.init_args.model_overrides={"fused_projections": true}')
    if cfg.compile != "none":
        compile_callback = {"class_path": "xtl.callbacks.Compile", "init_args": {"scope": cfg.compile}}
        args.append(f"--trainer.callbacks+={json.dumps(compile_callback)}")
    if data is not None:
        args += [
            f"--model.init_args.model={work / 'hf_model'}",
            "--data.sources=" + json.dumps([{"path": str(data), "kind": "chat"}]),
            "--data.val_sources=null",
            "--data.test_sources=null",
            f"--data.pack_max_length={pack}",
            "--data.micro_batches_per_step=1",
        ]
    return args


# ---- children ----------------------------------------------------------------------------------------------------


def prepare(cfg: BenchConfig) -> dict[str, Any]:
    """Parse the recipe with xtl's CLI, warm xtl's cache, save initial weights and the peers' dataset (xtl's own
    samples), and assert that every side scores the same tokens with the same optimizer and schedule."""
    child_setup(cfg.threads)
    import dataclasses

    import numpy as np
    from datasets import Dataset

    from xtl.cli import XTLCLI
    from xtl.utils import resolve_path

    work = Path(cfg.work_dir)
    hf_dir = work / "hf_model"
    if cfg.recipe == "synthetic":  # before the CLI: the recipe's model is this directory
        _save_synthetic_model(cfg, hf_dir)
    cli = XTLCLI(args=cfg.xtl_args, run=False)
    dm, module = cli.datamodule, cli.model
    dm.prepare_data()
    dm.setup()
    split = dm.train_split
    plan, report = split.plan, split.plan.report()
    if cfg.recipe == "tiny":
        initial_model(module).save_hf(hf_dir)
    tokenizer_dir = str(Path(dm.load_tokenizer().name_or_path))
    pack = dm.pack_max_length

    # The peers' samples are xtl's: every document of xtl's pack plan (truncated as xtl truncates), in source order,
    # with xtl's labels (-100 outside its loss mask) and the same mask as TRL's ``assistant_masks`` column.
    ids_list, labels_list = documents(split, np.argsort(plan.seg_sample, kind="stable").tolist())
    lengths = [len(x) for x in ids_list]
    Dataset.from_dict(
        {
            "input_ids": ids_list,
            "attention_mask": [[1] * n for n in lengths],
            "labels": labels_list,
            "assistant_masks": [[int(t != IGNORE_INDEX) for t in x] for x in labels_list],
            "length": lengths,
        }
    ).save_to_disk(str(work / "hf_data"))
    xtl_tokens_per_step = report["tokens"] / report["packs"] * dm.micro_batches_per_step
    mean = statistics.fmean(lengths)
    hf = peer_hparams(module, dm, cfg.steps)
    hf_batch = cfg.hf_batch or max(1, round(xtl_tokens_per_step / mean / cfg.hf_accum))
    full = dataclasses.replace(
        cfg, hf_dir=str(hf_dir), hf_data=str(work / "hf_data"), tokenizer=tokenizer_dir, hf=hf, hf_batch=hf_batch
    )
    checks, peer_configs = _check_same_objective(full, dm, module, ids_list, labels_list)
    sources = [resolve_path(spec.path) for spec in dm.sources]
    return {
        "hf_dir": full.hf_dir,
        "hf_data": full.hf_data,
        "tokenizer": tokenizer_dir,
        "hf": hf,
        "hf_batch": hf_batch,
        "checks": checks,
        "peer_configs": peer_configs,
        "model": describe(module.model_config),
        "params": sum(p.numel() for p in module.model_config.build().parameters()),
        "pack": pack,
        "micro_batches": dm.micro_batches_per_step,
        "sampler": dm.sampler_order,
        "template": dm.template,
        "overlong": dm.overlong,
        "sources": sources,
        "xtl_report": report,
        "xtl_tokens_per_step": xtl_tokens_per_step,
        "hf_samples": len(lengths),
        "hf_tokens": sum(lengths),
        "hf_mean": mean,
        "hf_median": statistics.median(lengths),
        "hf_max": max(lengths),
    }


def peer_hparams(module: Any, dm: Any, steps: int) -> dict[str, Any]:
    """What the peers take from xtl's parsed recipe: optimizer, schedule, clipping, pack length, micro-batches."""
    return {
        **optimizer_hparams(module, steps),
        "max_length": dm.pack_max_length,
        "micro_batches": dm.micro_batches_per_step,
    }


def initial_model(module: Any) -> Any:
    """The recipe's from-scratch xtl model, initialized as ``LanguageModule`` initializes it (seeded)."""
    import torch

    model = module.model_config.build()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(module.hparams.seed)
        model.init_weights()
    return model


def documents(split: Any, segments: list[int]) -> tuple[list[list[int]], list[list[int]]]:
    """Token ids and labels (-100 outside xtl's loss mask) of the pack plan's ``segments`` (documents as xtl
    truncates them), in the given order."""
    plan = split.plan
    ids_list, labels_list = [], []
    for k in segments:
        ids, labels = split.data.tokens(int(plan.seg_sample[k]), int(plan.seg_start[k]), int(plan.seg_end[k]))
        ids_list.append(ids.tolist())
        labels_list.append(labels.tolist())
    return ids_list, labels_list


def _scored(labels: list[int]) -> int:
    """Supervised targets of one document: labels that a causal shift inside the document uses (position 0 never)."""
    return sum(1 for t in labels[1:] if t != IGNORE_INDEX)


def _check_same_objective(
    cfg: BenchConfig, dm: Any, module: Any, ids_list: list[list[int]], labels_list: list[list[int]]
) -> tuple[list[str], dict[str, str]]:
    """Assert that every side scores the same tokens of the same documents, that TRL's padding-free batches are
    correct on CPU SDPA, and that the peers' optimizer groups and schedule are xtl's. Returns the printed lines and
    each peer's effective trainer arguments (:func:`effective_args`)."""
    import collections

    import torch
    from datasets import load_dataset, load_from_disk
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainingArguments
    from transformers.trainer_pt_utils import LengthGroupedSampler
    from trl.kernels.chunked_logprob import _use_triton

    from xtl.train.optim import lr_lambda, param_groups
    from xtl.utils import resolve_path

    lines = []
    scored = [_scored(x) for x in labels_list]
    xtl_docs = collections.Counter((tuple(i), s) for i, s in zip(ids_list, scored))
    # xtl: the supervised targets of its own collated micro-batches (all packs) are the per-document sum
    split, collate = dm.train_split, dm.collator()
    xtl_total = sum(mb.num_tokens for k in range(len(split.packs)) for mb in collate([split.packs[k]]))
    assert xtl_total == sum(scored), f"xtl collator scores {xtl_total} targets, its samples {sum(scored)}"
    # transformers: its collator over the saved dataset, per sample
    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer)
    rows = load_from_disk(cfg.hf_data).remove_columns(["assistant_masks", "length"])
    padder = _hf_collator(tokenizer)
    hf_scored: list[int] = []
    for a in range(0, len(rows), 256):
        batch = padder([rows[k] for k in range(a, min(a + 256, len(rows)))])
        hf_scored += (batch["labels"][:, 1:] != IGNORE_INDEX).sum(1).tolist()
    assert hf_scored == scored, "transformers scores other tokens per sample than xtl"
    configs = {"transformers": effective_args(TrainingArguments(**_hf_args(cfg)))}
    # TRL: each variant's prepared dataset, split into documents, and its own collator
    model = AutoModelForCausalLM.from_pretrained(cfg.hf_dir, attn_implementation="sdpa", dtype=torch.float32)
    variants = [p for p in cfg.peers if p.startswith("trl")] or ["trl"]
    trainers = {}
    layout = {True: "BFD packs, split by seq_lengths", False: "one document each"}
    for variant in variants:
        trainer = trainers[variant] = _trl_trainer(
            cfg, model, tokenizer, _trl_columns(load_from_disk(cfg.hf_data)), [], variant
        )
        docs, collated = _trl_documents(trainer)
        assert docs == xtl_docs, f"{variant}: TRL's documents or their scored tokens differ from xtl's"
        assert collated == sum(scored), (
            f"{variant}: TRL's collated batches score {collated} targets, xtl {sum(scored)}"
        )
        sampler = trainer._get_train_sampler()
        if trainer.args.train_sampling_strategy == "group_by_length":
            assert isinstance(sampler, LengthGroupedSampler), (
                f"{variant}: {type(sampler).__name__}, not length-grouped"
            )
        assert not trainer.args.gradient_checkpointing and not model.is_gradient_checkpointing
        configs[variant] = effective_args(trainer.args)
        lines.append(
            f"{variant}: {len(trainer.train_dataset)} rows ({layout[trainer.args.packing]}), "
            f"same (token ids, scored) per document as xtl and collated total {collated} (asserted); sampler "
            f"{type(sampler).__name__}; gradient checkpointing off (asserted)"
        )
    lines.insert(
        0,
        f"same objective (asserted): {len(scored)} documents, {sum(scored)} scored tokens; scored tokens per document "
        f"identical on all sides (xtl collator total {xtl_total}; transformers collator per sample; TRL per (token "
        f"ids, scored) document and collated total)",
    )
    # TRL's own chat route: assistant_only_loss=True with a {% generation %}-marked copy of the chat template
    marked = AutoTokenizer.from_pretrained(cfg.tokenizer)
    marked.chat_template = _marked_template(marked.chat_template)
    raw = load_dataset(
        "json",
        data_files=[resolve_path(spec.path) for spec in dm.sources],
        split="train",
        cache_dir=str(Path(cfg.work_dir) / "hf_datasets_cache"),
    ).select_columns(["messages"])
    native = _trl_trainer(cfg, model, marked, raw, [], variants[0], assistant_only_loss=True)
    assert _trl_documents(native)[0] == xtl_docs, "TRL's assistant_only_loss (marked template) differs from xtl's"
    lines.append(
        "TRL's chat route (assistant_only_loss=True, tokenizer template copy with {% generation %} around each "
        "assistant body and its <|im_end|>) gives the same documents and scored tokens (asserted, all samples)"
    )
    # TRL's fused LM head on this device: supervised rows only where Triton runs, every row elsewhere
    compact = _use_triton(torch.device("cpu"))
    rows_scored = (
        "supervised rows only"
        if compact
        else "CPU fallback: EVERY row of the batch is projected and scored (prompts and padding included, masked "
        "afterwards), tiles folded in torch ops, entropy + top-1 per row, gradient GEMMs in fp32"
    )
    lines.append(
        "TRL's LM head: SFTTrainer always patches the model with trl.trainer.utils.add_fused_lm_head (no config field "
        f"turns it off; liger's fused CE is refused); trl.kernels.chunked_logprob._use_triton(cpu) = {compact}: "
        + rows_scored
    )
    if "trl-bfd" in trainers:
        # padding-free on CPU SDPA: a packed row's logits are the per-document logits (no attention across documents)
        trainer = trainers["trl-bfd"]
        row = next(r for r in trainer.train_dataset if len(r["seq_lengths"]) >= 2)
        batch = trainer.data_collator([row])
        model.eval()
        with torch.no_grad():
            inputs = {k: v for k, v in batch.items() if k != "labels"}
            logits = model(**inputs).logits[0]
            pieces, a = [], 0
            for n in row["seq_lengths"]:
                pieces.append(model(input_ids=torch.tensor([row["input_ids"][a : a + n]])).logits[0])
                a += n
            diff = float((logits - torch.cat(pieces)).abs().max())
            crossing = float((model(input_ids=batch["input_ids"]).logits[0] - torch.cat(pieces)).abs().max())
        assert diff < 1e-3 < crossing, f"padding-free SDPA: packed vs per-document logits differ by {diff}"
        lines.append(
            "trl-bfd padding-free on CPU SDPA: CPU fallback, transformers builds a block-diagonal causal mask from "
            f"the packed position_ids (not varlen flash attention: the full {cfg.hf['max_length']}-token row is "
            f"computed, masked); packed logits = per-document logits, max |diff| {diff:.1e} (control, attention "
            f"across documents: {crossing:.1e}) (asserted)"
        )
    # optimizer groups and schedule: the peers' copies equal xtl's functions
    hf = cfg.hf
    ref = lr_lambda(hf["schedule"], hf["warmup_steps"], hf["total_steps"], hf["min_lr_ratio"])
    mine = lr_factor(hf["schedule"], hf["warmup_steps"], hf["total_steps"], hf["min_lr_ratio"])
    assert all(ref(s) == mine(s) for s in range(hf["total_steps"] + 2)), "peer schedule differs from xtl's"
    ours = param_groups(module.model_config.build(), hf["weight_decay"], hf["no_decay_norm_bias_embed"])
    theirs = peer_param_groups(model, hf["weight_decay"], hf["no_decay_norm_bias_embed"])
    sizes = [[(sum(p.numel() for p in g["params"]), g["weight_decay"]) for g in x] for x in (ours, theirs)]
    assert sizes[0] == sizes[1], f"peer parameter groups (numel, weight decay) {sizes[1]} differ from xtl's {sizes[0]}"
    assert module.optimizer_config.__class__.__name__ == "AdamWConfig", "the peers run AdamW: the recipe must too"
    lines.append(
        f"peer optimizer groups (numel, weight decay) {sizes[1]} = xtl.train.optim.param_groups on xtl's model; "
        "LambdaLR schedule = xtl.train.optim.lr_lambda (asserted)"
    )
    return lines, configs


def _trl_documents(trainer: Any) -> tuple[Any, int]:
    """TRL's prepared training rows split into documents (``seq_lengths`` of a packed row, else the row), counted by
    (token ids, scored targets), and the scored targets of its own collator over all rows."""
    import collections

    docs: collections.Counter = collections.Counter()
    collated = 0
    rows = trainer.train_dataset
    for a in range(0, len(rows), 64):
        chunk = [rows[k] for k in range(a, min(a + 64, len(rows)))]
        for row in chunk:
            start = 0
            for n in row.get("seq_lengths") or [len(row["input_ids"])]:
                docs[(tuple(row["input_ids"][start : start + n]), _scored(row["labels"][start : start + n]))] += 1
                start += n
        collate = [chunk] if not trainer.args.padding_free else [[row] for row in chunk]  # one packed row per batch
        collated += sum(int((trainer.data_collator(c)["labels"][:, 1:] != IGNORE_INDEX).sum()) for c in collate)
    return docs, collated


def _marked_template(template: str) -> str:
    """The tokenizer's Qwen3 chat template with ``{% generation %}`` around what xtl's ``qwen3`` template scores:
    each assistant turn's body (think block, content, tool calls) and its ``<|im_end|>``, not its header."""
    edits = [  # the header first, then one generation block (Jinja blocks nest: it cannot open inside an if)
        (
            "{%- if loop.index0 > ns.last_query_index %}",
            "{{- '<|im_start|>' + message.role + '\\n' }}{% generation %}"
            "\n{%- if loop.index0 > ns.last_query_index %}",
            1,
        ),
        ("{{- '<|im_start|>' + message.role + '\\n<think>\\n' + ", "{{- '<think>\\n' + ", 1),
        ("{{- '<|im_start|>' + message.role + '\\n' + content }}", "{{- content }}", 2),
        (
            "{{- '<|im_end|>\\n' }}\n    {%- elif message.role == \"tool\" %}",
            "{{- '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}\n    {%- elif message.role == \"tool\" %}",
            1,
        ),
    ]
    for old, new, count in edits:
        assert template.count(old) == count, f"unexpected chat template: {old!r} found {template.count(old)} times"
        template = template.replace(old, new)
    return template


def _save_synthetic_model(cfg: BenchConfig, hf_dir: Path) -> None:
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from xtl.data import tiny_assets_dir

    tokenizer = AutoTokenizer.from_pretrained(tiny_assets_dir())

    heads = max(1, cfg.hidden // 64)
    config = Qwen3Config(
        vocab_size=1600,
        hidden_size=cfg.hidden,
        intermediate_size=3 * cfg.hidden,
        num_hidden_layers=cfg.layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(cfg.seed)
    Qwen3ForCausalLM(config).save_pretrained(hf_dir)


def run_xtl(cfg: BenchConfig) -> SideResult:
    """Build the ``xtl fit`` objects of the recipe, add a step clock, train ``cfg.steps`` steps."""
    child_setup(cfg.threads, uses_datasets=False)
    import lightning.pytorch as pl

    from xtl.callbacks.compile import compiled_frames
    from xtl.cli import XTLCLI

    timer = StepTimer()
    frames: list[int] = []  # Dynamo frames compiled so far, at the end of each step

    class Clock(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            timer.watch(module.model)

        def on_train_batch_start(self, *args: Any) -> None:
            timer.step_start()

        def on_train_batch_end(
            self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any, *_
        ) -> None:
            timer.step_end(
                sum(mb.num_real_tokens for mb in batch),
                sum(mb.seq_ctx.seq_len for mb in batch),
                sum(mb.num_tokens for mb in batch),
            )
            frames.append(compiled_frames())

    root = tempfile.mkdtemp(prefix="xtl_run_", dir=cfg.work_dir)  # a fresh run folder (logs, checkpoints) per run
    with contextlib.redirect_stdout(io.StringIO()):  # the data summary line every run prints
        cli = XTLCLI(args=[*cfg.xtl_args, f"--trainer.default_root_dir={root}"], run=False)
        cli.trainer.callbacks.append(Clock())
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    result = timer.result("xtl")
    if cfg.compile != "none":
        result.recompiles = frames[-1] - frames[0]
    return result


def _hf_args(cfg: BenchConfig) -> dict[str, Any]:
    """``transformers.Trainer``'s arguments: the shared ones, ``cfg.hf_batch`` samples x ``cfg.hf_accum``, sampler."""
    return {
        **peer_args(cfg, "hf"),
        "per_device_train_batch_size": cfg.hf_batch,
        "gradient_accumulation_steps": cfg.hf_accum,
        "train_sampling_strategy": cfg.hf_sampling,
    }


def _hf_collator(tokenizer: Any) -> Any:
    from transformers import DataCollatorForSeq2Seq

    return DataCollatorForSeq2Seq(tokenizer, padding="longest", label_pad_token_id=IGNORE_INDEX, return_tensors="pt")


def _trl_columns(dataset: Any) -> Any:
    """The pre-tokenized columns TRL gets: ids and xtl's loss mask (TRL builds ``labels`` from ``assistant_masks``)."""
    return dataset.select_columns(["input_ids", "assistant_masks"])


def _trl_trainer(
    cfg: BenchConfig,
    model: Any,
    tokenizer: Any,
    dataset: Any,
    callbacks: list[Any],
    variant: str = "trl",
    assistant_only_loss: bool = False,
) -> Any:
    """TRL's ``SFTTrainer`` as a TRL user configures it on CPU.

    ``trl``: no packing, pad-to-longest batches of ``cfg.hf_batch`` samples grouped by length (``cfg.hf_sampling``,
    as ``transformers``), ``cfg.hf_accum`` accumulation. ``trl-bfd``: BFD packing at the pack length, padding-free,
    one packed row per micro-batch and xtl's micro-batches per step as accumulation, random row order. Both without
    gradient checkpointing (SFTConfig's default is on). ``assistant_only_loss=True``: the chat route (raw
    ``messages``).
    """
    from trl import SFTConfig, SFTTrainer

    if variant == "trl":
        layout = {
            "per_device_train_batch_size": cfg.hf_batch,
            "gradient_accumulation_steps": cfg.hf_accum,
            "train_sampling_strategy": cfg.hf_sampling,
            "packing": False,
            "padding_free": False,
        }
    elif variant == "trl-bfd":
        layout = {
            "per_device_train_batch_size": 1,
            "gradient_accumulation_steps": cfg.hf["micro_batches"],
            "train_sampling_strategy": "random",
            "packing": True,
            "packing_strategy": "bfd",
            "padding_free": True,
        }
    else:
        raise ValueError(f"unknown TRL variant {variant!r}")
    args = SFTConfig(
        **peer_args(cfg, variant),
        **layout,
        max_length=cfg.hf["max_length"],
        pad_to_multiple_of=None,
        loss_type="nll",
        completion_only_loss=None,
        assistant_only_loss=assistant_only_loss,
        activation_offloading=False,
        dataset_num_proc=None,
        shuffle_dataset=False,
    )
    return SFTTrainer(
        model=model,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        optimizers=peer_optimizers(model, cfg.hf),
        callbacks=callbacks,
    )


# Speed-relevant fields printed whatever their value (besides every field that differs from the class default)
SPEED_FIELDS = (
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "train_sampling_strategy",
    "gradient_checkpointing",
    "activation_checkpointing",
    "bf16",
    "fp16",
    "tf32",
    "use_cpu",
    "torch_compile",
    "use_liger_kernel",
    "liger_kernel_config",
    "dataloader_num_workers",
    "dataloader_pin_memory",
    "dataloader_drop_last",
    "logging_strategy",
    "logging_steps",
    "eval_strategy",
    "save_strategy",
    "include_num_input_tokens_seen",
    "average_tokens_across_devices",
    "packing",
    "packing_strategy",
    "padding_free",
    "pad_to_multiple_of",
    "max_length",
    "loss_type",
    "completion_only_loss",
    "assistant_only_loss",
    "activation_offloading",
    "dataset_num_proc",
    "shuffle_dataset",
)
NOT_PRINTED = {"output_dir", "logging_dir", "run_name", "hub_token", "seed", "disable_tqdm", "report_to"}


def effective_args(args: Any) -> str:
    """The effective (post-init) settings of a ``TrainingArguments`` / ``SFTConfig``: every field that differs from
    the class's default (e.g. SFTConfig's ``gradient_checkpointing=True``; the default object is built with
    ``use_cpu=True``), marked ``*``, plus :data:`SPEED_FIELDS` at their values."""
    import dataclasses
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        defaults = type(args)(output_dir=args.output_dir, use_cpu=True)  # use_cpu: SFTConfig's bf16 needs it on CPU
    shown = []
    for f in dataclasses.fields(args):
        if f.name in NOT_PRINTED or not f.init:
            continue
        value, default = getattr(args, f.name), getattr(defaults, f.name)
        changed = repr(value) != repr(default)
        if changed or f.name in SPEED_FIELDS:
            shown.append(f"{f.name}={getattr(value, 'value', value)!r}{'*' if changed else ''}")  # enums: their value
    return ", ".join(shown)


def _counting(collate: Any, counts: list[tuple[int, int, int]]) -> Any:
    """Wrap a collator to record (useful, processed, scored) tokens of every batch it builds (in order)."""

    def wrapped(features: list[dict[str, Any]]) -> Any:
        batch = collate(features)
        ids = batch["input_ids"]
        useful = int(batch["attention_mask"].sum()) if "attention_mask" in batch else ids.numel()  # padding-free
        counts.append((useful, ids.numel(), int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())))
        return batch

    return wrapped


def _peer_model(cfg: BenchConfig, timer: StepTimer) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(cfg.hf_dir, attn_implementation="sdpa", dtype=torch.float32)
    timer.watch(model)
    return model


def run_transformers(cfg: BenchConfig) -> SideResult:
    """Train with ``transformers.Trainer`` on pad-to-longest batches of xtl's samples and labels."""
    child_setup(cfg.threads, uses_lightning=False)
    from datasets import load_from_disk
    from transformers import AutoTokenizer, PrinterCallback, Trainer, TrainingArguments

    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer)
    counts: list[tuple[int, int, int]] = []
    timer = StepTimer()
    model = _peer_model(cfg, timer)
    args = TrainingArguments(**_hf_args(cfg))
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=load_from_disk(cfg.hf_data).remove_columns(["assistant_masks"]),
        data_collator=_counting(_hf_collator(tokenizer), counts),
        processing_class=tokenizer,
        optimizers=peer_optimizers(model, cfg.hf),
        callbacks=[peer_clock(timer, counts, cfg.hf_accum)],
    )
    trainer.remove_callback(PrinterCallback)  # it prints the final metrics dict even with logging_strategy="no"
    trainer.train()
    return timer.result("transformers")


def run_trl(cfg: BenchConfig, variant: str = "trl") -> SideResult:
    """Train with TRL's ``SFTTrainer`` (``variant``: see :func:`_trl_trainer`) on xtl's samples and loss mask."""
    child_setup(cfg.threads, uses_lightning=False)
    from datasets import load_from_disk
    from transformers import AutoTokenizer, PrinterCallback

    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer)
    counts: list[tuple[int, int, int]] = []
    timer = StepTimer()
    model = _peer_model(cfg, timer)
    accum = cfg.hf_accum if variant == "trl" else cfg.hf["micro_batches"]
    clock = peer_clock(timer, counts, accum)
    trainer = _trl_trainer(cfg, model, tokenizer, _trl_columns(load_from_disk(cfg.hf_data)), [clock], variant)
    trainer.data_collator = _counting(trainer.data_collator, counts)  # padding-free takes no custom collator at init
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    return timer.result(variant)


def run_trl_bfd(cfg: BenchConfig) -> SideResult:
    """:func:`run_trl` with BFD packing and padding-free rows."""
    return run_trl(cfg, "trl-bfd")


# ---- main --------------------------------------------------------------------------------------------------------


def main() -> None:
    """Parse arguments, prepare data and weights, run the repetitions of child processes, print the comparison."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_protocol_args(parser, pairs=5, warmup=1)
    parser.add_argument("--recipe", default="tiny", choices=["tiny", "synthetic"])
    parser.add_argument(
        "--steps", type=int, default=0, help="optimizer steps per run, the first excluded (0: per recipe)"
    )
    parser.add_argument("--precision", default="auto", choices=["auto", "bf16-mixed", "32-true"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--peers", default=",".join(PEERS), help=f"comma-separated peers among {', '.join(PEERS)} (default: all)"
    )
    parser.add_argument(
        "--hf-sampling", default="group_by_length", choices=["group_by_length", "random", "sequential"]
    )
    parser.add_argument("--hf-accum", type=int, default=1, help="transformers gradient accumulation steps")
    parser.add_argument("--hf-batch", type=int, default=0, help="transformers batch size (0: matched useful tokens)")
    parser.add_argument(
        "--no-fused", action="store_true", help="xtl with separate q/k/v and gate/up projections (fused by default)"
    )
    parser.add_argument(
        "--compile",
        default="none",
        choices=["none", "layers", "model"],
        help="xtl with the Compile callback (inductor): per layer, or the whole forward (scope: model)",
    )
    synthetic = parser.add_argument_group("synthetic recipe")
    synthetic.add_argument("--hidden", type=int, default=256, help="hidden size (heads = hidden/64, head_dim 64)")
    synthetic.add_argument("--layers", type=int, default=4)
    synthetic.add_argument("--samples", type=int, default=1000, help="SFT records to generate")
    synthetic.add_argument("--median", type=float, default=150.0, help="median sample length in tokens")
    synthetic.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma of sample lengths")
    synthetic.add_argument("--pack", type=int, default=2048, help="xtl pack length (tokens per step)")
    args = parser.parse_args()
    steps = args.steps or DEFAULT_STEPS[args.recipe]
    if steps < 2:
        parser.error("--steps must be >= 2 (step 1 is excluded as warm-up)")
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    if not peers or any(p not in PEERS for p in peers):
        parser.error(f"--peers: choose among {', '.join(PEERS)}")
    precision = args.precision if args.precision != "auto" else ("bf16-mixed" if cpu_has_bf16() else "32-true")
    print(f"load average before: {load_average()}")
    start = time.perf_counter()

    with tempfile.TemporaryDirectory(prefix="xtl-train-bench-") as tmp:
        work = Path(tmp)
        cfg = BenchConfig(
            recipe=args.recipe,
            work_dir=str(work),
            steps=steps,
            threads=args.threads,
            precision=precision,
            seed=args.seed,
            hf_sampling=args.hf_sampling,
            hf_accum=args.hf_accum,
            hf_batch=args.hf_batch,
            peers=peers,
            hidden=args.hidden,
            fused=not args.no_fused,
            compile=args.compile,
            layers=args.layers,
        )
        data = None
        if args.recipe == "synthetic":
            data = work / "sft_mix.jsonl"
            write_sft_mix(data, args.samples, args.seed, args.median, args.sigma)
        cfg.xtl_args = xtl_args(cfg, data, args.pack)
        info = in_child(prepare, cfg)
        for key in ("hf_dir", "hf_data", "tokenizer", "hf", "hf_batch"):
            setattr(cfg, key, info[key])
        _print_setup(cfg, info)

        runs: dict[str, list[SideResult]] = {"xtl": [], **{p: [] for p in peers}}
        functions = {"transformers": run_transformers, "trl": run_trl, "trl-bfd": run_trl_bfd}

        def run_xtl_side() -> float:
            runs["xtl"].append(in_child(run_xtl, cfg))
            return runs["xtl"][-1].useful_tok_s

        def run_peer_sides() -> float:  # the peers' own order alternates too: xtl, A, B | B, A, xtl | xtl, A, B ...
            order = peers if len(runs[peers[0]]) % 2 == 0 else peers[::-1]
            for name in order:
                runs[name].append(in_child(functions[name], cfg))
            return runs[peers[0]][-1].useful_tok_s

        def on_pair(i: int, a: float, b: float) -> None:
            first = "xtl" if (args.warmup + i) % 2 == 0 else peers[-1]
            print(f"repetition {i + 1} ({first} first):", flush=True)
            for name, results in runs.items():
                print(run_line(name, results[-1]), flush=True)

        run_pairs(
            run_xtl_side,
            run_peer_sides,
            args.pairs,
            args.warmup,
            metric="useful tokens/s",
            higher_is_better=True,
            on_pair=on_pair,
        )
    timed = {name: results[args.warmup :] for name, results in runs.items()}
    print(f"\nresults ({args.pairs} timed repetitions after {args.warmup} warm-up(s), order alternating):")
    speeds: dict[str, PairedResult] = {}
    cpus: dict[str, PairedResult] = {}
    memories: dict[str, PairedResult] = {}
    for peer in peers:
        x, p = timed["xtl"], timed[peer]
        speeds[peer] = PairedResult("useful tokens/s", [r.useful_tok_s for r in x], [r.useful_tok_s for r in p], True)
        cpus[peer] = cpu = PairedResult(
            "useful tokens per CPU second", [r.useful_tok_cpu_s for r in x], [r.useful_tok_cpu_s for r in p], True
        )
        memories[peer] = PairedResult(
            "peak RSS MiB", [r.peak_rss_bytes / 2**20 for r in x], [r.peak_rss_bytes / 2**20 for r in p]
        )
        print(f"vs {peer}:")
        for result in (speeds[peer], cpu, memories[peer]):
            print("  " + result.summary("xtl", peer))
    print("where the time goes (median per timed step):")
    for name, results in timed.items():
        print(breakdown(name, results))
    # by CPU time: a shared machine that deschedules one run halves its wall-clock tokens/s, not its CPU-time rate
    strongest = max(peers, key=lambda p: statistics.median(cpus[p].b))
    ratio, mem = statistics.median(speeds[strongest].ratios), statistics.median(memories[strongest].ratios)
    print(
        f"strongest peer (highest median useful tokens per CPU second, the default reference): {strongest}; "
        + "; ".join(
            f"xtl/{p} useful tok/s {statistics.median(speeds[p].ratios):.3f} "
            f"({min(speeds[p].ratios):.3f}..{max(speeds[p].ratios):.3f}), peak RSS "
            f"{statistics.median(memories[p].ratios):.3f} "
            f"({min(memories[p].ratios):.3f}..{max(memories[p].ratios):.3f})"
            for p in peers
        )
    )
    if args.recipe == "tiny" and precision == "bf16-mixed":
        reached = ratio >= TARGET_SPEED and mem <= TARGET_MEMORY
        print(
            f"acceptance (tiny, bf16, vs {strongest}): useful tok/s {ratio:.2f}x (>= {TARGET_SPEED}) at peak RSS "
            f"{mem:.2f}x (<= {TARGET_MEMORY}): {'reached' if reached else 'NOT reached'}"
        )
    print(f"total {time.perf_counter() - start:.0f} s; load average after: {load_average()}")


def _print_setup(cfg: BenchConfig, info: dict[str, Any]) -> None:
    report, hf = info["xtl_report"], cfg.hf
    xtl_cut = f"{report['truncated_overlong']} samples truncated ({report['truncated_tokens']} tokens cut)"
    if report["dropped_overlong"]:
        xtl_cut += f", {report['dropped_overlong']} dropped"
    precision = "bf16-mixed (fp32 weights, CPU autocast bf16)" if cfg.precision == "bf16-mixed" else "fp32"
    peer_precision = (
        "bf16=True (accelerate CPU autocast bf16, fp32 weights)" if cfg.precision == "bf16-mixed" else "fp32"
    )
    hf_tokens_per_step = cfg.hf_batch * cfg.hf_accum * info["hf_mean"]
    optimizer = (
        f"fused AdamW lr {hf['lr']}, betas {tuple(hf['betas'])}, eps {hf['eps']}, wd {hf['weight_decay']} (not on "
        f"norms/biases/embeddings), clip {hf['max_grad_norm']}"
    )
    schedule = (
        f"{hf['schedule']}, warmup {hf['warmup_steps']}, min lr ratio {hf['min_lr_ratio']}, over {hf['total_steps']} "
        "steps"
    )
    data = "xtl's samples (xtl tokenization, recipe template, xtl truncation), pre-tokenized"
    trl_head = (
        "TRL fused LM head (add_fused_lm_head, always on in SFTTrainer) [CPU fallback: no Triton, so every row is "
        "projected and scored, prompts and padding included, then masked; + entropy/top-1 per row; fp32 grad GEMMs]"
    )
    mask = "xtl's loss mask (assistant turns: body + <|im_end|>; not headers, prompts, system)"
    print(f"recipe {cfg.recipe}: model {info['model']}, {info['params'] / 1e6:.2f}M params")
    print(
        f"data: {', '.join(info['sources'])} | {report['documents']} documents, {report['tokens']} tokens (mean "
        f"{info['hf_mean']:.1f}, median {info['hf_median']:.0f}, max {info['hf_max']}); overlong "
        f"{info['overlong']} at {info['pack']}: {xtl_cut}"
    )
    for line in info["checks"]:
        print(f"check: {line}")
    print(f"{cfg.steps} steps per run (step 1 excluded), threads {cfg.threads} per child")
    if "transformers" in cfg.peers and cfg.hf_sampling == "group_by_length" and (cfg.steps - 1) % HF_MEGABATCH:
        print(
            f"note: transformers' length-grouped sampler serves each megabatch of {HF_MEGABATCH} batches longest "
            f"first; {cfg.steps - 1} timed steps are not whole megabatches, so its tokens/step are biased (use "
            f"--steps {HF_MEGABATCH * max(1, round((cfg.steps - 1) / HF_MEGABATCH)) + 1})"
        )
    sides: dict[str, dict[str, Any]] = {
        "xtl": {
            "runs": f"xtl fit --config {TINY_RECIPE.relative_to(ROOT)} " + " ".join(cfg.xtl_args[2:]),
            "precision": precision,
            "batch": f"{info['micro_batches']} packs x {info['pack']} tokens per step "
            f"(~{info['xtl_tokens_per_step']:.0f} useful tokens)",
            "ordering": f"{info['sampler']} pack order",
            "packing": f"best-fit, plan fill {report['fill_ratio']:.3f}, packs padded to {info['pack']}",
            "template": info["template"],
            "attention": "sdpa per document (varlen: no compute across documents) [xtl-only]",
            "projections": "q/k/v fused, gate/up fused: one matmul each [xtl-only]"
            if cfg.fused
            else "separate q, k, v, gate, up (as the peers)",
            "head+loss": "fused chunked LM head + CE on supervised rows, no logits materialized",
            "loss tokens": mask,
            "optimizer": optimizer,
            "schedule": schedule,
            "logging": "every step (recipe), metrics.csv flushed every 100 steps (Lightning's CSVLogger default)",
            "compile": {
                "none": "eager",
                "layers": "Compile(): each decoder layer + head/loss, inductor [xtl-only]",
                "model": "Compile(scope=model): the whole forward + head/loss, inductor [xtl-only]",
            }[cfg.compile],
        },
        "transformers": {
            "runs": "transformers.Trainer (use_cpu=True)",
            "precision": peer_precision,
            "gradient checkpointing": "off (gradient_checkpointing=False, explicit)",
            "batch": f"{cfg.hf_batch} samples x {cfg.hf_accum} accumulation per step "
            f"(~{hf_tokens_per_step:.0f} useful tokens)",
            "ordering": f"train_sampling_strategy={cfg.hf_sampling}",
            "packing": "none: pad to longest in batch (DataCollatorForSeq2Seq)",
            "data": data,
            "attention": "sdpa (padding mask)",
            "head+loss": "full logits, ForCausalLMLoss",
            "loss tokens": f"labels = {mask}",
            "optimizer": optimizer + " (xtl's groups, passed as optimizers=)",
            "schedule": schedule + " (xtl's lr_lambda as LambdaLR)",
            "logging": "none",
        },
        "trl": {
            "runs": "trl.SFTTrainer (use_cpu=True), as a TRL user configures it on CPU (module docstring)",
            "precision": peer_precision,
            "gradient checkpointing": "off (gradient_checkpointing=False; SFTConfig's default is True)",
            "batch": f"{cfg.hf_batch} samples x {cfg.hf_accum} accumulation per step "
            f"(~{hf_tokens_per_step:.0f} useful tokens, as transformers)",
            "ordering": f"train_sampling_strategy={cfg.hf_sampling}",
            "packing": "packing=False, padding_free=False: pad to longest in batch (TRL's collator)",
            "data": data + " (input_ids + assistant_masks)",
            "attention": "sdpa (padding mask)",
            "head+loss": trl_head,
            "loss tokens": f"assistant_masks = {mask} (= assistant_only_loss=True with the marked template)",
            "optimizer": optimizer + " (xtl's groups, passed as optimizers=)",
            "schedule": schedule + " (xtl's lr_lambda as LambdaLR)",
            "logging": "logging_strategy=no (TRL still computes entropy/accuracy metrics every micro-batch)",
        },
        "trl-bfd": {
            "runs": "trl.SFTTrainer (use_cpu=True), BFD packing + padding-free (TRL's packing recipe; GPU-oriented)",
            "precision": peer_precision,
            "gradient checkpointing": "off (gradient_checkpointing=False; SFTConfig's default is True)",
            "batch": f"1 BFD row of <= {info['pack']} tokens x {info['micro_batches']} accumulation per step",
            "ordering": "train_sampling_strategy=random (row order)",
            "packing": "packing=True, packing_strategy=bfd, padding_free=True (flattened rows + position_ids)",
            "data": data + " (input_ids + assistant_masks)",
            "attention": "sdpa with a block-diagonal causal mask from position_ids [CPU fallback: masked full-row "
            "attention, no varlen flash attention]",
            "head+loss": trl_head,
            "loss tokens": f"assistant_masks = {mask} (= assistant_only_loss=True with the marked template)",
            "optimizer": optimizer + " (xtl's groups, passed as optimizers=)",
            "schedule": schedule + " (xtl's lr_lambda as LambdaLR)",
            "logging": "logging_strategy=no (TRL still computes entropy/accuracy metrics every micro-batch)",
        },
    }
    print_configs(**{name: config for name, config in sides.items() if name == "xtl" or name in cfg.peers})
    for name, effective in info["peer_configs"].items():
        if name in cfg.peers:
            print(
                f"{name} effective {'SFTConfig' if name.startswith('trl') else 'TrainingArguments'} (* = not the "
                f"class default; speed-relevant fields always shown): {effective}"
            )


if __name__ == "__main__":
    main()
