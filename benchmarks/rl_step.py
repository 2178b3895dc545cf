"""One GRPO step of xtl's ``GRPOModule`` vs TRL's ``GRPOTrainer``: rollout, judging, old log-probabilities and the
updates of one rollout batch, each side in its own process.

Usage::

    python benchmarks/rl_step.py [--cycles 3 --pairs 5 --warmup 1 --threads 1 --precision auto
                                  --trl-generation generate|continuous_batching --no-fused]
    python benchmarks/rl_step.py --async [...]   # asynchronous against synchronous xtl (benchmarks/rl_async.py)

Method:

1. Recipe: ``configs/tiny_grpo.yaml`` (GRPO, 16 prompts x 8 completions of at most 12 new tokens at temperature 1,
   two mini-batches: two optimizer steps per rollout batch, on the log-probabilities it was sampled with; the math
   judger; AdamW lr 3e-4, no decay, constant schedule after 2 warm-up steps, clipping at 1.0) with what both sides
   support: no dynamic sampling (TRL has none: ``dynamic_sampling: false``, one round, no oversampling). The policy
   is the recipe's architecture (the tiny SFT model: Qwen3, vocab 1600, hidden 128, 4 layers) initialized by xtl
   with seed 0 and saved as an HF directory that both sides load (the recipe starts from the SFT run's export; an
   untrained policy rarely emits a stop token, so nearly every completion has the full 12 tokens on both sides).
2. One *GRPO step* is one rollout batch: generation, judging, the old log-probabilities, and its two optimizer
   steps (xtl: ``updates.mini_batches: 2``; TRL: ``steps_per_generation=2``, where TRL computes the old
   log-probabilities since ``gradient_accumulation_steps % steps_per_generation != 0``). The loss settings are equal:
   ``loss_type`` grpo, token-level ratio clipped at ``epsilon`` 0.2 both ways, ``beta`` 0 (no reference),
   ``scale_rewards`` group, one epoch (``num_iterations=1``). The prompts are xtl's own draws (its seeded prompt
   order, rendered with the recipe's ``qwen3`` template), given to TRL as text in the same order
   (``shuffle_dataset=False``); setup asserts that TRL tokenizes them to xtl's ids. TRL's reward function is the
   recipe's judger itself (the completion decoded as xtl decodes it: stop tokens dropped, thinking split off).
3. Setup (one spawned child; nothing timed) asserts, on xtl's sampled completions of the first rollout batch:
   TRL's reward function gives xtl's rewards; TRL's old log-probabilities equal xtl's (``OLD_LOGP_TOLERANCE``); and
   the GRPO loss of one mini-batch equals (``LOSS_TOLERANCE``), with the same advantages and old log-probabilities
   shifted per token (so the ratios differ from 1 and clip: the loss depends on the forward), and synthetic varied
   rewards (an untrained policy's completions all score 0).
4. Each run (a fresh spawned child per side) trains ``--cycles`` + 1 rollout batches; the first is warm-up. Stages,
   exclusive wall time: generation (xtl: the rollout engine's ``generate``; TRL: the model's ``generate``), judging
   (xtl: ``judger.judge_sync``; TRL: ``_calculate_rewards``), old log-probabilities (xtl: ``_fill_logps``; TRL:
   ``_get_per_token_logps_and_entropies`` without gradient), update (xtl: ``optimizer_step_over``: forward, backward,
   clipping, optimizer; TRL: ``training_step`` less ``_prepare_inputs``, gradient clipping, the optimizer step) and
   other (the rest: prompt rendering, decoding, padding/packing, advantages, logging, the loop).
5. Protocol (``benchmarks/_paired.py``): threads pinned in every child, ``--warmup`` untimed pairs, ``--pairs``
   timed pairs in alternating order; per pair the median step time of each run; printed: median ratio xtl/TRL with
   min..max of the whole step (wall, and the process's CPU time: a shared machine's descheduling barely moves it)
   and of every stage, and the completion tokens generated per step on each side.

The parent process stays stdlib-only (its children do all the work).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _paired import PairedResult, add_protocol_args, load_average, pin_threads, print_configs, run_pairs
from _peers import child_setup, cpu_has_bf16, in_child, optimizer_hparams, peer_optimizers

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "configs" / "tiny_grpo.yaml"
POLICY_RECIPE = ROOT / "configs" / "tiny_sft.yaml"  # the architecture of the recipe's policy (its SFT export)
TARGET = 2.0
STAGES = ("generation", "judging", "old_logps", "update")
LOSS_TOLERANCE = 1e-5
OLD_LOGP_TOLERANCE = 1e-4
LOGP_SHIFT = 0.3  # the loss check's old log-probabilities: shifted per token by up to this (ratios leave the clip)


@dataclass
class BenchConfig:
    """Everything a child needs (picklable); ``prepare`` fills the fields after ``xtl_args``."""

    work_dir: str
    threads: int
    precision: str
    cycles: int
    seed: int = 0
    fused: bool = True
    trl_generation: str = "generate"
    xtl_args: list[str] = field(default_factory=list)
    hf_dir: str = ""
    tokenizer: str = ""
    prompts: str = ""  # JSON file: xtl's prompt rows in draw order, with their rendered ids and text
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass
class SideResult:
    """Per timed rollout batch of one run: the whole step, its stages (exclusive seconds), completion tokens and the
    process's CPU seconds (all its threads; barely moved when a shared machine deschedules the run)."""

    name: str
    steps: list[float]
    stages: dict[str, list[float]]
    tokens: list[int]
    cpu_steps: list[float]
    threads: int
    first_step: float

    def median(self, key: str) -> float:
        """Median seconds per step of ``step``, a stage, or ``other`` (the step less its stages)."""
        if key == "step":
            return statistics.median(self.steps)
        if key == "other":
            return statistics.median(s - sum(self.stages[k][i] for k in STAGES) for i, s in enumerate(self.steps))
        return statistics.median(self.stages[key])


