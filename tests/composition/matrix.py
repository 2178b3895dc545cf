"""The composition matrix: every model family x optional feature x parallel strategy, and what each cell must do.

A cell is ``xtl fit`` of a tiny recipe of the family, with the feature's fragment(s) and the strategy's settings, for
two optimizer steps. It either trains with finite losses and keeps the exactness claim the feature makes (compared
with the plain run of the same family and strategy), or it is refused at startup with a ``UserError`` whose message
contains the text in :data:`REFUSED`. ``docs/configs.md`` shows :func:`render_markdown` of this list
(``python -m tests.composition.matrix`` rewrites it).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2

_TEXT = dict(
    vocab_size=1600, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, max_position_embeddings=512, tie_word_embeddings=True, attn_impl="sdpa",
)  # fmt: skip
_VISION = dict(
    depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=8, spatial_merge_size=2,
    temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=64, deepstack_visual_indexes=[1],
)  # fmt: skip
_VL_TOKENS = dict(image_token_id=1544, vision_start_token_id=1542, vision_end_token_id=1543, video_token_id=1545)
_IMAGE_SOURCES = (
    ("{path: tiny:preference_train.jsonl, kind: preference}",
     "{path: 'tiny:../tiny_vlm/preference_train.jsonl', kind: preference}"),
    ("{path: tiny:preference_train.jsonl, kind: preference, sample_ratio: 0.01}",
     "{path: 'tiny:../tiny_vlm/preference_train.jsonl', kind: preference, sample_ratio: 0.1}"),
    ("{path: tiny:kto_train.jsonl, kind: unpaired_preference}",
     "{path: 'tiny:../tiny_vlm/kto_train.jsonl', kind: unpaired_preference}"),
    ("{path: tiny:sft_train.jsonl, kind: prompt}", "{path: 'tiny:../tiny_vlm/train.jsonl', kind: prompt}"),
    ("{path: tiny:sft_train.jsonl, kind: chat, streaming: true}",
     "{path: 'tiny:../tiny_vlm/train.jsonl', kind: chat, streaming: true}"),
)  # fmt: skip
_MROPE = {
    "rope_type": "default", "rope_theta": 10000.0, "params": {"mrope_section": [16, 8, 8], "mrope_interleaved": True}
}  # fmt: skip


@dataclass(frozen=True)
class Family:
    """A model family of the matrix: its tiny recipe, LightningModule and model fields.

    Attributes:
        name: Matrix label.
        recipe: The tiny recipe under ``configs/`` the cell starts from.
        model: ``model.init_args.model`` (replaces the recipe's).
        moe: Has routed experts (gets the expert-parallel strategy).
        what: Description for the docs.
        sources: The family's own data for a feature's source (``{source in the feature's YAML: replacement}``;
            a vision-language family trains its preference, unpaired and prompt features on rows with images).
    """

    name: str
    recipe: str
    model: dict
    moe: bool
    what: str
    sources: tuple[tuple[str, str], ...] = ()


FAMILIES = (
    Family("dense", "tiny_sft.yaml", {"model_type": "qwen3", **_TEXT}, False, "Qwen3"),
    Family(
        "moe",
        "tiny_moe_sft.yaml",
        {"model_type": "qwen3_moe", **_TEXT, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16},
        True,
        "Qwen3-MoE",
    ),
    Family(
        "mla",
        "tiny_moe_sft.yaml",
        {
            "model_type": "deepseek_v3",
            **_TEXT,
            "num_key_value_heads": 4,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "n_group": 2,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "n_shared_experts": 1,
            "kv_lora_rank": 16,
            "q_lora_rank": 32,
            "qk_rope_head_dim": 16,
            "qk_nope_head_dim": 16,
            "v_head_dim": 16,
        },  # fmt: skip
        True,
        "DeepSeek-V3: MLA, aux-free router",
    ),
    Family(
        "sinks",
        "tiny_moe_sft.yaml",
        {"model_type": "gpt_oss", **_TEXT, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 4},
        True,
        "GPT-OSS: attention sinks, sliding window",
    ),
    Family(
        "vlm",
        "tiny_vlm_sft.yaml",
        {
            "model_type": "qwen3_vl",
            "tie_word_embeddings": True,
            **_VL_TOKENS,
            "text_config": {**_TEXT, "rope": _MROPE},
            "vision_config": _VISION,
        },  # fmt: skip
        False,
        "Qwen3-VL",
        _IMAGE_SOURCES,
    ),
    Family(
        "vlm_moe",
        "tiny_vlm_sft.yaml",
        {
            "model_type": "qwen3_vl_moe",
            "tie_word_embeddings": True,
            **_VL_TOKENS,
            "vision_config": _VISION,
            "text_config": {
                **_TEXT,
                "rope": _MROPE,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 16,
            },
        },  # fmt: skip
        True,
        "Qwen3-VL-MoE",
        _IMAGE_SOURCES,
    ),
)


@dataclass(frozen=True)
class Feature:
    """An optional feature: the fragments that switch it on and the claim its cells are held to.

    Attributes:
        name: Matrix label.
        fragments: Fragment files under ``callbacks/`` (in order).
        inline: Extra YAML appended after them (a setting the shipped fragment leaves at another value).
        claim: ``bitwise``: every step's loss equals the plain run's; ``first_step``: the first loss equals the
            plain run's (the feature changes the update, not the initial model); ``close``: the first loss is
            within :data:`CLOSE_RTOL` of the plain run's (the feature changes the numerics); ``objective``: another
            training objective, held to its own first-step value (the policy is its reference: DPO ``log 2``,
            KTO 0.5).
        what: Description for the docs.
        strategies: The strategies whose cells run it (``None``: every one); the others show "not run".
    """

    name: str
    fragments: tuple[str, ...]
    inline: str
    claim: str
    what: str
    strategies: tuple[str, ...] | None = None


CLOSE_RTOL = 0.05

FEATURES = (
    Feature("plain", (), "", "bitwise", "no fragment (the reference of its row)"),
    Feature("checkpointing", ("activation_checkpointing.yaml",), "", "bitwise", "activation checkpointing, full"),
    Feature(
        "checkpointing_selective",
        (),
        "trainer:\n  callbacks+:\n    - class_path: xtl.callbacks.ActivationCheckpointing\n"
        "      init_args: {mode: selective}\n",
        "bitwise",
        "activation checkpointing, selective",
    ),
    Feature("offload", ("activation_offload.yaml",), "", "bitwise", "activation offload"),
    Feature(
        "compile",
        (),
        "trainer:\n  callbacks+:\n    - class_path: xtl.callbacks.Compile\n      init_args: {backend: aot_eager}\n",
        "first_step",
        "compile (`aot_eager` here; the fragment's `inductor` on GPUs)",
    ),
    Feature(
        "compile_model",
        (),
        "trainer:\n  callbacks+:\n    - class_path: xtl.callbacks.Compile\n"
        "      init_args: {backend: aot_eager, scope: model}\n",
        "first_step",
        "compile of the whole training forward (`scope: model`, `aot_eager` here; under FSDP each layer call is its "
        "own frame between FSDP's hooks)",
    ),
    Feature(
        "fp8",
        (),
        "trainer:\n  callbacks+:\n    - class_path: xtl.callbacks.FP8Training\n"
        "      init_args: {recipe: tensorwise, emulate: true}\n",
        "close",
        "fp8 tensorwise (`emulate: true` here: this CPU's `_scaled_mm` is a reference kernel ~100x slower; "
        "`tests/callbacks/test_fp8.py` runs the kernel and `callbacks/fp8.yaml`)",
    ),
    Feature("lora", ("lora.yaml",), "", "first_step", "LoRA"),
    Feature("qlora", ("lora.yaml", "qlora.yaml"), "", "close", "QLoRA (NF4 base)"),
    Feature("parity_check", ("parity_check.yaml",), "", "bitwise", "runtime HF parity check"),
    Feature("throughput", ("throughput.yaml",), "", "bitwise", "throughput / MFU logging"),
    Feature("hf_export", ("hf_export.yaml",), "", "bitwise", "HF export at the end"),
    Feature(
        "muon",
        ("muon.yaml",),
        "",
        "first_step",
        "Muon on the hidden matrices (each HF matrix on its own: a routed expert's gate and up apart where the "
        "checkpoint keeps them apart), AdamW on the rest; `match_rms_adamw` at the recipe's learning rate",
    ),
    Feature(
        "lm_eval",
        (),
        "trainer:\n  callbacks+:\n    - class_path: xtl.callbacks.LMEval\n      init_args: {tasks: [tiny_choice, "
        "tiny_exact], every_n_steps: 2, limit: 3, batch_size: 4, max_gen_toks: 4, apply_chat_template: true}\n",
        "bitwise",
        "lm-evaluation-harness on the model in training (`callbacks/lm_eval.yaml`'s shipped tiny tasks, fewer "
        "documents): every rank scores its share of the requests",
    ),
    Feature(
        "dpo",
        (),
        "model:\n  class_path: xtl.train.PreferenceModule\n  init_args:\n"
        "    objective: {loss_type: sigmoid, beta: 0.1}\n"
        "data:\n  sources: [{path: tiny:preference_train.jsonl, kind: preference}]\n",
        "objective",
        "preference optimization (DPO, live reference sharded like the policy) on the tiny preference pairs",
    ),
    Feature(
        "dpo_precomputed",
        (),
        "model:\n  class_path: xtl.train.PreferenceModule\n  init_args:\n"
        "    objective: {loss_type: sigmoid, beta: 0.1}\n    reference: precomputed\n"
        "data:\n  sources: [{path: tiny:preference_train.jsonl, kind: preference, sample_ratio: 0.01}]\n",
        "objective",
        "DPO with the reference's log-probabilities precomputed before the first step (one pass sharded like the "
        "data, here over 60 of the tiny pairs; under CP each rank scores its share of every pack)",
    ),
    Feature(
        "dpo_synced",
        (),
        "model:\n  class_path: xtl.train.PreferenceModule\n  init_args:\n"
        "    objective: {loss_type: sigmoid, beta: 0.1}\n    reference: {mode: live, sync_every: 1}\n"
        "data:\n  sources: [{path: tiny:preference_train.jsonl, kind: preference}]\n",
        "objective",
        "DPO whose frozen reference copy moves towards the policy after every step (TR-DPO, `sync_every: 1`)",
        ("single", "fsdp", "ep"),
    ),
    Feature(
        "kto",
        (),
        "model:\n  class_path: xtl.train.PreferenceModule\n  init_args:\n"
        "    objective: {loss_type: kto, beta: 0.1}\n"
        "data:\n  sources: [{path: tiny:kto_train.jsonl, kind: unpaired_preference}]\n",
        "objective",
        "KTO (live reference) on the tiny unpaired rows (labels carried by the packs)",
    ),
    Feature(
        "grpo",
        (),
        "model:\n  class_path: xtl.rl.GRPOModule\n  init_args:\n"
        "    judger: {class_path: xtl.rl.FormatJudger, init_args: {pattern: '(..)*'}}\n"
        "    sampling: {group_size: 4, max_new_tokens: 6}\n"
        "    rollout: {prompts_per_step: 2, dynamic_sampling: true, oversample: 1.5, max_rounds: 2}\n"
        "data:\n  sources: [{path: tiny:sft_train.jsonl, kind: prompt}]\n",
        "objective",
        "GRPO with dynamic sampling: rollouts from the policy (xtl's cached sampler; ranks draw and decode in "
        "step), a format judger (an even number of characters), the tiny prompts",
    ),
    Feature(
        "grpo_tools",
        (),
        "model:\n  class_path: xtl.rl.GRPOModule\n  init_args:\n"
        "    judger: {class_path: xtl.rl.FormatJudger, init_args: {pattern: '(..)*'}}\n"
        "    sampling: {group_size: 4, max_new_tokens: 6}\n"
        "    rollout: {prompts_per_step: 2}\n"
        "    agent: {class_path: xtl.rl.agent.ToolLoop, init_args: {tools: [xtl.agent_tools.calculator], "
        "max_turns: 2}}\n"
        "data:\n  sources: [{path: tiny:sft_train.jsonl, kind: prompt}]\n",
        "objective",
        "GRPO through the multi-turn tool loop (`callbacks/agent_tools.yaml`: the calculator, 2 turns): the tools "
        "rendered by the template, each turn one lockstep engine call of every unfinished trajectory",
    ),
    Feature(
        "grpo_partial",
        ("rollout_trace.yaml",),
        "model:\n  class_path: xtl.rl.GRPOModule\n  init_args:\n"
        "    judger: {class_path: xtl.rl.FormatJudger, init_args: {pattern: '(..)*'}}\n"
        "    sampling: {group_size: 4, max_new_tokens: 6}\n"
        "    rollout: {prompts_per_step: 2, partial_tokens: 3, max_resumes: 1}\n"
        "data:\n  sources: [{path: tiny:sft_train.jsonl, kind: prompt}]\n",
        "objective",
        "GRPO with partial rollouts (3-token rounds of 6-token completions: unfinished groups continue in the next "
        "batch) and the rollout trace (`callbacks/rollout_trace.yaml`: spans and the page)",
    ),
    Feature(
        "online_dpo",
        (),
        "model:\n  class_path: xtl.rl.OnlineDPOModule\n  init_args:\n"
        "    judger: {class_path: xtl.rl.FormatJudger, init_args: {pattern: '(..)*'}}\n"
        "    sampling: {group_size: 2, max_new_tokens: 6}\n"
        "    rollout: {prompts_per_step: 2}\n"
        "    objective: {beta: 0.1, loss_type: sigmoid}\n"
        "data:\n  sources: [{path: tiny:sft_train.jsonl, kind: prompt}]\n",
        "objective",
        "online DPO: two completions per prompt from the policy, ranked by a format judger into a pair, DPO loss "
        "against the live reference (TRL's `OnlineDPOTrainer`)",
    ),
    Feature(
        "reward",
        (),
        "model:\n  class_path: xtl.train.RewardModule\n  init_args:\n"
        "    objective: {center_rewards_coefficient: 0.01}\n"
        "data:\n  sources: [{path: tiny:preference_train.jsonl, kind: preference}]\n",
        "objective",
        "reward modelling (Bradley-Terry with the centering term, a new scalar head read at each document's last "
        "token) on the tiny preference pairs",
    ),
    Feature(
        "distill",
        (),
        "model:\n  class_path: xtl.train.DistillModule\n  init_args:\n"
        f"    teacher: {json.dumps({'model_type': 'qwen3', **_TEXT, 'num_hidden_layers': 3})}\n"
        "    lmbda: 1.0\n    beta: 0.5\n    sampling: {max_new_tokens: 6}\n"
        "data:\n  sources: [{path: tiny:sft_train.jsonl, kind: chat}]\n",
        "objective",
        "on-policy distillation (GKD, generalized JSD with beta 0.5; every step on the student's own completions) "
        "towards a frozen 3-layer Qwen3 teacher built and sharded like a reference model",
    ),
    Feature(
        "fused",
        (),
        "model:\n  init_args:\n    model_overrides: {fused_projections: true}\n",
        "close",
        "fused projections: one q/k/v and one gate/up matmul (`model_overrides: {fused_projections: true}`; MLA "
        "fuses its gated MLPs only, GPT-OSS its attention only); under CP the fused q/k/v output is split by heads "
        "like the separate ones",
    ),
    Feature(
        "fused_muon",
        ("muon.yaml",),
        "model:\n  init_args:\n    model_overrides: {fused_projections: true}\n",
        "close",
        "fused projections trained with Muon (each fused weight orthogonalized per HF matrix: q, k, v, gate, up)",
    ),
    Feature(
        "mtp",
        (),
        "model:\n  init_args:\n    model_overrides: {mtp_layers: 1}\n",
        "first_step",
        "multi-token prediction, 1 depth (`model_overrides: {mtp_layers: 1}`; `train/loss` stays the next-token "
        "loss, logged with `train/mtp_loss_1`)",
    ),
    Feature(
        "streaming",
        (),
        "data:\n  sources: [{path: tiny:sft_train.jsonl, kind: chat, streaming: true}]\n  stream_window: 512\n"
        "  tokenize_workers: 0\n",
        "close",
        "streaming training data (`streaming: true`): rows read from this rank's share and tokenized as they are "
        "needed, packed best-fit within 512-row windows (here in the training process: `tokenize_workers: 0`)",
    ),
    Feature(
        "remote_checkpoint",
        (),
        "trainer:\n  callbacks+:\n    - class_path: xtl.callbacks.TrainingCheckpoint\n      init_args: {dirpath: "
        "'file://{run_dir}/remote', save_last: true, every_n_train_steps: 1, save_top_k: -1, keep_last: 1}\n",
        "bitwise",
        "checkpoints to an fsspec URL (`file://` in another folder here): staged, uploaded, committed by a manifest "
        "written last, the staging copy removed; retention `keep_last: 1`",
    ),
)


@dataclass(frozen=True)
class Strategy:
    """A parallel layout of the matrix.

    Attributes:
        name: Matrix label.
        world_size: Processes.
        yaml: The trainer settings.
        moe_only: Only for families with routed experts.
        what: Description for the docs.
    """

    name: str
    world_size: int
    yaml: str
    moe_only: bool
    what: str


_FSDP = (
    "trainer:\n  devices: 2\n  precision: 32-true\n  strategy:\n    class_path: xtl.strategies.FSDPStrategy\n"
    "    init_args:\n      param_dtype: bfloat16\n      reduce_dtype: float32\n      process_group_backend: gloo\n"
)
STRATEGIES = (
    Strategy("single", 1, "trainer:\n  devices: 1\n  precision: bf16-mixed\n", False, "one process, `bf16-mixed`"),
    Strategy(
        "fsdp", 2, _FSDP, False, "FSDP2 on 2 ranks, `param_dtype: bfloat16`, `reduce_dtype: float32` (the GPU recipes)"
    ),
    Strategy("ep", 2, _FSDP + "      expert_parallel_size: 2\n", True, "FSDP2 + expert parallelism 2 (MoE families)"),
    Strategy(
        "cp",
        2,
        _FSDP + "      context_parallel_size: 2\n",
        False,
        "FSDP2 + context parallelism 2 (one packed sequence over both ranks, Ulysses attention)",
    ),
)


@dataclass(frozen=True)
class Refused:
    """Why a combination is refused at startup, and whether that can change.

    Attributes:
        text: A text the startup refusal (the ``xtl: error:`` line) must contain.
        permanent: ``True``: a limit of the combination itself (it cannot work, see ``why``); ``False``: planned,
            it could work and is not built yet.
        why: The reason, for the docs.
    """

    text: str
    permanent: bool
    why: str


_NO_MTP = Refused(
    "mtp_layers is a setting of deepseek_v3 models only",
    True,
    "the family's Hugging Face architecture has no multi-token-prediction modules to load, train or export",
)
_VLM_DISTILL = Refused(
    "DistillModule trains text models",
    False,
    "the student's rollouts and the teacher's scoring take text prompts only; image prompts are not wired in yet",
)
_VLM_REWARD = Refused(
    "RewardModule trains text models",
    True,
    "transformers has no sequence-classification class for Qwen3-VL, so the trained reward model could not be "
    "loaded by anything but xtl",
)
_VLM_STREAMING = Refused(
    "streaming rows with images is not supported",
    False,
    "images are read through the cache's image index, which a stream does not build; image data is cached",
)
# (family, feature, strategy; each may be "*") -> the refusal (the first match)
REFUSED: dict[tuple[str, str, str], Refused] = {
    # the strategy refuses what does not run under context parallelism before any callback's own setup
    ("*", "parity_check", "cp"): Refused(
        "HFParityCheck runs whole documents on each process",
        True,
        "transformers runs each whole document on one process, which is what context parallelism exists to avoid; "
        "check the same model on one device or under FSDP",
    ),
    ("vlm", "reward", "*"): _VLM_REWARD,
    ("vlm_moe", "reward", "*"): _VLM_REWARD,
    ("vlm", "distill", "*"): _VLM_DISTILL,
    ("vlm_moe", "distill", "*"): _VLM_DISTILL,
    ("*", "distill", "cp"): Refused(
        "DistillModule samples whole completions and scores them with the teacher",
        False,
        "the teacher's scoring pass is not split over context-parallel shares yet",
    ),
    **{(f, "mtp", "*"): _NO_MTP for f in ("dense", "moe", "sinks", "vlm", "vlm_moe")},
    **{(f, "streaming", "*"): _VLM_STREAMING for f in ("vlm", "vlm_moe")},
}


@dataclass(frozen=True)
class Cell:
    """One family x feature x strategy run."""

    family: Family
    feature: Feature
    strategy: Strategy

    @property
    def id(self) -> str:
        """``family-feature-strategy``."""
        return f"{self.family.name}-{self.feature.name}-{self.strategy.name}"

    @property
    def refused(self) -> Refused | None:
        """The refusal, or ``None`` when the cell must train."""
        for (family, feature, strategy), refused in REFUSED.items():
            if feature in ("*", self.feature.name) and family in ("*", self.family.name):
                if strategy in ("*", self.strategy.name):
                    return refused
        return None

    @property
    def refusal(self) -> str | None:
        """The text the refusal must contain, or ``None`` when the cell must train."""
        return None if self.refused is None else self.refused.text

    def configs(self, config_dir: Path, run_dir: Path) -> list[str]:
        """``--config`` arguments: the recipe, the cell's model and trainer settings (written to ``config_dir``,
        outputs under ``run_dir``), then the feature's fragments."""
        family, feature = self.family, self.feature
        base = config_dir / f"{self.id}.yaml"
        base.write_text(
            self.strategy.yaml
            + "  callbacks: []\n  val_check_interval: null\n  enable_progress_bar: false\n"
            + f"  max_steps: {STEPS}\n  default_root_dir: {run_dir}\n"
            + "data:\n  val_sources: null\n  test_sources: null\n  predict_source: null\n  pack_max_length: 128\n"
            + f"model:\n  class_path: xtl.train.LanguageModule\n  init_args:\n    model: {_flow(family.model)}\n"
        )
        configs = ["--config", str(ROOT / "configs" / family.recipe), "--config", str(base)]
        for name in feature.fragments:
            configs += ["--config", str(ROOT / "callbacks" / name)]
        if feature.inline:
            inline = config_dir / f"{self.id}.feature.yaml"
            text = feature.inline
            for source, replacement in family.sources:
                text = text.replace(source, replacement)
            text = text.replace("{run_dir}", str(run_dir))
            inline.write_text(text)
            configs += ["--config", str(inline)]
        return configs


# The GPU recipes' own trainer, strategy and callback settings on 2 CPU ranks, with a tiny model and data.
GPU_RECIPES = (
    "qwen3_0.6b_sft.yaml",
    "llama3.1_8b_sft.yaml",
    "qwen3_8b_pretrain.yaml",
    "qwen3_30b_a3b_sft.yaml",
    "qwen3_8b_long_context.yaml",
)
RECIPE_STEPS = 3


def recipe_runs(config_dir: Path, work: Path) -> dict[str, tuple[list[str], str]]:
    """``recipe-<name> -> (--config arguments, root folder)`` of each GPU recipe with CPU-sized overrides: the
    accelerator, 2 devices (EP 2 where the recipe sets EP, CP 2 where it sets CP), a CSV logger, tiny model,
    tokenizer and data."""
    runs = {}
    for recipe in GPU_RECIPES:
        name = f"recipe-{recipe.removesuffix('.yaml')}"
        text = (ROOT / "configs" / recipe).read_text()
        moe = "expert_parallel_size" in text
        model = {"model_type": "qwen3_moe", **_TEXT, "num_experts": 4, "num_experts_per_tok": 2,
                 "moe_intermediate_size": 16} if moe else {"model_type": "qwen3", **_TEXT}  # fmt: skip
        source = {"path": "tiny:pretrain.jsonl", "kind": "text"} if "kind: text" in text else {
            "path": "tiny:sft_train.jsonl", "kind": "chat"}  # fmt: skip
        strategy = "{process_group_backend: gloo" + (", expert_parallel_size: 2" if moe else "")
        strategy += ", context_parallel_size: 2}" if "context_parallel_size" in text else "}"
        override = config_dir / f"{name}.yaml"
        override.write_text(
            f"trainer:\n  accelerator: cpu\n  devices: 2\n  max_steps: {RECIPE_STEPS}\n  val_check_interval: null\n"
            f"  enable_progress_bar: false\n  default_root_dir: {work / name}\n"
            "  logger:\n    - class_path: lightning.pytorch.loggers.CSVLogger\n"
            "      init_args: {save_dir: ., name: logs}\n"
            f"  strategy:\n    init_args: {strategy}\n"
            f"model:\n  init_args:\n    model: {_flow(model)}\n"
            f"data:\n  sources: [{_flow(source)}]\n  tokenizer: 'tiny:'\n  pack_max_length: 128\n  num_workers: 0\n"
            + (
                "  template: qwen3\n" if "template:" in text else ""
            )  # the tiny tokenizer's (llama3's needs its tokens)
        )
        runs[name] = (["--config", str(ROOT / "configs" / recipe), "--config", str(override)], str(work / name))
    return runs


def cells(strategy: str | None = None) -> list[Cell]:
    """Every cell of the matrix (of one strategy), in row order."""
    return [
        Cell(family, feature, s)
        for s in STRATEGIES
        if strategy in (None, s.name)
        for family in FAMILIES
        if family.moe or not s.moe_only
        for feature in FEATURES
        if feature.strategies is None or s.name in feature.strategies
    ]


def render_markdown() -> str:
    """The matrix as the Markdown table of ``docs/configs.md``: one row per family and strategy."""
    lines = [
        "| family | strategy | " + " | ".join(f.name for f in FEATURES[1:]) + " |",
        "|---|---|" + "---|" * (len(FEATURES) - 1),
    ]
    notes: dict[Refused, int] = {}
    for strategy in STRATEGIES:
        for family in FAMILIES:
            if strategy.moe_only and not family.moe:
                continue
            marks = []
            for feature in FEATURES[1:]:
                refused = Cell(family, feature, strategy).refused
                if feature.strategies is not None and strategy.name not in feature.strategies:
                    marks.append("not run")
                elif refused is None:
                    marks.append("trains")
                else:
                    number = notes.setdefault(refused, len(notes) + 1)
                    marks.append(f"{'limit' if refused.permanent else 'planned'} ({number})")
            lines.append(f"| {family.name} | {strategy.name} | " + " | ".join(marks) + " |")
    lines.append("")
    lines += [
        f'({n}) refused at startup: "{r.text}...". {"Permanent limit" if r.permanent else "Planned"}: {r.why}.'
        for r, n in notes.items()
    ]
    lines.append("")
    lines += [f"- **{f.name}**: {f.what}." for f in FAMILIES]
    lines.append(
        "- The vision-language families train the preference, unpaired and prompt features (DPO, KTO, GRPO, online "
        "DPO) on rows with images (`xtl/assets/tiny_vlm`: pairs, KTO rows and prompts about the shape images)."
    )
    lines += [f"- **{f.name}**: {f.what}; claim `{f.claim}`." for f in FEATURES[1:]]
    lines += [f"- **{s.name}**: {s.what}." for s in STRATEGIES]
    return "\n".join(lines) + "\n"


def _flow(value: object) -> str:
    """``value`` as one line of YAML flow style (JSON is valid YAML)."""
    return json.dumps(value)


if __name__ == "__main__":
    docs = ROOT / "docs" / "configs.md"
    text = docs.read_text()
    begin, end = "<!-- composition matrix: begin -->\n", "<!-- composition matrix: end -->\n"
    head, rest = text.split(begin)
    _, tail = rest.split(end)
    docs.write_text(head + begin + render_markdown() + end + tail)
    sys.exit(0)
