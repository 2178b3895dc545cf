"""The reward-model judger: scores equal to transformers' forward of each sequence alone (whatever the batch pads),
the rendering of the reward model's training pairs, xtl's own reward of an export, composition with rule judgers,
failures that cost their batch only, pickling without the model (Ray actors), refusals, and a GRPO fit from YAML."""

from __future__ import annotations

import json
import pickle
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import ray
import torch
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    LlamaConfig,
    LlamaForSequenceClassification,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3ForSequenceClassification,
)

from tests.inprocess import run_fit
from tests.rl.test_module import MODEL as POLICY
from tests.seeded_model import save_seeded_model
from xtl.data import Pack, collate_pack
from xtl.data.preference import PreferenceTokenizeFn
from xtl.errors import ConfigError
from xtl.rl import ComposedJudger, MathJudger, RewardModelJudger, RolloutState
from xtl.rl.judger import FAILED
from xtl.rl.remote import RayJudger
from xtl.train import RewardModule
from xtl.utils import TINY_ASSETS_DIR

ROOT = Path(__file__).resolve().parents[2]
ATOL = 1e-5  # fp32: a padded batch against each sequence alone (sdpa with and without a mask)
PAD = 0
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
_COMMON = dict(
    vocab_size=1600, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=256, initializer_range=0.1,
)  # fmt: skip
FAMILIES = {
    "qwen3": (Qwen3Config, Qwen3ForSequenceClassification),
    "llama": (LlamaConfig, LlamaForSequenceClassification),
}
SYSTEM = {"role": "system", "content": "You are a precise assistant. Answer with the result only."}
# (prompt, response): a text prompt, messages, and prompts of very different lengths in one batch
STATES = [
    ("What is 1+6?", "7"),
    ([SYSTEM, {"role": "user", "content": "What is 1+9?"}], "19"),
    ([{"role": "user", "content": "Uppercase: summer thunder and a long tail of words to pad the others"}], "SUMMER"),
    ([{"role": "user", "content": "How many words: valley pencil"}], "2 words, as counted one by one"),
]


def _save(model: torch.nn.Module, path: Path) -> Path:
    """``model`` saved with the tiny tokenizer beside it (as ``HFExport`` copies the run's tokenizer)."""
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(TINY_ASSETS_DIR / name, path)
    return path


def _edit_config(source: Path, target: Path, **changes) -> Path:
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config.update(changes)
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.fixture(scope="module")
def reward_models(tmp_path_factory) -> dict[str, Path]:
    """A tiny random reward model (one label, pad token 0) of each family, saved by transformers, tokenizer beside."""
    root = tmp_path_factory.mktemp("reward_models")
    paths = {}
    for family, (config_cls, model_cls) in FAMILIES.items():
        torch.manual_seed(0)
        config = config_cls(**_COMMON, num_labels=1, pad_token_id=PAD, attn_implementation="sdpa")
        paths[family] = _save(model_cls(config), root / family)
    return paths


def _states(pairs=STATES, source: str = "default") -> list[RolloutState]:
    return [RolloutState(response, "7", source, prompt) for prompt, response in pairs]


def _alone(path: Path, sequences: list[list[int]]) -> list[float]:
    """transformers' score of each sequence on its own (no padding)."""
    model = AutoModelForSequenceClassification.from_pretrained(path, attn_implementation="sdpa").eval()
    with torch.no_grad():
        return [model(input_ids=torch.tensor([seq])).logits[0, 0].item() for seq in sequences]