class StageClock:
    """Exclusive wall time per stage (a nested timed call's time is its own stage's, not its caller's) and a mark
    at the end of every rollout batch."""

    def __init__(self) -> None:
        self.spent = dict.fromkeys((*STAGES, "other"), 0.0)
        self.tokens = 0
        self.marks: list[tuple[float, float, dict[str, float], int]] = []
        self._stack: list[list[Any]] = []

    def push(self, stage: str) -> None:
        """Start timing ``stage`` (pausing the enclosing one)."""
        self._stack.append([stage, time.perf_counter(), 0.0])

    def pop(self) -> None:
        """Stop timing the innermost stage."""
        stage, start, inner = self._stack.pop()
        total = time.perf_counter() - start
        self.spent[stage] += total - inner
        if self._stack:
            self._stack[-1][2] += total

    def wrap(self, owner: Any, name: str, stage: str | Any) -> None:
        """Time every call of ``owner.name`` as ``stage`` (or as what ``stage()`` returns; ``None``: not timed)."""
        original = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            chosen = stage() if callable(stage) else stage
            if chosen is None:
                return original(*args, **kwargs)
            self.push(chosen)
            try:
                return original(*args, **kwargs)
            finally:
                self.pop()

        setattr(owner, name, timed)

    def mark(self) -> None:
        """The end of a rollout batch."""
        self.marks.append((time.perf_counter(), time.process_time(), dict(self.spent), self.tokens))

    def result(self, name: str) -> SideResult:
        """Every rollout batch after the first (warm-up)."""
        import torch

        if len(self.marks) < 2:
            raise RuntimeError(f"{name}: {len(self.marks)} rollout batch(es) ran; the first is warm-up")
        pairs = list(zip(self.marks, self.marks[1:]))
        return SideResult(
            name=name,
            steps=[b[0] - a[0] for a, b in pairs],
            stages={k: [b[2][k] - a[2][k] for a, b in pairs] for k in STAGES},
            tokens=[b[3] - a[3] for a, b in pairs],
            cpu_steps=[b[1] - a[1] for a, b in pairs],
            threads=torch.get_num_threads(),
            first_step=self.marks[0][0],
        )


# ---- setup -------------------------------------------------------------------------------------------------------


def xtl_args(cfg: BenchConfig, steps: int) -> list[str]:
    """The ``xtl fit`` arguments of a run: the recipe on the saved policy, without dynamic sampling."""
    work = Path(cfg.work_dir)
    args = [
        "--config",
        str(RECIPE),
        f"--model.init_args.model={cfg.hf_dir or work / 'hf_model'}",
        "--model.init_args.rollout.dynamic_sampling=false",
        "--model.init_args.rollout.max_rounds=1",
        "--model.init_args.rollout.oversample=1.0",
        f"--trainer.max_steps={steps}",
        f"--trainer.precision={cfg.precision}",
        f"--trainer.default_root_dir={work / 'xtl_prepare'}",
        "--trainer.enable_progress_bar=false",
        f"--data.cache_dir={work / 'xtl_cache'}",
        "--data.progress=false",
    ]
    if cfg.fused:
        args.append('--model.init_args.model_overrides={"fused_projections": true}')
    return args


