"""``fused_projections``: one q/k/v and one gate/up matmul, the HF checkpoint's separate projections at load and
save, and the separate projections' numbers under ``XTL_HF_IMPL`` (bitwise) and on the fast path (close), on one
process, under expert parallelism (sharded init, load, save, a step and a Muon step) and under context parallelism
(Ulysses and all-gather-KV attention of a fused q/k/v)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import AutoModelForCausalLM

from xtl.errors import ConfigError
from xtl.model import get_model_config_from_hf
from xtl.model.base import has_fused_projections
from xtl.model.hf import CheckpointReader

from .test_moe_parity import save_tiny_moe
from .vlm import save_tiny_vlm

DENSE = ["llama", "qwen2", "qwen3", "qwen3_tied"]
MOE = ["deepseek_v3", "gpt_oss", "qwen3_moe"]
VLM = ["qwen3_vl", "qwen3_vl_moe"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_hf_dir):
    """``checkpoint(variant, dtype=torch.float32) -> Path``: a tiny HF checkpoint of any family."""
    root = tmp_path_factory.mktemp("fused_hf")

    def make(variant: str, dtype: torch.dtype = torch.float32):
        if variant in MOE:
            return save_tiny_moe(variant, dtype, root)
        if variant in VLM:
            return save_tiny_vlm(variant, dtype, root)
        return tiny_hf_dir(variant, dtype)

    return make


def load_fused(path, fused: bool, dtype: torch.dtype | None = torch.float32):
    """The checkpoint at ``path`` as an xtl model with or without fused projections, cast to ``dtype`` (``None``:
    each tensor in the dtype it was stored in)."""
    config = get_model_config_from_hf(path)
    config.fused_projections = fused
    if hasattr(config, "text_config"):
        config.text_config.fused_projections = fused
    with torch.device("meta"):
        model = config.build()
    model.from_hf(path)
    return model if dtype is None else model.to(dtype)


def _all_tensors(path):
    reader = CheckpointReader(path)
    return {key: reader.load(key) for key in reader.keys()}


def _part_grads(model) -> dict[str, torch.Tensor]:
    """Every parameter's gradient under its unfused name (a fused gradient split into its parts' rows)."""
    return _by_part(model, {name: param.grad for name, param in model.named_parameters()})


def _by_part(model, tensors: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
    """``tensors`` (by parameter name, whole: no ``DTensor``) under the unfused names: a fused parameter's tensor
    split into its parts' rows."""
    out = {}
    for name, tensor in tensors.items():
        parts = model.fused_param_parts(name)
        if not parts or tensor is None:
            out[name] = tensor
            continue
        for (part, _), piece in zip(parts, tensor.split([rows for _, rows in parts])):
            out[part] = piece
    return out


def _loss_and_grads(model, ids: torch.Tensor, labels: torch.Tensor):
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), _part_grads(model)


class TestFusedModules:
    @pytest.mark.parametrize("variant", DENSE + MOE + VLM)
    def test_fused_layers_replace_the_separate_projections(self, checkpoint, variant):
        model = load_fused(checkpoint(variant), fused=True)
        names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
        assert has_fused_projections(model) and not names & {"gate_proj", "up_proj"}, names
        if variant != "gpt_oss":  # GPT-OSS has routed experts only: no gated MLP
            assert "gate_up_proj" in names, names
        if variant != "deepseek_v3":  # multi-head latent attention has no q/k/v projections of one input
            assert "qkv_proj" in names and not names & {"q_proj", "k_proj", "v_proj"}, names
        assert not has_fused_projections(load_fused(checkpoint(variant), fused=False))

    @pytest.mark.parametrize("variant", ["qwen2", "qwen3", "gpt_oss"])
    def test_fused_weight_and_bias_are_the_parts_stacked(self, checkpoint, variant):
        fused, plain = load_fused(checkpoint(variant), fused=True), load_fused(checkpoint(variant), fused=False)
        attn, ref = fused.layers[0].self_attn, plain.layers[0].self_attn
        for name in ("weight", "bias") if variant != "qwen3" else ("weight",):
            parts = [getattr(getattr(ref, p), name) for p in ("q_proj", "k_proj", "v_proj")]
            assert torch.equal(getattr(attn.qkv_proj, name), torch.cat(parts))


