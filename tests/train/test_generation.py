"""Cached decoding: equal to transformers' greedy ``generate`` (tokens, and logits bitwise with ``XTL_HF_IMPL``),
packed and padded prefill, stop tokens, sampling (seeded, top-k, top-p) and the cache's limits."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import AutoModelForCausalLM

from xtl.model import get_model_config_from_hf
from xtl.module.kv_cache import KVCache
from xtl.ops import AttentionMaskSpec, hf_impl
from xtl.train.generation import GenerationConfig, generate, sample_next, split_thinking

from ..model.test_moe_parity import load_pair, save_tiny_moe

PROMPTS = [[5, 17, 33, 90, 2, 8, 11, 41, 60], [44, 3, 7]]  # different lengths: the second is left-padded
NEW_TOKENS = 10
BITWISE = ["qwen3", "qwen3_moe"]  # MLA and sliding-window caches round or crop differently in transformers
VARIANTS = [*BITWISE, "deepseek_v3", "gpt_oss"]


@pytest.fixture(scope="module")
def pair(tiny_hf_dir, tmp_path_factory):
    """``pair(variant) -> (transformers model, xtl model)`` of one tiny random checkpoint (cached)."""
    root = tmp_path_factory.mktemp("generation")

    @functools.cache
    def load(variant: str):
        if variant != "qwen3":
            return load_pair(save_tiny_moe(variant, torch.float32, root), torch.float32)
        path = tiny_hf_dir("qwen3")
        hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
        model = get_model_config_from_hf(path).build()
        model.from_hf(path)
        return hf, model.eval()

    return load


@pytest.fixture(scope="module")
def reference(pair):
    """``reference(variant, stop=None) -> (new tokens, logits)`` of transformers' greedy decoding (cached)."""
    return functools.cache(lambda variant, stop=None: hf_greedy(pair(variant)[0], stop))


def hf_greedy(hf, stop: int | None = None):
    """transformers' greedy ``generate`` on the left-padded prompts: (new tokens cut after ``stop``, logits)."""
    width = max(len(p) for p in PROMPTS)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    with hf_impl(), torch.no_grad():
        out = hf.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=stop,
            output_logits=True,
            return_dict_in_generate=True,
        )
    rows = out.sequences[:, width:].tolist()
    cut = [row[: row.index(stop) + 1] if stop in row else row for row in rows]
    return cut, list(out.logits)


class TestGreedyEqualsTransformers:
    @pytest.mark.parametrize("prefill", ["padded", "packed"])
    @pytest.mark.parametrize("variant", VARIANTS)
    def test_tokens_equal(self, pair, reference, variant, prefill):
        _, model = pair(variant)
        expected, _ = reference(variant)
        config = GenerationConfig(max_new_tokens=NEW_TOKENS, prefill=prefill)
        with hf_impl():
            assert generate(model, PROMPTS, config).sequences == expected

    @pytest.mark.parametrize("variant", BITWISE)
    def test_padded_batch_logits_are_bitwise(self, pair, reference, variant):
        _, model = pair(variant)
        _, expected = reference(variant)
        config = GenerationConfig(max_new_tokens=NEW_TOKENS, prefill="padded")
        with hf_impl():
            logits = generate(model, PROMPTS, config, output_logits=True).logits
        assert len(logits) == len(expected) == NEW_TOKENS
        assert all(torch.equal(a, b) for a, b in zip(logits, expected))

    @pytest.mark.parametrize("prefill", ["padded", "packed"])
    def test_stop_token_ends_a_sequence_as_in_transformers(self, pair, reference, prefill):
        _, model = pair("qwen3_moe")
        free, _ = reference("qwen3_moe")
        stop = free[0][3]
        expected, _ = reference("qwen3_moe", stop)
        config = GenerationConfig(max_new_tokens=NEW_TOKENS, stop_token_ids=(stop,), prefill=prefill)
        with hf_impl():
            out = generate(model, PROMPTS, config).sequences
        assert out == expected
        assert out[0] == free[0][: free[0].index(stop) + 1]