def save_policy(hf_dir: Path, seed: int = 0) -> None:
    """The recipe's policy architecture (``configs/tiny_sft.yaml``'s model), initialized as xtl does with ``seed``,
    saved as an HF directory."""
    import torch
    import yaml

    from xtl.train.model_spec import resolve_model_config

    spec = yaml.safe_load(POLICY_RECIPE.read_text())["model"]["init_args"]["model"]
    model = resolve_model_config(spec, None)[0].build()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model.init_weights()
    model.save_hf(hf_dir)


def recipe_settings(module: Any) -> dict[str, Any]:
    """The recipe's settings both sides take (from the parsed ``GRPOModule``)."""
    sampling, objective, rollout, updates = module.sampling, module.objective, module.rollout, module.updates
    return {
        "group_size": sampling.group_size,
        "max_new_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "prompts_per_step": rollout.prompts_per_step,
        "mini_batches": updates.mini_batches,
        "epochs": updates.epochs,
        "micro_batches": updates.micro_batches,
        "loss_type": objective.loss_type,
        "importance_sampling": objective.importance_sampling,
        "epsilon_low": objective.epsilon_low,
        "epsilon_high": objective.epsilon_high,
        "beta": objective.beta,
        "scale_rewards": objective.scale_rewards,
        **optimizer_hparams(module, 1000),
    }


def prepare(cfg: BenchConfig) -> dict[str, Any]:
    """Save the policy, draw xtl's prompts, and assert that both sides judge and score xtl's completions alike."""
    child_setup(cfg.threads)
    full, prompts, judger, about = setup(cfg)
    check = same_step_check(full, prompts[: full.settings["prompts_per_step"]], judger)
    return {"cfg": full, "check": check, **about}


def setup(cfg: BenchConfig, **overrides: Any) -> tuple[BenchConfig, list[dict[str, Any]], Any, dict[str, Any]]:
    """Save the policy, parse the recipe with xtl's CLI and draw xtl's prompts of ``cfg.cycles + 1`` rollout batches
    (saved for TRL). ``overrides`` replace recipe settings (the test's smaller step). Returns the filled config, the
    prompts (rendered ids, their text, the answer), the recipe's judger and what the setup line prints."""
    from xtl.cli import XTLCLI
    from xtl.train.generation import stop_token_ids

    work = Path(cfg.work_dir)
    hf_dir = work / "hf_model"
    save_policy(hf_dir, cfg.seed)
    with contextlib.redirect_stdout(io.StringIO()):
        cli = XTLCLI(args=xtl_args(dataclasses.replace(cfg, hf_dir=str(hf_dir)), 2), run=False)
    dm, module = cli.datamodule, cli.model
    dm.prepare_data()
    dm.setup("fit")
    tokenizer = dm.load_tokenizer()
    settings = {**recipe_settings(module), **overrides}
    rows = []
    for _ in range(cfg.cycles + 1):  # xtl's draws of a run, in order (one rollout batch each)
        rows += dm.take(settings["prompts_per_step"])
    prompts = []
    for row in rows:
        ids = module_render(dm, row)
        prompts.append({"prompt": tokenizer.decode(ids), "ids": ids, "answer": row.get("answer")})
    Path(work / "prompts.json").write_text(json.dumps(prompts))
    settings["stop_token_ids"] = list(stop_token_ids(tokenizer, dm.template))
    full = dataclasses.replace(
        cfg,
        hf_dir=str(hf_dir),
        tokenizer=str(Path(tokenizer.name_or_path)),
        prompts=str(work / "prompts.json"),
        settings=settings,
    )
    return full, prompts, module.judger, {"template": dm.template, "sources": [s.path for s in dm.sources]}


def module_render(dm: Any, row: dict[str, Any]) -> list[int]:
    """A prompt row's ids as ``GRPOModule._render`` renders them."""
    from xtl.train.generation import chat_prompt_ids

    return chat_prompt_ids(dm.load_tokenizer(), row["prompt"], dm.template, dm.template_kwargs)