class TestCheckpointKeys:
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
    @pytest.mark.parametrize("variant", DENSE + MOE + VLM)
    def test_save_writes_the_separate_projections_byte_identical(self, checkpoint, tmp_path, variant, dtype):
        src = checkpoint(variant, dtype)
        fused, plain = load_fused(src, fused=True), load_fused(src, fused=False)
        fused.save_hf(tmp_path / "fused")
        plain.save_hf(tmp_path / "plain")
        before, after = _all_tensors(src), _all_tensors(tmp_path / "fused")
        assert set(after) == set(before)
        for key, tensor in before.items():
            assert torch.equal(after[key].view(torch.uint8), tensor.view(torch.uint8)), key
        for file in sorted((tmp_path / "plain").glob("*.safetensors")):  # the very files the unfused model writes
            assert (tmp_path / "fused" / file.name).read_bytes() == file.read_bytes(), file.name

    def test_hf_keys_expand_to_the_parts_in_row_order(self, checkpoint):
        model = load_fused(checkpoint("qwen3"), fused=True)
        assert model.hf_keys("layers.1.self_attn.qkv_proj.weight") == [
            f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkv"
        ]
        assert model.hf_keys("layers.0.mlp.gate_up_proj.weight") == [
            "model.layers.0.mlp.gate_proj.weight",
            "model.layers.0.mlp.up_proj.weight",
        ]
        assert model.fused_param_parts("layers.0.self_attn.o_proj.weight") == ()
        assert model.fused_param_parts("layers.0.nonexistent.qkv_proj.weight") == ()


class TestNumerics:
    @pytest.mark.usefixtures("hf_impl")
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
    @pytest.mark.parametrize("variant", DENSE + MOE + VLM)
    def test_hf_impl_is_bitwise_the_separate_projections(self, checkpoint, variant, dtype):
        """Logits, loss and every gradient (the fused ones split into their parts) equal the unfused model's,
        which the parity tests hold bitwise to transformers."""
        src = checkpoint(variant, dtype)
        torch.manual_seed(0)
        ids = torch.randint(0, 150, (2, 20))
        fused = _loss_and_grads(load_fused(src, fused=True, dtype=dtype), ids, ids)
        plain = _loss_and_grads(load_fused(src, fused=False, dtype=dtype), ids, ids)
        assert torch.equal(fused[0], plain[0]) and torch.equal(fused[1], plain[1])
        assert fused[2].keys() == plain[2].keys()
        for name, grad in plain[2].items():  # a VLM's vision tower has no gradient from text alone
            assert (grad is None and fused[2][name] is None) or torch.equal(fused[2][name], grad), name

    @pytest.mark.usefixtures("hf_impl")
    def test_hf_impl_matches_transformers(self, checkpoint):
        src = checkpoint("qwen2")
        hf = AutoModelForCausalLM.from_pretrained(src, attn_implementation="eager").eval()
        model = load_fused(src, fused=True).eval()
        ids = torch.randint(0, 150, (2, 20))
        out_hf, out = hf(input_ids=ids, labels=ids), model(input_ids=ids, labels=ids)
        assert torch.equal(out_hf.logits, out.logits) and torch.equal(out_hf.loss, out.loss)

    @pytest.mark.parametrize("variant", ["qwen2", "qwen3", "gpt_oss", "deepseek_v3"])
    def test_fast_path_is_close_to_the_separate_projections(self, checkpoint, variant):
        """fp32: the fused matmul sums each output in its own order, so results agree to rounding (rtol 1e-5)."""
        src = checkpoint(variant)
        torch.manual_seed(0)
        ids = torch.randint(0, 150, (2, 20))
        fused = _loss_and_grads(load_fused(src, fused=True), ids, ids)
        plain = _loss_and_grads(load_fused(src, fused=False), ids, ids)
        torch.testing.assert_close(fused[1], plain[1], rtol=1e-5, atol=0)
        torch.testing.assert_close(fused[0], plain[0], rtol=1e-5, atol=1e-5)
        for name, grad in plain[2].items():
            torch.testing.assert_close(fused[2][name], grad, rtol=1e-4, atol=1e-6, msg=name)