class TestSampling:
    def test_a_seed_repeats_and_another_seed_differs(self, pair):
        _, model = pair("qwen3")
        config = GenerationConfig(max_new_tokens=NEW_TOKENS, temperature=1.0, seed=3)
        first = generate(model, PROMPTS, config).sequences
        assert generate(model, PROMPTS, config).sequences == first
        assert generate(model, PROMPTS, config, generator=torch.Generator().manual_seed(3)).sequences == first
        assert (
            generate(model, PROMPTS, GenerationConfig(max_new_tokens=NEW_TOKENS, temperature=1.0, seed=4)).sequences
            != first
        )

    @pytest.mark.parametrize("filters", [{"top_k": 1}, {"top_p": 1e-6}], ids=["top_k=1", "tiny_top_p"])
    def test_keeping_only_the_best_token_is_greedy(self, pair, filters):
        _, model = pair("qwen3")
        greedy = generate(model, PROMPTS, GenerationConfig(max_new_tokens=NEW_TOKENS)).sequences
        config = GenerationConfig(max_new_tokens=NEW_TOKENS, temperature=0.7, **filters)
        assert generate(model, PROMPTS, config).sequences == greedy

    def test_top_k_and_top_p_restrict_the_candidates(self):
        probs = torch.tensor([0.05, 0.5, 0.1, 0.3, 0.05])
        logits = probs.log().expand(4000, -1)
        generator = torch.Generator().manual_seed(0)
        top_k = sample_next(logits, GenerationConfig(temperature=1.0, top_k=3), generator)
        assert set(top_k.tolist()) == {1, 2, 3}
        top_p = sample_next(logits, GenerationConfig(temperature=1.0, top_p=0.75), generator)
        assert set(top_p.tolist()) == {1, 3}  # 0.5 + 0.3 reaches 0.75; 0.5 alone does not
        share = (top_p == 1).float().mean().item()
        assert abs(share - 0.5 / 0.8) < 0.03  # renormalized over the kept tokens

    @pytest.mark.parametrize(
        "key,value",
        [
            ("max_new_tokens", 0),
            ("temperature", -1.0),
            ("top_k", -1),
            ("top_p", 0.0),
            ("top_p", 1.5),
            ("prefill", "x"),
        ],
    )
    def test_bad_settings_name_their_key(self, key, value):
        with pytest.raises(ValueError, match=key):
            GenerationConfig(**{key: value})


class TestKVCache:
    def test_too_many_tokens_are_refused(self, pair):
        _, model = pair("qwen3")
        cache = KVCache(batch_size=1, max_length=4)
        ids = torch.tensor([PROMPTS[0]])
        with pytest.raises(ValueError, match="max_length 4"):
            model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None], kv_cache=cache)

    def test_a_packed_prefill_needs_an_empty_cache_and_one_row_per_prompt(self):
        cache = KVCache(batch_size=2, max_length=8)
        packed = AttentionMaskSpec(cu_seq_lens=torch.tensor([0, 3, 5]), max_seq_len=3)
        with pytest.raises(ValueError, match="3 sequences"):
            KVCache(batch_size=3, max_length=8).begin(packed, 1, 5, torch.device("cpu"))
        cache.begin(packed, 1, 5, torch.device("cpu"))
        assert cache.lengths == [3, 2]
        with pytest.raises(ValueError, match="empty KVCache"):
            cache.begin(packed, 1, 5, torch.device("cpu"))

    @pytest.mark.parametrize("prefill", ["padded", "packed"])
    def test_decode_steps_see_only_real_earlier_slots(self, prefill):
        cpu = torch.device("cpu")
        cache = KVCache(batch_size=2, max_length=6)
        if prefill == "padded":  # rows of 3 and 2 tokens, the second left-padded
            cache.begin(AttentionMaskSpec(padding_mask=torch.tensor([[1, 1, 1], [0, 1, 1]])), 2, 3, cpu)
        else:  # the same rows packed: the second is written right-aligned
            cache.begin(AttentionMaskSpec(cu_seq_lens=torch.tensor([0, 3, 5]), max_seq_len=3), 1, 5, cpu)
        step = cache.begin(AttentionMaskSpec(), 2, 1, cpu)
        assert cache.length == 4 and cache.lengths == [4, 3]
        allowed = step.boolean_mask(2, 1, cpu, kv_len=4)
        assert allowed[:, 0, 0].tolist() == [[True, True, True, True], [False, True, True, True]]

    def test_without_padding_a_step_needs_no_mask(self):
        cache = KVCache(batch_size=2, max_length=6)
        cache.begin(AttentionMaskSpec(cu_seq_lens=torch.tensor([0, 2, 4]), max_seq_len=2), 1, 4, torch.device("cpu"))
        step = cache.begin(AttentionMaskSpec(), 2, 1, torch.device("cpu"))
        assert step.padding_mask is None and cache.lengths == [3, 3]


class TestSplitThinking:
    def test_reasoning_and_answer(self):
        assert split_thinking("<think>\nsum\n</think>\n\n5") == ("sum", "5")
        assert split_thinking(" 5 ") == ("", "5")


class TestCheckpointed:
    def test_the_config_loads_from_a_checkpoint_with_weights_only(self, tmp_path):
        """``generation:`` is a hyperparameter of every module: a checkpoint holding it loads as resumes load it."""
        torch.save({"hyper_parameters": {"generation": GenerationConfig(temperature=0.5)}}, tmp_path / "c.pt")
        loaded = torch.load(tmp_path / "c.pt", weights_only=True)["hyper_parameters"]["generation"]
        assert loaded == GenerationConfig(temperature=0.5)