# ---- the same step on both sides ---------------------------------------------------------------------------------


def judger_reward(judger: Any, tokenizer: Any, stop: set[int], clock: StageClock | None = None) -> Any:
    """xtl's judger as a TRL reward function: the completion ids decoded as xtl decodes them (stop tokens dropped,
    the thinking split off), judged against the row's ``answer``."""
    from xtl.rl.judger import RolloutState
    from xtl.train.generation import split_thinking

    def math_judger(completions: list[Any], completion_ids: list[list[int]], answer: list[Any], **_: Any) -> list:
        if clock is not None:
            clock.tokens += sum(len(ids) for ids in completion_ids)
        texts = [split_thinking(tokenizer.decode([t for t in ids if t not in stop]))[1] for ids in completion_ids]
        states = [RolloutState(text, truth) for text, truth in zip(texts, answer, strict=True)]
        return [s.reward["score"] if s.reward else None for s in judger.judge_sync(states)]

    return math_judger


def trl_trainer(
    cfg: BenchConfig, judger: Any, callbacks: list[Any], clock: StageClock | None = None, **overrides: Any
) -> Any:
    """TRL's ``GRPOTrainer`` on the saved policy and xtl's prompts, with the recipe's settings (module docstring);
    ``overrides`` replace ``GRPOConfig`` arguments (the test's mutations)."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    s = cfg.settings
    warnings.filterwarnings("ignore", message=".*gradient_checkpointing.*deprecated", category=FutureWarning)
    rows = json.loads(Path(cfg.prompts).read_text())
    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer)
    model = AutoModelForCausalLM.from_pretrained(cfg.hf_dir, attn_implementation="sdpa", dtype=torch.float32)
    samples = s["prompts_per_step"] * s["group_size"]
    args = GRPOConfig(**{**trl_settings(cfg, samples, str(Path(cfg.work_dir) / "trl_out")), **overrides})
    dataset = datasets.Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
    reward = judger_reward(judger, tokenizer, set(s["stop_token_ids"]), clock)
    return GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        optimizers=peer_optimizers(model, s),
        callbacks=callbacks,
    )


def trl_settings(cfg: BenchConfig, samples: int, output_dir: str) -> dict[str, Any]:
    """``GRPOConfig`` arguments: the recipe's settings, TRL's fastest CPU path, every speed setting explicit."""
    s = cfg.settings
    return {
        "output_dir": output_dir,
        "max_steps": (cfg.cycles + 1) * s["mini_batches"],
        "per_device_train_batch_size": samples // s["mini_batches"],
        "gradient_accumulation_steps": 1,
        "steps_per_generation": s["mini_batches"],
        "num_iterations": s["epochs"],
        "num_generations": s["group_size"],
        "max_completion_length": s["max_new_tokens"],
        "temperature": s["temperature"],
        "top_p": s["top_p"],
        "top_k": s["top_k"],
        "min_p": None,
        "repetition_penalty": 1.0,
        "generation_kwargs": {"eos_token_id": s["stop_token_ids"]},  # xtl's stop tokens
        "loss_type": s["loss_type"],
        "importance_sampling_level": s["importance_sampling"],
        "epsilon": s["epsilon_low"],
        "epsilon_high": s["epsilon_high"],
        "beta": s["beta"],
        "use_bias_correction_kl": False,
        "scale_rewards": s["scale_rewards"],
        "mask_truncated_completions": False,
        "top_entropy_quantile": 1.0,
        "shuffle_dataset": False,
        "learning_rate": s["lr"],
        "weight_decay": s["weight_decay"],
        "warmup_steps": s["warmup_steps"],
        "max_grad_norm": s["max_grad_norm"],
        "bf16": cfg.precision == "bf16-mixed",
        "use_cpu": True,
        "gradient_checkpointing": False,
        "use_vllm": False,
        "use_transformers_continuous_batching": cfg.trl_generation == "continuous_batching",
        "cache_implementation": None,
        "torch_compile": False,
        "use_liger_kernel": False,
        "pad_to_multiple_of": None,
        "log_completions": False,
        "report_to": [],
        "save_strategy": "no",
        "logging_strategy": "no",
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
        "seed": cfg.seed,
    }


def same_step_check(
    cfg: BenchConfig, prompts: list[dict[str, Any]], judger: Any, **trl_overrides: Any
) -> dict[str, Any]:
    """On xtl's sampled completions of ``prompts``: TRL's rewards and old log-probabilities equal xtl's, and so does
    the GRPO loss of the first mini-batch (module docstring, step 3). ``trl_overrides`` replace TRL's settings (the
    test's mutations). Returns the compared values; raises ``AssertionError`` on a difference."""
    import torch

    from xtl.rl import GRPOModule, PolicyLossConfig, SamplingSettings
    from xtl.rl.buffer import Sample
    from xtl.rl.judger import RolloutState
    from xtl.rl.loss import group_advantages
    from xtl.rl.packing import cut_micro_batches, split_round_robin
    from xtl.rl.rollout import LocalRolloutEngine
    from xtl.train.generation import split_thinking

    s = cfg.settings
    size, stop = s["group_size"], s["stop_token_ids"]
    sampling = SamplingSettings(
        group_size=size, max_new_tokens=s["max_new_tokens"], temperature=s["temperature"], top_p=s["top_p"],
        top_k=s["top_k"], seed=cfg.seed,
    )  # fmt: skip
    objective = PolicyLossConfig(
        s["loss_type"], s["importance_sampling"], s["epsilon_low"], s["epsilon_high"], s["beta"], s["scale_rewards"]
    )
    overrides = {"fused_projections": True} if cfg.fused else None
    module = GRPOModule(cfg.hf_dir, judger, sampling, objective, model_overrides=overrides)
    module.configure_model()
    module.model.eval()  # no dropout on either side (the check's TRL model runs in eval mode too)
    trainer = trl_trainer(dataclasses.replace(cfg, cycles=0), judger, [], **trl_overrides)
    trainer.model.eval()
    tokenizer = trainer.processing_class
    # the prompts: TRL tokenizes xtl's rendered text to xtl's ids
    trl_ids = trainer._tokenize_prompts([p["prompt"] for p in prompts])[0]
    assert [list(x) for x in trl_ids] == [p["ids"] for p in prompts], "TRL tokenizes the prompts to other ids"
    # xtl samples, both judge
    with torch.no_grad():
        rollouts = LocalRolloutEngine(module.model).generate([p["ids"] for p in prompts for _ in range(size)],
                                                             sampling, stop)  # fmt: skip
    answers = [p["answer"] for p in prompts for _ in range(size)]
    texts = [split_thinking(tokenizer.decode([t for t in r.response_ids if t not in stop]))[1] for r in rollouts]
    judged = judger.judge_sync([RolloutState(t, a) for t, a in zip(texts, answers, strict=True)])
    xtl_rewards = [state.reward["score"] for state in judged]
    reward_fn = judger_reward(judger, tokenizer, set(stop))
    trl_rewards = reward_fn(texts, [r.response_ids for r in rollouts], answers)
    assert trl_rewards == xtl_rewards, "TRL's reward function (xtl's judger) scores otherwise than xtl"
    # the loss of the first mini-batch, with varied rewards (an untrained policy scores 0 everywhere)
    varied = torch.tensor([float(sum(r.response_ids) % 3) / 2 for r in rollouts], dtype=torch.float64)
    advantages = group_advantages(varied, size, objective.scale_rewards).tolist()
    samples = [Sample(r.prompt_ids, r.response_ids, r.finish_reason, reward) for r, reward in zip(rollouts, varied)]
    first = split_round_robin(list(zip(samples, advantages)), s["mini_batches"])[0]
    mb = cut_micro_batches(first, 1, s["loss_type"], s["max_new_tokens"])[0]
    with torch.no_grad():
        module._fill_logps(mb)
    inputs = trl_inputs(first, tokenizer.pad_token_id)
    with torch.no_grad():
        trl_old = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1), inputs["completion_ids"].size(1),
        )[0]  # fmt: skip
    old_diff = float(((trl_old.double() - mb.old_logps.double()) * mb.mask).abs().max())
    assert old_diff <= OLD_LOGP_TOLERANCE, f"old log-probabilities differ by {old_diff}"
    position = torch.arange(mb.mask.numel(), dtype=torch.float64).view_as(mb.mask)
    shifted = (mb.old_logps + LOGP_SHIFT * torch.sin(position)) * mb.mask  # ratios away from 1, some clipped
    mb.old_logps = shifted.float()
    forward, _ = module.step_objective()
    xtl_loss = float(forward(mb).loss_sum.detach() / mb.num_items)
    inputs["old_per_token_logps"] = mb.old_logps
    trl_loss = float(trainer.compute_loss(trainer.model, inputs).detach())
    assert abs(xtl_loss - trl_loss) <= LOSS_TOLERANCE, f"GRPO loss: xtl {xtl_loss}, TRL {trl_loss}"
    return {
        "rewards": xtl_rewards,
        "old_logp_max_diff": old_diff,
        "xtl_loss": xtl_loss,
        "trl_loss": trl_loss,
        "sequences": len(first),
        "tokens": int(mb.mask.sum()),
    }