class TestRefusals:
    def test_lora_refuses_fused_projections(self, checkpoint):
        from xtl.callbacks import LoRA

        with pytest.raises(ConfigError, match="fused_projections: false"):
            LoRA().transform_model(load_fused(checkpoint("qwen3"), fused=True))


class TestInit:
    @pytest.mark.parametrize("model_type", ["qwen2", "deepseek_v3"])
    def test_from_scratch_weights_equal_the_unfused_models(self, model_type):
        """Each part is drawn from its own unfused name's seed: the same seed gives the same model, fused or not."""
        from xtl.train.model_spec import resolve_model_config

        fields = dict(model_type=model_type, vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2)
        fields |= dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8)
        if model_type == "deepseek_v3":
            fields |= dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, first_k_dense_replace=1)
            fields |= dict(n_shared_experts=1, kv_lora_rank=8, q_lora_rank=16, qk_rope_head_dim=4)
            fields |= dict(qk_nope_head_dim=4, v_head_dim=4, n_group=2, topk_group=1)
        models = {}
        for fused in (False, True):
            config, _ = resolve_model_config(dict(fields), {"fused_projections": fused})
            torch.manual_seed(3)
            models[fused] = config.build()
            models[fused].init_weights()
        plain = dict(models[False].named_parameters())
        for name, param in models[True].named_parameters():
            parts = models[True].fused_param_parts(name)
            want = torch.cat([plain[p] for p, _ in parts]) if parts else plain[name]
            assert torch.equal(param, want), name


# fp32 on 2 gloo ranks. A fused matmul sums each output in its own order (as on one process, above), and the
# parallel sums split over the ranks: measured <= 1.1e-7 relative on losses, <= 1.9e-5 relative on gradients of
# magnitude >= 1e-3 and <= 6e-8 absolute on all, against the unfused model.
PARALLEL_TOL = {"rtol": 1e-4, "atol": 1e-6}
WORLD = 2


@pytest.fixture(scope="module")
def parallel_results(tmp_path_factory) -> list[dict]:
    """Each rank's results of one spawn of 2 processes: EP 2 (fused and unfused, every MoE family) and CP 2 (fused,
    every family of the context-parallel tests)."""
    from tests.strategies.test_context_parallel import spawned_results

    return spawned_results(_parallel_worker, tmp_path_factory.mktemp("fused_parallel"), WORLD)