class TestScores:
    @pytest.mark.parametrize("family", sorted(FAMILIES))
    def test_a_padded_batch_scores_each_sequence_as_transformers_alone(self, reward_models, family):
        judger = RewardModelJudger(str(reward_models[family]), batch_size=len(STATES))
        states = judger.judge_sync(_states())
        sequences = judger.input_ids([judger.preprocess(s) for s in states])
        assert len({len(seq) for seq in sequences}) == len(STATES), "different lengths: the batch pads"
        want = _alone(reward_models[family], sequences)
        got = [s.reward["score"] for s in states]
        np.testing.assert_allclose(got, want, rtol=0, atol=ATOL)
        assert np.ptp(want) > 1e-3, "not vacuous: the sequences score differently"
        assert [s.reward["raw_score"] for s in states] == got and all(s.status == "completed" for s in states)

    def test_batches_of_any_size_score_the_same(self, reward_models):
        path = str(reward_models["qwen3"])
        scores = [
            [s.reward["score"] for s in RewardModelJudger(path, batch_size=size).judge_sync(_states())]
            for size in (1, 3, 4)
        ]
        np.testing.assert_allclose(scores[1], scores[0], rtol=0, atol=ATOL)
        np.testing.assert_allclose(scores[2], scores[0], rtol=0, atol=ATOL)

    def test_scale_and_offset(self, reward_models):
        judger = RewardModelJudger(str(reward_models["qwen3"]), scale=0.5, offset=2.0)
        for state in judger.judge_sync(_states()):
            assert state.reward["score"] == pytest.approx(0.5 * state.reward["raw_score"] + 2.0, abs=1e-12)

    def test_an_xtl_reward_export_scores_as_xtl_scores_its_pairs(self, tmp_path):
        """A RewardModule's model, saved as ``HFExport`` saves it: the judger's score of each side of a preference
        row equals the reward xtl's training forward gives the packed pair."""
        model = {**POLICY, "max_position_embeddings": 256, "initializer_range": 0.1}
        module = RewardModule(model, seed=3)
        module._trainer = SimpleNamespace(callbacks=[], strategy=None, global_step=0, ckpt_path=None)
        module.configure_model()
        module._trainer = None
        module.model.save_hf(tmp_path, token_ids={"pad_token_id": PAD})
        for name in TOKENIZER_FILES:
            shutil.copy(TINY_ASSETS_DIR / name, tmp_path)
        rows = [json.loads(line) for line in (TINY_ASSETS_DIR / "preference_eval.jsonl").read_text().splitlines()]
        rows = rows[:4]
        judger = RewardModelJudger(str(tmp_path), batch_size=8)
        encoder = PreferenceTokenizeFn(AutoTokenizer.from_pretrained(tmp_path), "qwen3")
        docs = [arrays[0] for pair in encoder.batch_arrays(rows, str) for arrays in pair]
        ids = np.concatenate(docs)
        mb = collate_pack(Pack(0, ids, ids.copy(), [len(d) for d in docs]), pad_token_id=PAD)
        with torch.no_grad():
            chosen, rejected, _ = module.pair_rewards(mb)
        states = [
            RolloutState(row[side][0]["content"], None, prompt=row["prompt"])
            for row in rows
            for side in ("chosen", "rejected")
        ]
        got = [s.reward["score"] for s in judger.judge_sync(states)]
        want = torch.stack([chosen, rejected], dim=1).flatten().tolist()
        np.testing.assert_allclose(got, want, rtol=0, atol=ATOL)