def trl_inputs(samples: list[tuple[Any, float]], pad_id: int) -> dict[str, Any]:
    """TRL's training inputs of ``(sample, advantage)`` pairs: prompts left-padded, completions right-padded."""
    import torch
    from trl.trainer.utils import pad

    prompts = [torch.tensor(s.prompt_ids) for s, _ in samples]
    completions = [torch.tensor(s.response_ids) for s, _ in samples]
    completion_mask = pad([torch.ones_like(c) for c in completions], padding_value=0, padding_side="right")
    return {
        "prompt_ids": pad(prompts, padding_value=pad_id, padding_side="left"),
        "prompt_mask": pad([torch.ones_like(p) for p in prompts], padding_value=0, padding_side="left"),
        "completion_ids": pad(completions, padding_value=pad_id, padding_side="right"),
        "completion_mask": completion_mask,
        "advantages": torch.tensor([a for _, a in samples], dtype=torch.float32),
        "num_items_in_batch": completion_mask.sum(),
    }


# ---- runs --------------------------------------------------------------------------------------------------------


def run_xtl(cfg: BenchConfig) -> SideResult:
    """``xtl fit`` of the recipe for ``cycles + 1`` rollout batches, its stages timed."""
    child_setup(cfg.threads, uses_datasets=False)
    import lightning.pytorch as pl

    from xtl.cli import XTLCLI

    clock = StageClock()
    per_batch = cfg.settings["mini_batches"] * cfg.settings["epochs"]

    class Clock(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, module: Any) -> None:
            generate = module.engine.generate

            def counted(*args: Any, **kwargs: Any) -> Any:
                rollouts = generate(*args, **kwargs)
                clock.tokens += sum(len(r.response_ids) for r in rollouts)
                return rollouts

            module.engine.generate = counted
            clock.wrap(module.engine, "generate", "generation")
            clock.wrap(module.judger, "judge_sync", "judging")
            clock.wrap(module, "_fill_logps", "old_logps")
            clock.wrap(module, "optimizer_step_over", "update")

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step % per_batch == 0:
                clock.mark()

    root = tempfile.mkdtemp(prefix="xtl_run_", dir=cfg.work_dir)
    with contextlib.redirect_stdout(io.StringIO()):
        cli = XTLCLI(args=[*cfg.xtl_args, f"--trainer.default_root_dir={root}"], run=False)
        cli.trainer.callbacks.append(Clock())
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return clock.result("xtl")