@pytest.mark.distributed
class TestFusedUnderParallelism:
    """Fused projections under expert and context parallelism give the unfused model's numbers, compared under the
    unfused (HF) names."""

    @pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss", "qwen3_moe"])
    def test_expert_parallel_init_load_and_save_are_the_unfused_models(self, parallel_results, family):
        """Sharded over FSDP x EP 2: initialized from the same seed, the fused weights are the unfused ones stacked;
        loaded from the unfused model's save, they are its weights, and saving them writes its very files."""
        from pathlib import Path

        for rank, results in enumerate(parallel_results):
            got = results["ep"][family]
            assert got["fused_params"], f"{family} fuses a projection"
            assert got["init"].keys() == got["plain_init"].keys()
            for name, want in got["plain_init"].items():
                assert torch.equal(got["init"][name], want), f"rank {rank} init {name}"
                assert torch.equal(got["loaded"][name], want), f"rank {rank} loaded {name}"
        out_path = parallel_results[0]["out_path"]
        plain, fused = Path(f"{out_path}.{family}.plain"), Path(f"{out_path}.{family}.fused")
        files = sorted(file.name for file in plain.glob("*.safetensors"))
        assert files and files == sorted(file.name for file in fused.glob("*.safetensors"))
        for name in files:
            assert (fused / name).read_bytes() == (plain / name).read_bytes(), name

    @pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss", "qwen3_moe"])
    def test_expert_parallel_loss_gradients_and_muon_step_equal_unfused(self, parallel_results, family):
        """One step (2 micro-batches per rank, loss over both ranks): the loss and every gradient of the fused model
        equal the unfused one's (both under EP 2); one Muon step from the same gradients moves every weight as the
        unfused model's (each fused weight orthogonalized per HF matrix, gathered from its row shards)."""
        for rank, results in enumerate(parallel_results):
            got = results["ep"][family]
            torch.testing.assert_close(got["loss"], got["plain_loss"], rtol=1e-5, atol=0)
            assert got["grads"].keys() == got["plain_grads"].keys()
            for name, want in got["plain_grads"].items():
                message = f"rank {rank} {name}"
                torch.testing.assert_close(got["grads"][name], want, **PARALLEL_TOL, msg=lambda m, n=message: n + m)
            for name, want in got["plain_muon"].items():  # measured: equal (the same bf16 math)
                message = f"rank {rank} muon {name}"
                torch.testing.assert_close(got["muon"][name], want, rtol=0, atol=1e-6, msg=lambda m, n=message: n + m)
            assert got["fused_parts"] and all(
                not torch.equal(got["muon"][part], got["plain_init"][part]) for part in got["fused_parts"]
            ), "the step moved every part of the fused weights"

    @pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss", "qwen3", "qwen3_3_heads", "qwen3_moe", "qwen3_vl",
                                        "qwen3_vl_moe"])  # fmt: skip
    def test_context_parallel_loss_and_gradients_equal_the_unfused_whole_pack(self, parallel_results, family):
        """A pack split over CP 2 (documents across the split, padding): the fused model's loss and every gradient
        equal the unfused model's on the whole pack on one process (Ulysses splits the heads of the fused q/k/v's
        output, GQA's key/value heads included; 3 query heads take all-gather-KV)."""
        from tests.strategies.test_context_parallel import CP, _micro_batch
        from tests.strategies.test_context_parallel import _model as cp_model

        model = cp_model(family)
        batch = _micro_batch(family)
        out = model(seq_ctx=batch.seq_ctx, labels=batch.labels, return_logits=False)
        (out.loss_sum / batch.num_tokens).backward()
        want = _part_grads(model)
        heads = model.config.language_config.num_attention_heads
        for rank, results in enumerate(parallel_results):
            got = results["cp"][family]
            assert got["fused_params"] and got["methods"] == ["allgather_kv" if heads % CP else "ulysses"]
            assert got["init"].keys() == dict(model.named_parameters()).keys()
            assert all(torch.equal(got["init"][name], p) for name, p in model.named_parameters()), "same weights"
            torch.testing.assert_close(got["loss"], out.loss_sum.detach() / batch.num_tokens, rtol=1e-5, atol=0)
            assert got["grads"].keys() == want.keys()
            for name, grad in want.items():
                message = f"rank {rank} {name}"
                torch.testing.assert_close(got["grads"][name], grad, **PARALLEL_TOL, msg=lambda m, n=message: n + m)