class TestRendering:
    """The judger's token ids are the ids the reward model was trained on (PreferenceTokenizeFn's chosen side)."""

    @pytest.mark.parametrize(
        "row",
        [
            {"prompt": "What is 2+3?", "chosen": "5", "rejected": "23"},
            {"prompt": [SYSTEM, {"role": "user", "content": "What is 2+3?"}], "chosen": [
                {"role": "assistant", "content": "5"}], "rejected": [{"role": "assistant", "content": "23"}]},
            {"prompt": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                        {"role": "user", "content": "What is 2+3?"}],
             "chosen": [{"role": "assistant", "content": "<think>\nadd\n</think>\n\n5"}],
             "rejected": [{"role": "assistant", "content": "23"}]},
        ],
        ids=["text_prompt", "messages", "earlier_turns_and_reasoning"],
    )  # fmt: skip
    def test_a_prompt_and_response_render_as_the_chosen_side(self, reward_models, row):
        judger = RewardModelJudger(str(reward_models["qwen3"]))
        encoder = PreferenceTokenizeFn(AutoTokenizer.from_pretrained(TINY_ASSETS_DIR))
        ((chosen, _), _) = encoder.batch_arrays([row], str)[0]
        response = row["chosen"] if isinstance(row["chosen"], str) else row["chosen"][0]["content"]
        (ids,) = judger.input_ids([judger.preprocess(RolloutState(response, None, prompt=row["prompt"]))])
        assert ids == chosen.tolist()

    def test_a_multi_turn_rollout_scores_its_whole_conversation(self, reward_models):
        conversation = [
            {"role": "user", "content": "What is 12*13?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"function": {"name": "calculator", "arguments": {"expression": "12*13"}}}]},
            {"role": "tool", "content": "156"},
            {"role": "assistant", "content": "156"},
        ]  # fmt: skip
        other = [*conversation[:-1], {"role": "assistant", "content": "155"}]
        judger = RewardModelJudger(str(reward_models["qwen3"]))
        ((chosen, _), _) = PreferenceTokenizeFn(AutoTokenizer.from_pretrained(TINY_ASSETS_DIR)).batch_arrays(
            [{"chosen": conversation, "rejected": other}], str
        )[0]
        state = RolloutState("156", None, prompt=conversation[:1], messages=conversation)
        assert judger.input_ids([judger.preprocess(state)]) == [chosen.tolist()]

    def test_max_length_keeps_the_end(self, reward_models):
        path = str(reward_models["qwen3"])
        payload = RewardModelJudger(path).preprocess(_states()[2])
        (whole,) = RewardModelJudger(path).input_ids([payload])
        (cut,) = RewardModelJudger(path, max_length=9).input_ids([payload])
        assert cut == whole[-9:] and len(whole) > 9


class TestComposed:
    def test_beside_the_math_judger_the_scores_sum(self, reward_models):
        reward_model = RewardModelJudger(str(reward_models["qwen3"]), scale=0.1)
        composed = ComposedJudger({"*": [MathJudger(), reward_model]})
        states = composed.judge_sync(_states(STATES[:2]))
        alone = reward_model.judge_sync(_states(STATES[:2]))
        for state, own, math in zip(states, alone, (1.0, 0.0)):
            assert set(state.reward) == {
                "score", "MathJudger/score", "RewardModelJudger/score", "RewardModelJudger/raw_score"
            }  # fmt: skip
            assert state.reward["MathJudger/score"] == math
            assert state.reward["RewardModelJudger/score"] == own.reward["score"]
            assert state.reward["score"] == pytest.approx(math + own.reward["score"], abs=1e-12)


class TestFailures:
    def test_a_raising_forward_fails_its_batch_only(self, reward_models, monkeypatch):
        judger = RewardModelJudger(str(reward_models["qwen3"]), batch_size=2)
        third = judger.input_ids([judger.preprocess(_states()[2])])[0]
        scores = judger.raw_scores

        def raw_scores(sequences):
            if third in sequences:  # the second batch
                raise RuntimeError("out of memory")
            return scores(sequences)

        monkeypatch.setattr(judger, "raw_scores", raw_scores)
        states = judger.judge_sync(_states())
        assert [s.status for s in states] == ["completed", "completed", FAILED, FAILED]
        assert states[2].error == "RuntimeError: out of memory" and states[3].reward is None
        assert all(s.reward is not None for s in states[:2])

    def test_a_hung_forward_fails_its_batch_only(self, reward_models, monkeypatch):
        judger = RewardModelJudger(str(reward_models["qwen3"]), batch_size=2, timeout_s=1.0)
        judger.load()
        last = judger.input_ids([judger.preprocess(_states()[3])])[0]
        scores = judger.raw_scores

        def raw_scores(sequences):
            if last in sequences:  # the last batch: the batches before it are done when it hangs
                time.sleep(3.0)
            return scores(sequences)

        monkeypatch.setattr(judger, "raw_scores", raw_scores)
        started = time.perf_counter()
        states = judger.judge_sync(_states())
        assert time.perf_counter() - started < 2.5
        assert [s.status for s in states] == ["completed", "completed", FAILED, FAILED]
        assert "did not answer within 1 s" in states[3].error

    def test_a_model_that_does_not_load_fails_the_call_with_its_error(self, reward_models):
        judger = RewardModelJudger(str(reward_models["qwen3"]), model_kwargs={"attn_implementation": "nonsense"})
        states = judger.judge_sync(_states())
        assert all(s.status == FAILED and "nonsense" in s.error for s in states)

    def test_a_conversation_the_template_cannot_render_fails_its_batch_only(self, reward_models):
        judger = RewardModelJudger(str(reward_models["qwen3"]), batch_size=2)
        states = _states()
        states[0].messages = [{"role": "narrator", "content": "?"}]
        judger.judge_sync(states)
        assert [s.status for s in states] == [FAILED, FAILED, "completed", "completed"]
        assert "unknown role 'narrator'" in states[0].error


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


class TestPickle:
    def test_pickles_without_the_model_and_scores_the_same_after(self, reward_models):
        judger = RewardModelJudger(str(reward_models["qwen3"]), batch_size=2)
        want = [s.reward for s in judger.judge_sync(_states())]
        data = pickle.dumps(judger)
        assert len(data) < 2000, "settings only: no weights, no tokenizer"
        again = pickle.loads(data)
        assert again._model is None
        assert [s.reward for s in again.judge_sync(_states())] == want

    @pytest.mark.slow  # a Ray worker imports torch and transformers: ~35 s on 2 busy cores
    def test_judges_on_a_ray_actor(self, reward_models, local_ray):
        judger = RewardModelJudger(str(reward_models["qwen3"]), batch_size=2)
        want = [s.reward for s in judger.judge_sync(_states())]
        remote = RayJudger(judger, num_actors=1)
        assert [s.reward for s in remote.judge_sync(_states())] == want


class TestRefusals:
    def test_a_missing_directory(self, tmp_path):
        with pytest.raises(ConfigError, match=r"judger.init_args.model: .*missing is not a model directory"):
            RewardModelJudger(str(tmp_path / "missing"))

    def test_a_causal_lm(self, tmp_path):
        _save(Qwen3ForCausalLM(Qwen3Config(**_COMMON, pad_token_id=PAD)), tmp_path)
        with pytest.raises(ConfigError, match="Qwen3ForCausalLM checkpoint, not a sequence-classification model"):
            RewardModelJudger(str(tmp_path))

    def test_a_classifier_with_two_labels(self, reward_models, tmp_path):
        path = _edit_config(reward_models["qwen3"], tmp_path / "two", id2label={"0": "a", "1": "b"})
        with pytest.raises(ConfigError, match="classifier with num_labels 2; a reward model has one output"):
            RewardModelJudger(str(path))

    def test_no_pad_token(self, reward_models, tmp_path):
        path = _edit_config(reward_models["qwen3"], tmp_path / "nopad", pad_token_id=None)
        with pytest.raises(ConfigError, match="has no pad_token_id.*set it to the tokenizer's pad token id"):
            RewardModelJudger(str(path))

    def test_a_pad_token_that_ends_every_conversation(self, reward_models, tmp_path):
        tokenizer = AutoTokenizer.from_pretrained(TINY_ASSETS_DIR)
        newline = tokenizer.convert_tokens_to_ids("Ċ")  # the newline after <|im_end|> ends a qwen3 rendering
        path = _edit_config(reward_models["qwen3"], tmp_path / "newline", pad_token_id=newline)
        with pytest.raises(ConfigError, match="ends a conversation with the pad token"):
            RewardModelJudger(str(path))

    def test_a_template_the_tokenizer_cannot_render(self, reward_models):
        with pytest.raises(ConfigError, match="judger.init_args.template: the tokenizer lacks special tokens"):
            RewardModelJudger(str(reward_models["qwen3"]), template="llama3")

    def test_a_tokenizer_larger_than_the_vocabulary(self, reward_models, tmp_path):
        path = _edit_config(reward_models["qwen3"], tmp_path / "small", vocab_size=1000)
        with pytest.raises(ConfigError, match="1542 tokens, more than the model's vocabulary .1000."):
            RewardModelJudger(str(path))

    @pytest.mark.parametrize(
        ("kwargs", "message"),
        [({"max_length": 0}, "max_length must be >= 1"), ({"dtype": "int8"}, "dtype 'int8' is not supported"),
         ({"batch_size": 0}, "batch_size must be >= 1")],
    )  # fmt: skip
    def test_bad_settings(self, reward_models, kwargs, message):
        with pytest.raises(ConfigError, match=message):
            RewardModelJudger(str(reward_models["qwen3"]), **kwargs)


class TestGRPO:
    def test_the_recipe_runs_with_the_judger_named_in_yaml(self, reward_models, tmp_path):
        """``xtl fit`` of ``configs/tiny_grpo_rm.yaml`` (a tiny random policy and reward model in place of the
        exports, two steps): the judger is built from its ``class_path`` and its rewards train the policy."""
        save_seeded_model(POLICY, tmp_path / "policy")
        (tmp_path / "override.yaml").write_text(
            "trainer:\n  max_steps: 2\n  val_check_interval: null\n  limit_val_batches: 0\n  precision: 32-true\n"
            "  enable_progress_bar: false\n  callbacks: []\n"
            f"model:\n  init_args:\n    model: {tmp_path / 'policy'}\n"
            f"    judger: {{init_args: {{model: {reward_models['qwen3']}}}}}\n"
            "    sampling: {group_size: 4, max_new_tokens: 6}\n"
            "    rollout: {prompts_per_step: 3, dynamic_sampling: false}\n"
        )
        args = ["fit", "--config", str(ROOT / "configs" / "tiny_grpo_rm.yaml"), "--config", "override.yaml"]
        rows, output = run_fit(args, tmp_path)
        assert sorted(rows) == [0, 1], output[-2000:]
        for row in rows.values():
            assert np.isfinite(row["train/loss"]) and row["train/reward_std"] > 0, "varied rewards from the model"
            assert row["rollout/failed"] == 0