def run_trl(cfg: BenchConfig) -> SideResult:
    """``GRPOTrainer.train`` for ``cycles + 1`` rollout batches, its stages timed."""
    child_setup(cfg.threads, uses_lightning=False)
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
    from transformers import TrainerCallback

    from xtl.rl import MathJudger

    clock = StageClock()
    per_batch = cfg.settings["mini_batches"] * cfg.settings["epochs"]

    class Clock(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, *rest: Any, **kwargs: Any) -> None:
            if state.global_step % per_batch == 0:
                clock.mark()

    trainer = trl_trainer(cfg, MathJudger(), [Clock()], clock)
    clock.wrap(trainer, "training_step", "update")
    clock.wrap(trainer, "_prepare_inputs", "other")  # inside training_step: not the update's
    clock.wrap(trainer.model, "generate", "generation")
    clock.wrap(trainer.model, "generate_batch", "generation")  # use_transformers_continuous_batching
    clock.wrap(trainer, "_calculate_rewards", "judging")
    clock.wrap(trainer, "_get_per_token_logps_and_entropies", lambda: None if torch.is_grad_enabled() else "old_logps")
    clock.wrap(trainer.accelerator, "clip_grad_norm_", "update")
    register_optimizer_step_pre_hook(lambda *_: clock.push("update"))
    register_optimizer_step_post_hook(lambda *_: clock.pop())
    with contextlib.redirect_stdout(io.StringIO()):  # the metrics line train() prints
        trainer.train()
    return clock.result("trl")


