"""lm-eval on xtl models (:mod:`xtl.callbacks.lm_eval`, :mod:`xtl.callbacks.lm_eval_model`,
:mod:`xtl.callbacks.lm_eval_run`): request-level parity with lm-eval's ``hf`` model, the callback during training,
FSDP, and the settings' errors."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from tests.train.test_step import _free_port
from xtl.callbacks.lm_eval_model import XTLLM
from xtl.callbacks.lm_eval_run import EvalSettings, flat_metrics, resolve_tasks, run_lm_eval
from xtl.errors import ConfigError
from xtl.tools.generate import load_model
from xtl.utils import TINY_ASSETS_DIR

MAX_LENGTH = 48  # short, so that rolling log-likelihoods span several windows and long requests are truncated
FRAGMENT = Path(__file__).resolve().parents[2] / "callbacks" / "lm_eval.yaml"
LOCAL_TASK = """task: local_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: data/choices.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{q}}\\nAnswer:"
doc_to_choice: "{{options}}"
doc_to_target: "{{label}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen3 written by transformers (fp32) with the embedded tiny tokenizer."""
    path = tmp_path_factory.mktemp("hf_tiny")
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=1600, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=True,
        eos_token_id=2, pad_token_id=0, bos_token_id=None,
    )  # fmt: skip
    Qwen3ForCausalLM(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(TINY_ASSETS_DIR).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def local_task(tmp_path_factory) -> Path:
    """A local multiple-choice task: a YAML whose JSONL data lies next to it (a relative path)."""
    root = tmp_path_factory.mktemp("local_task")
    (root / "data").mkdir()
    rng = random.Random(0)
    words = "apple river stone cloud tiger lemon pencil garden rocket candle".split()
    rows = [
        {"q": f"{a} {b}?", "options": [a, b, f"{a}{b}"], "label": rng.randrange(3)} for a in words for b in words[:3]
    ]
    (root / "data" / "choices.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "local_choice.yaml").write_text(LOCAL_TASK)
    return root / "local_choice.yaml"


@pytest.fixture(scope="module")
def sides(hf_dir) -> tuple[XTLLM, HFLM]:
    """xtl's model and lm-eval's ``hf`` model on the same weights, context length and batch size."""
    model, _ = load_model(hf_dir)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    xtl = XTLLM(model, tokenizer, batch_size=4, max_length=MAX_LENGTH)
    hf = HFLM(pretrained=str(hf_dir), dtype="float32", batch_size=4, max_length=MAX_LENGTH, device="cpu")
    return xtl, hf


def _requests(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


class TestParityWithHFBackend:
    """Per request, xtl's answers equal lm-eval's ``hf`` model on the same fp32 weights (log-likelihoods within
    1e-6 relative: packed varlen attention against padded SDPA, the same math in another order; measured 8.6e-8 on
    log-likelihoods of -7 to -22, 0 on the rolling ones)."""

    def test_loglikelihood_and_greedy_flags(self, sides):
        xtl, hf = sides
        contexts = ["Uppercase: stone bridge", "How many words: a b c", "What is 2+3?", "Repeat: tiger " * 20]
        args = [(c, cont) for c in contexts for cont in [" STONE", " 4", "5", " tiger tiger"]]
        # continuations the model itself would choose greedily (so some flags are True), and an empty context
        for context in contexts[:3]:
            ids = hf.tok_encode(context)
            greedy = hf.model.generate(torch.tensor([ids]), max_new_tokens=3, do_sample=False)[0, len(ids) :]
            args.append((context, hf.tok_decode(greedy.tolist())))
        args.append(("", "Repeat: tiger"))
        got = xtl.loglikelihood(_requests("loglikelihood", args))
        want = hf.loglikelihood(_requests("loglikelihood", args), disable_tqdm=True)
        assert [g for _, g in got] == [g for _, g in want]
        assert sum(g for _, g in got) >= 3  # the greedy continuations are flagged
        np.testing.assert_allclose([v for v, _ in got], [v for v, _ in want], rtol=1e-6, atol=0)

    def test_rolling_loglikelihood_over_several_windows(self, sides):
        xtl, hf = sides
        texts = [("stone river cloud " * 20,), ("What is 2+3? 5",), ("tiger " * 60 + "stone river " * 20,)]
        assert len(xtl.tok_encode(texts[2][0])) > 2 * MAX_LENGTH
        got = xtl.loglikelihood_rolling(_requests("loglikelihood_rolling", texts))
        want = hf.loglikelihood_rolling(_requests("loglikelihood_rolling", texts), disable_tqdm=True)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)

    def test_generation_with_stop_sequences(self, sides):
        xtl, hf = sides
        prompts = ["Uppercase: stone bridge", "What is 2+3?", "Repeat: tiger", "How many words: a b"]
        kwargs = [
            {"until": ["\n"], "max_gen_toks": 12, "do_sample": False},
            {"until": ["e", "o"], "max_gen_toks": 9, "do_sample": False},
        ]
        args = [(p, dict(k)) for p in prompts for k in kwargs]
        got = xtl.generate_until(_requests("generate_until", args))
        want = hf.generate_until(_requests("generate_until", [(p, dict(k)) for p, k in args]), disable_tqdm=True)
        assert got == want
        assert any(text for text in got)

    def test_task_metrics_equal(self, sides, local_task):
        xtl, hf = sides
        settings = EvalSettings(
            tasks=["tiny_choice", "tiny_exact", str(local_task)], limit=16, apply_chat_template=False
        )
        tasks, manager = resolve_tasks(settings)
        got = flat_metrics(run_lm_eval(xtl, settings, tasks, manager))
        want = flat_metrics(run_lm_eval(hf, settings, tasks, manager))
        assert got == want
        assert {"eval/tiny_choice/acc", "eval/tiny_exact/exact_match", "eval/local_choice/acc"} <= set(got)


class TestRunSettings:
    def test_random_state_is_restored(self, sides):
        xtl, _ = sides
        settings = EvalSettings(tasks=["tiny_choice"], limit=2, num_fewshot=1)
        tasks, manager = resolve_tasks(settings)
        torch.manual_seed(7), random.seed(7), np.random.seed(7)
        expected = torch.rand(3), random.random(), np.random.rand()
        torch.manual_seed(7), random.seed(7), np.random.seed(7)
        run_lm_eval(xtl, settings, tasks, manager)
        assert torch.equal(torch.rand(3), expected[0])
        assert (random.random(), np.random.rand()) == expected[1:]

    def test_model_mode_is_restored(self, sides):
        xtl, _ = sides
        xtl.model.train()
        xtl.loglikelihood(_requests("loglikelihood", [("a", " b")]))
        xtl.generate_until(_requests("generate_until", [("a", {"until": ["\n"], "max_gen_toks": 2})]))
        assert xtl.model.training
        xtl.model.eval()

    def test_local_yaml_data_is_found_from_any_folder(self, local_task, tmp_path, monkeypatch):
        monkeypatch.chdir(tmp_path)
        tasks, _ = resolve_tasks(EvalSettings(tasks=[str(local_task)]))
        assert tasks[0]["dataset_kwargs"]["data_files"]["test"] == str(local_task.parent / "data" / "choices.jsonl")

    @pytest.mark.parametrize(
        ("settings", "message"),
        [
            ({"tasks": []}, "tasks: name at least one task"),
            ({"tasks": ["x"], "batch_size": 0}, "batch_size must be >= 1"),
            ({"tasks": ["x"], "limit": 0}, "limit must be > 0"),
            ({"tasks": ["x"], "fewshot_as_multiturn": True}, "fewshot_as_multiturn needs apply_chat_template"),
        ],
    )
    def test_bad_settings(self, settings, message):
        with pytest.raises(ConfigError, match=message):
            EvalSettings(**settings)

    def test_registry_names_from_include_path(self, local_task):
        settings = EvalSettings(tasks=["local_choice", "tiny_choice"], include_path=[str(local_task.parent)])
        tasks, manager = resolve_tasks(settings)
        assert tasks[0] == "local_choice" and tasks[1]["task"] == "tiny_choice"
        assert "local_choice" in manager.all_tasks

    def test_missing_yaml_and_unknown_task(self, tmp_path):
        with pytest.raises(ConfigError, match="does not exist"):
            resolve_tasks(EvalSettings(tasks=[str(tmp_path / "nope.yaml")]))
        with pytest.raises(ConfigError, match="did you mean 'tiny_choice'"):
            resolve_tasks(EvalSettings(tasks=["tiny_chioce"], include_path=[str(TINY_ASSETS_DIR / "lm_eval")]))


class TestCallback:
    """``callbacks/lm_eval.yaml`` on the tiny recipe: scores logged and written at the evaluated steps, and the
    training losses bitwise those of the run without it."""

    EVERY_STEP = (
        "trainer:\n  callbacks+:\n    - class_path: xtl.callbacks.LMEval\n"
        "      init_args: {tasks: [tiny_choice, tiny_exact], every_n_steps: 2, limit: 6, apply_chat_template: true}\n"
    )

    def test_logs_and_writes_without_changing_training(self, tiny_fit):
        plain = tiny_fit("tiny_sft.yaml")
        run = tiny_fit("tiny_sft.yaml", self.EVERY_STEP)
        assert run.column("train/loss") == plain.column("train/loss")
        evaluated = {int(r["step"]) for r in run.logged if r.get("eval/tiny_choice/acc")}
        assert evaluated == {2, 3}  # every 2 steps, and at the end
        assert all(r.get("eval/tiny_exact/exact_match") for r in run.logged if r.get("eval/tiny_choice/acc"))
        record = json.loads((run.root / "lm_eval" / "step_2.json").read_text())
        assert record["step"] == 2 and record["results"]["tiny_choice"]["acc,none"] >= 0
        assert record["n-samples"]["tiny_choice"]["effective"] == 6

    def test_validate_shows_the_scores(self, tiny_fit, data_cache, capsys):
        from tests.cli.test_cli import _run_main

        run = tiny_fit("tiny_sft.yaml", self.EVERY_STEP)
        args = ["validate", "--config", str(run.root / "config.yaml"), "--ckpt_path", "last"]
        assert _run_main([*args, "--data.cache_dir", str(data_cache), "--trainer.enable_progress_bar", "false"]) == 0
        out = capsys.readouterr().out
        assert "eval/tiny_choice/acc" in out and "eval/tiny_exact/exact_match" in out
        assert (run.root / "lm_eval" / "step_3.json").is_file()

    def test_fragment_names_shipped_tasks(self):
        text = FRAGMENT.read_text()
        assert "xtl.callbacks.LMEval" in text and "tiny_choice" in text and "apply_chat_template: true" in text

    def test_bad_option_is_a_config_error(self):
        from xtl.callbacks import LMEval

        with pytest.raises(ConfigError, match="LMEval.batch_size must be >= 1"):
            LMEval(tasks=["tiny_choice"], batch_size=0)


@pytest.mark.distributed
class TestFSDP:
    @pytest.mark.parametrize("cp", [1, 2], ids=["data-parallel", "context-parallel"])
    def test_two_ranks_score_like_one_process(self, hf_dir, sides, tmp_path, cp):
        """Two FSDP2 ranks (fp32, gloo): as two data-parallel ranks they split the requests unevenly and agree on
        their forwards; as one context-parallel group each scores its half of every packed row and they decode whole
        sequences in step. The task metrics (log-likelihoods and greedy generation) equal one process's exactly and
        the per-request log-likelihoods within 1e-5."""
        out = tmp_path / "fsdp.json"
        mp.spawn(_fsdp_worker, args=(2, _free_port(), str(hf_dir), str(out), cp), nprocs=2, join=True)
        got = json.loads(out.read_text())
        xtl, _ = sides
        settings = EvalSettings(**_FSDP_SETTINGS)
        want = flat_metrics(run_lm_eval(xtl, settings, *resolve_tasks(settings)))
        assert got["metrics"] == want
        single = xtl.loglikelihood(_requests("loglikelihood", _FSDP_REQUESTS))
        np.testing.assert_allclose(got["loglikelihoods"], [v for v, _ in single], rtol=0, atol=1e-5)


_FSDP_SETTINGS = {"tasks": ["tiny_choice", "tiny_exact"], "limit": 7}
_FSDP_REQUESTS = [(f"Repeat: {w}", f" {w}") for w in "apple river stone cloud tiger lemon pencil".split()]


def _fsdp_worker(rank: int, world: int, port: int, hf_dir: str, out: str, cp: int = 1) -> None:
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model, _ = load_model(Path(hf_dir))
        kwargs = {}
        if cp > 1:  # one context-parallel group, as FSDPStrategy lays it out
            from tests.strategies.test_context_parallel import one_group_strategy

            strategy = one_group_strategy(cp)
            strategy.apply_context_parallel(model)
            group = strategy.meshes.cp_group()
            kwargs = {"context_group": group, "whole_sequences": lambda: strategy.whole_sequences(model)}
        for layer in model.decoder_layers():
            fully_shard(layer)
        fully_shard(model)
        tokenizer = AutoTokenizer.from_pretrained(hf_dir)
        lm = XTLLM(model, tokenizer, batch_size=4, max_length=MAX_LENGTH, group=dist.group.WORLD, **kwargs)
        settings = EvalSettings(**_FSDP_SETTINGS)
        results = run_lm_eval(lm, settings, *resolve_tasks(settings))
        lm_rank, lm_world = lm.rank, lm.world_size
        share = _FSDP_REQUESTS if lm_world == 1 else _FSDP_REQUESTS[:5] if lm_rank == 0 else _FSDP_REQUESTS[5:]
        scores = [v for v, _ in lm.loglikelihood(_requests("loglikelihood", share))]  # uneven: 2 packs vs 1
        gathered = [None] * world
        dist.all_gather_object(gathered, scores)
        if rank == 0:
            parts = gathered[:: world // lm_world]
            record = {"metrics": flat_metrics(results), "loglikelihoods": [v for part in parts for v in part]}
            Path(out).write_text(json.dumps(record))
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
class TestLayoutGroup:
    def test_a_one_rank_layout_in_a_two_rank_process_group_evaluates_alone(self, hf_dir, tmp_path):
        """Two runs of one rank each share a process group (as the composition matrix's runner does), each
        evaluating its own task: the callback's requests and shared scores stay within its layout's group, so each
        run reports its own task (over the default group they would mix, or wait on each other)."""
        out = str(tmp_path / "metrics")
        mp.spawn(_one_rank_layout_worker, args=(_free_port(), str(hf_dir), out), nprocs=2, join=True)
        for rank, task in enumerate(_TASK_OF_RANK):
            metrics = json.loads(Path(f"{out}.{rank}").read_text())
            assert metrics and {name.split("/")[1] for name in metrics} == {task}, metrics


_TASK_OF_RANK = ("tiny_choice", "tiny_exact")


def _one_rank_layout_worker(rank: int, port: int, hf_dir: str, out: str) -> None:
    from datetime import timedelta
    from types import SimpleNamespace

    from tests.strategies.test_layout import _OneRankLayout
    from xtl.callbacks import LMEval
    from xtl.data import XTLDataModule

    address = f"tcp://127.0.0.1:{port}"
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    try:
        model, _ = load_model(Path(hf_dir))
        module = SimpleNamespace(model=model, parallelizer=_OneRankLayout())
        datamodule = XTLDataModule(sources=[{"path": "tiny:sft_train.jsonl"}], tokenizer=hf_dir)
        trainer = SimpleNamespace(datamodule=datamodule, global_step=0, is_global_zero=True)
        callback = LMEval(tasks=[_TASK_OF_RANK[rank]], limit=2, dirpath=f"{out}.dir{rank}")
        Path(f"{out}.{rank}").write_text(json.dumps(callback.evaluate(trainer, module)))
    finally:
        dist.destroy_process_group()


class TestVisionLanguageModel:
    """A vision-language model answers text-only requests as transformers' model does on text alone: packed
    log-likelihoods through the VLM's forward (M-RoPE positions of text), and cached greedy decoding."""

    def test_text_requests_match_transformers(self, tmp_path):
        from tests.model.vlm import load_pair, save_tiny_vlm
        from xtl.train.generation import GenerationConfig, generate

        hf, model = load_pair(save_tiny_vlm("qwen3_vl", torch.float32, tmp_path), torch.float32)
        lm = XTLLM(model, tokenizer=None, batch_size=2, max_length=64)
        generator = torch.Generator().manual_seed(0)
        requests = [
            (None, torch.randint(5, 100, (n,), generator=generator).tolist(), torch.randint(5, 100, (m,)).tolist())
            for n, m in [(9, 3), (5, 1), (12, 4)]
        ]
        got = lm._loglikelihood_tokens(requests)
        for (_, context, continuation), (value, _) in zip(requests, got):
            with torch.no_grad():
                logits = hf(input_ids=torch.tensor([context + continuation])).logits[0, len(context) - 1 : -1]
            want = logits.log_softmax(-1).gather(1, torch.tensor(continuation)[:, None]).sum()
            assert abs(value - float(want)) < 1e-5
        prompt = requests[0][1]
        ours = generate(model, [prompt], GenerationConfig(max_new_tokens=6)).sequences[0]
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt) :].tolist()
        assert ours == theirs