def _full(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _whole(model, attribute: str = "data") -> dict[str, torch.Tensor]:
    """Every parameter (or its gradient) whole, under the unfused names."""
    tensors = {name: _full(getattr(p, attribute)) for name, p in model.named_parameters()}
    return {k: None if v is None else v.detach().clone() for k, v in _by_part(model, tensors).items()}


def _ep_model(family: str, fused: bool, meshes, hf_dir: str | None = None):
    """The family's model of the expert-parallel tests, experts split over EP 2 and FSDP over the ranks, initialized
    from seed 0 or loaded from ``hf_dir``."""
    from tests.strategies.test_expert_parallel import FAMILIES
    from xtl.strategies.expert_parallel import shard_experts, split_experts
    from xtl.strategies.parallelize import fully_shard_model
    from xtl.train import resolve_model_config

    config, _ = resolve_model_config({**FAMILIES[family], "fused_projections": fused})
    with torch.device("meta"):
        model = config.build()
    shard_experts(split_experts(model, meshes.ep), meshes, {})
    fully_shard_model(model, mesh=meshes.fsdp)
    if hf_dir is not None:
        model.from_hf(hf_dir, device="cpu")
        return model
    model.materialize("cpu")
    torch.manual_seed(0)
    model.init_weights()
    return model


def _muon_step(model, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One Muon step of ``model`` (its own parameter groups and per-HF-matrix rows) from ``grads`` (whole, by unfused
    name, stacked again for the fused parameters): its weights after it, under the unfused names."""
    from xtl.train.optim import MuonConfig

    for name, param in model.named_parameters():
        parts = model.fused_param_parts(name)
        whole = torch.cat([grads[part] for part, _ in parts]) if parts else grads[name]
        param.grad = None if whole is None else distribute_tensor(whole, param.device_mesh, param.placements)
    MuonConfig(lr=0.02, weight_decay=0.1).build(model, torch.device("cpu")).step()
    return _whole(model)


def _parallel_worker(rank: int, port: int, out_path: str) -> None:
    from tests.strategies.test_context_parallel import MODELS, _micro_batch
    from tests.strategies.test_expert_parallel import _step
    from tests.train.test_step import _micro_batches
    from xtl.data.collate import split_for_context_parallel
    from xtl.strategies.layout import ParallelLayout
    from xtl.train import resolve_model_config

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    results: dict = {"ep": {}, "cp": {}, "out_path": out_path}
    meshes = ParallelLayout(dp_shard=WORLD, ep=WORLD).build("cpu")
    batches = _micro_batches()[2 * rank : 2 * rank + 2]
    for family in ("deepseek_v3", "gpt_oss", "qwen3_moe"):
        plain = _ep_model(family, False, meshes)
        plain.save_hf(f"{out_path}.{family}.plain")
        dist.barrier()
        fused = _ep_model(family, True, meshes, hf_dir=f"{out_path}.{family}.plain")
        loaded = _whole(fused)
        fused.save_hf(f"{out_path}.{family}.fused")
        entry = {
            "fused_params": [name for name, _ in fused.named_parameters() if fused.fused_param_parts(name)],
            "fused_parts": [part for name, _ in fused.named_parameters() for part, _ in fused.fused_param_parts(name)],
            "plain_init": _whole(plain),
            "init": _whole(_ep_model(family, True, meshes)),
            "loaded": loaded,
        }
        for key, model in (("plain_", plain), ("", fused)):
            result, _ = _step(model, batches, WORLD, meshes.data_group())
            loss_sum = result.loss_sum.clone()
            dist.all_reduce(loss_sum)
            entry[f"{key}loss"] = loss_sum / result.global_tokens
            entry[f"{key}grads"] = _whole(model, "grad")
        entry["plain_muon"] = _muon_step(plain, entry["plain_grads"])
        entry["muon"] = _muon_step(fused, entry["plain_grads"])  # the same gradients: the optimizer alone differs
        results["ep"][family] = entry
    for family, spec in MODELS.items():
        config, _ = resolve_model_config({**spec, "fused_projections": True})
        model = config.build()
        torch.manual_seed(0)
        model.init_weights()
        init = _whole(model)
        for module in model.attention_modules():
            module.use_context_parallel(dist.group.WORLD)
        share = split_for_context_parallel(_micro_batch(family), rank, WORLD)
        tokens = torch.tensor(float(share.num_tokens))
        dist.all_reduce(tokens)
        out = model(seq_ctx=share.seq_ctx, labels=share.labels, return_logits=False)
        (out.loss_sum / tokens).backward()
        loss = out.loss_sum.detach().clone()
        dist.all_reduce(loss)
        grads = _whole(model, "grad")
        for grad in grads.values():
            dist.all_reduce(grad)
        results["cp"][family] = {
            "fused_params": [name for name, _ in model.named_parameters() if model.fused_param_parts(name)],
            "init": init,
            "loss": loss / tokens,
            "grads": grads,
            "methods": sorted({module.context_parallel_method for module in model.attention_modules()}),
        }
    torch.save(results, f"{out_path}.{rank}")
    dist.destroy_process_group()