# ---- main --------------------------------------------------------------------------------------------------------


def main() -> None:
    """Parse arguments, prepare and check, run the pairs of child processes, print the comparison (``--async``:
    asynchronous against synchronous xtl, :mod:`rl_async`)."""
    if "--async" in sys.argv[1:]:
        from rl_async import main as compare_async

        compare_async([arg for arg in sys.argv[1:] if arg != "--async"])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_protocol_args(parser, pairs=5, warmup=1)
    parser.add_argument("--cycles", type=int, default=3, help="timed rollout batches per run (after one warm-up)")
    parser.add_argument("--precision", default="auto", choices=["auto", "bf16-mixed", "32-true"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--trl-generation",
        default="generate",
        choices=["generate", "continuous_batching"],
        help="TRL's generation path: model.generate, or transformers' continuous batching (generate_batch)",
    )
    parser.add_argument("--no-fused", action="store_true", help="xtl with separate q/k/v and gate/up projections")
    args = parser.parse_args()
    pin_threads(args.threads)
    precision = args.precision if args.precision != "auto" else ("bf16-mixed" if cpu_has_bf16() else "32-true")
    print(f"load average before: {load_average()}")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="xtl-rl-bench-") as tmp:
        cfg = BenchConfig(
            work_dir=tmp, threads=args.threads, precision=precision, cycles=args.cycles, seed=args.seed,
            fused=not args.no_fused, trl_generation=args.trl_generation,
        )  # fmt: skip
        info = in_child(prepare, cfg)
        cfg = info["cfg"]
        cfg.xtl_args = xtl_args(cfg, (cfg.cycles + 1) * cfg.settings["mini_batches"] * cfg.settings["epochs"])
        _print_setup(cfg, info)
        runs: dict[str, list[SideResult]] = {"xtl": [], "trl": []}

        def side(name: str, fn: Any) -> Any:
            def run() -> float:
                runs[name].append(in_child(fn, cfg))
                return runs[name][-1].median("step")

            return run

        def on_pair(i: int, a: float, b: float) -> None:
            print(f"pair {i + 1}: xtl {a * 1e3:.0f} ms/step, trl {b * 1e3:.0f} ms/step, ratio {a / b:.3f}", flush=True)

        whole = run_pairs(side("xtl", run_xtl), side("trl", run_trl), args.pairs, args.warmup, on_pair=on_pair)
    timed = {name: results[args.warmup :] for name, results in runs.items()}
    whole.metric = "seconds per GRPO step (rollout batch: generation, judging, old log-probs, 2 optimizer steps)"
    print(f"\nresults ({args.pairs} timed pairs after {args.warmup} warm-up pair(s), order alternating):")
    print(whole.summary("xtl", "trl"))
    cpu = PairedResult(
        "CPU seconds per GRPO step (process time, all threads)",
        [statistics.median(r.cpu_steps) for r in timed["xtl"]],
        [statistics.median(r.cpu_steps) for r in timed["trl"]],
    )
    print(cpu.summary("xtl", "trl"))
    print("stage split (median ms per step; ratio xtl/trl median (min..max) over the pairs):")
    print(f"  {'stage':12s} {'xtl':>9s} {'trl':>9s}   ratio")
    for key in ("step", *STAGES, "other"):
        result = PairedResult(key, [r.median(key) for r in timed["xtl"]], [r.median(key) for r in timed["trl"]])
        x, t = statistics.median(result.a), statistics.median(result.b)
        ratios = [a / b if b else float("nan") for a, b in zip(result.a, result.b)]
        print(
            f"  {key:12s} {x * 1e3:9.1f} {t * 1e3:9.1f}   {statistics.median(ratios):.3f} "
            f"({min(ratios):.3f}..{max(ratios):.3f})"
        )
    for name, results in timed.items():
        tokens = statistics.median(statistics.median(r.tokens) for r in results)
        gen = statistics.median(r.median("generation") for r in results)
        print(
            f"{name}: {tokens:.0f} completion tokens generated per step ({tokens / gen:.0f} tokens/s in generation), "
            f"{results[0].threads} thread(s)"
        )
    speedup, cpu_speedup = 1 / statistics.median(whole.ratios), 1 / statistics.median(cpu.ratios)
    verdict = "reached" if speedup >= TARGET else "NOT reached"
    print(
        f"xtl speed-up over TRL on the whole step: {speedup:.2f}x wall (target >= {TARGET}x: {verdict}), "
        f"{cpu_speedup:.2f}x in CPU time"
    )
    print(f"total {time.perf_counter() - start:.0f} s; load average after: {load_average()}")


def _print_setup(cfg: BenchConfig, info: dict[str, Any]) -> None:
    s, check = cfg.settings, info["check"]
    samples = s["prompts_per_step"] * s["group_size"]
    sampling = (
        f"{s['prompts_per_step']} prompts x {s['group_size']} completions, max {s['max_new_tokens']} new tokens, "
        f"temperature {s['temperature']}, top_p {s['top_p']}, top_k {s['top_k']}, stop {s['stop_token_ids']}"
    )
    loss = (
        f"{s['loss_type']}, {s['importance_sampling']}-level ratio clipped [{1 - s['epsilon_low']:g}, "
        f"{1 + s['epsilon_high']:g}], beta {s['beta']}, scale_rewards {s['scale_rewards']}, {s['epochs']} epoch(s)"
    )
    optimizer = (
        f"fused AdamW lr {s['lr']}, betas {tuple(s['betas'])}, eps {s['eps']}, wd {s['weight_decay']}, "
        f"{s['schedule']} after {s['warmup_steps']} warm-up steps, clip {s['max_grad_norm']}"
    )
    precision = "fp32" if cfg.precision == "32-true" else "bf16 autocast, fp32 weights"
    print(
        f"recipe {RECIPE.relative_to(ROOT)} without dynamic sampling; policy: {POLICY_RECIPE.name}'s model, seed "
        f"{cfg.seed} init, saved as HF; prompts: {info['sources']} ({info['template']} template), xtl's draw order"
    )
    print(
        f"check (asserted): TRL tokenizes xtl's rendered prompts to xtl's ids; TRL's reward function (xtl's judger) "
        f"gives xtl's rewards on xtl's {len(check['rewards'])} completions (mean "
        f"{statistics.fmean(check['rewards']):.3f}); "
        f"old log-probs max |diff| {check['old_logp_max_diff']:.1e} (<= {OLD_LOGP_TOLERANCE}); GRPO loss of a "
        f"mini-batch ({check['sequences']} sequences, {check['tokens']} completion tokens, varied rewards, old "
        f"log-probs shifted): xtl {check['xtl_loss']:.8f}, TRL {check['trl_loss']:.8f} (<= {LOSS_TOLERANCE})"
    )
    print(f"{cfg.cycles} timed rollout batches per run after 1 warm-up, {cfg.threads} thread(s) per child")
    trl = trl_settings(cfg, samples, "<tmp>")
    print_configs(
        xtl={
            "runs": "xtl fit " + " ".join(a for a in cfg.xtl_args if "root_dir" not in a and "cache_dir" not in a),
            "sampling": sampling,
            "engine": "local: xtl.train.generation.generate on the policy (packed prefill, KV cache), one batch",
            "update": f"{s['mini_batches']} mini-batches = optimizer steps per rollout batch, {s['micro_batches']} "
            "micro-batch(es) each, packed sequences (no padding); old log-probs once per rollout batch: the first "
            "update's from its own forward (detached), the second's by a forward at rollout time",
            "loss": loss,
            "precision": precision,
            "projections": "q/k/v and gate/up fused [xtl-only]" if cfg.fused else "separate (as TRL)",
            "optimizer": optimizer,
            "logging": "every step (recipe's CSVLogger)",
            "gradient_checkpointing": "off",
        },
        trl={
            "runs": "trl.GRPOTrainer " + ", ".join(f"{k}={v}" for k, v in trl.items() if k != "output_dir"),
            "sampling": sampling + " (xtl's stop tokens as eos_token_id)",
            "generation": "model.generate (padded batch, dynamic KV cache)"
            if cfg.trl_generation == "generate"
            else "transformers continuous batching (generate_batch, paged KV cache)",
            "update": "per_device_train_batch_size = half the rollout batch, padded; old log-probs once per rollout "
            "batch (steps_per_generation=2); TRL's fused LM head (log-probs + entropy)",
            "loss": loss + " (use_bias_correction_kl=False)",
            "precision": precision,
            "optimizer": optimizer + " (passed as optimizers=)",
            "reward": "xtl's MathJudger via a reward function (same decoding)",
        },
    )


if __name__ == "__main__":
    main()
