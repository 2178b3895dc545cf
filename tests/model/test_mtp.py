"""DeepSeek-V3 multi-token prediction: the depth against transformers' ``MtpModel``, the per-document shift and loss
mask, the checkpoint round trip of the MTP layer, MTP off leaving the model as it was, and 2 context-parallel ranks
training the depths as one process does."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from transformers.modeling_layers import MtpModel

from xtl.callbacks import ActivationCheckpointing
from xtl.data.collate import collate_pack, split_for_context_parallel
from xtl.data.packing import Pack
from xtl.model import SequenceContext, get_model_config_from_hf
from xtl.model.hf import CheckpointError, CheckpointReader
from xtl.model.moe import DeepSeekV3Config
from xtl.module.mtp import MTPBlock, mtp_target_counts, shift_in_pack, shift_within_documents, shifted_targets
from xtl.ops import AttentionMaskSpec
from xtl.train.family import DataRanks, MTPLosses

from .test_moe_parity import _COMMON, MOE_VARIANTS, save_tiny_moe

LAYERS = _COMMON["num_hidden_layers"]
MTP = f"model.layers.{LAYERS}."


def tiny_config(mtp_layers: int, num_mtp_layers: int = 2) -> DeepSeekV3Config:
    """The tiny DeepSeek-V3 of the parity tests, with ``mtp_layers`` MTP depths."""
    fields = {k: v for k, v in MOE_VARIANTS["deepseek_v3"][2].items() if k != "rope_parameters"}
    return DeepSeekV3Config(**_COMMON, **fields, num_mtp_layers=num_mtp_layers, mtp_layers=mtp_layers)


def initialized(config: DeepSeekV3Config) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = config.build()
    model.init_weights()  # per-name seeds: the main weights do not depend on the MTP depths
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.mul_(25.0)  # routing margins far above rounding noise (see build_tiny_moe)
    return model


def save_with_mtp(src: Path, out: Path) -> dict[str, torch.Tensor]:
    """``src``'s tensors plus one MTP layer (random, of layer 1's dtypes; the embedding and head copied), saved in
    ``out`` with ``src``'s config; returns the tensors."""
    tensors = load_file(str(src / "model.safetensors"))
    generator = torch.Generator().manual_seed(1)
    dtype = tensors["model.layers.1.input_layernorm.weight"].dtype

    def rand(shape: tuple[int, ...], like: torch.dtype, norm: bool) -> torch.Tensor:
        return ((1.0 if norm else 0.0) + 0.1 * torch.randn(shape, generator=generator)).to(like)

    extra = {
        key.replace("model.layers.1.", MTP): rand(tuple(t.shape), t.dtype, "norm" in key)
        for key, t in tensors.items()
        if key.startswith("model.layers.1.")
    }
    hidden = _COMMON["hidden_size"]
    for name in ("enorm", "hnorm", "shared_head.norm"):
        extra[f"{MTP}{name}.weight"] = rand((hidden,), dtype, True)
    extra[f"{MTP}eh_proj.weight"] = rand((hidden, 2 * hidden), dtype, False)
    extra[f"{MTP}embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    extra[f"{MTP}shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    tensors.update(extra)
    out.mkdir(parents=True, exist_ok=True)
    for side in src.iterdir():
        if side.suffix == ".json":
            (out / side.name).write_bytes(side.read_bytes())
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return tensors


def load(path: Path, mtp_layers: int = 1):
    config = dataclasses.replace(get_model_config_from_hf(path), mtp_layers=mtp_layers)
    with torch.device("meta"):
        model = config.build()
    model.from_hf(path)
    return model.eval()


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory: pytest.TempPathFactory):
    """Factory: ``mtp_dir(dtype) -> (path, tensors)`` of the tiny DeepSeek-V3 checkpoint with one MTP layer."""
    root = tmp_path_factory.mktemp("hf_mtp")
    cache = {}

    def make(dtype: torch.dtype):
        if dtype not in cache:
            out = root / f"mtp_{str(dtype).split('.')[-1]}"
            cache[dtype] = out, save_with_mtp(save_tiny_moe("deepseek_v3", dtype, root), out)
        return cache[dtype]

    return make


def pack(lengths: list[int], supervised_tail: int | None = None, seed: int = 0):
    """A collated micro-batch of random documents (labels: the tokens, or, after the first document, only each
    document's last ``supervised_tail`` tokens; a random one of every document unsupervised)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, _COMMON["vocab_size"], sum(lengths))
    labels = ids.copy()
    start = 0
    for i, n in enumerate(lengths):
        if supervised_tail is not None and i > 0:
            labels[start : start + n - supervised_tail] = -100
        labels[start + rng.integers(0, n)] = -100
        start += n
    return collate_pack(Pack(0, ids, labels, lengths))


def reference_counts(mb, depths: int) -> list[int]:
    """Positions ``t`` whose label ``k`` positions later is supervised and in ``t``'s document, per depth ``k``."""
    labels, bounds = mb.labels[0].tolist(), mb.seq_ctx.doc_bounds
    return [
        sum(labels[t + k] != -100 for s, e in zip(bounds[:-1], bounds[1:]) for t in range(s, e - k))
        for k in range(1, depths + 1)
    ]


def reference_mtp_losses(model, mb) -> tuple[list[float], list[int]]:
    """Each depth's summed loss and scored positions, one document at a time with explicit loops: depth ``k`` at
    position ``t`` reads token ``t + k`` and is scored on the label of ``t + k`` (the token ``t + k + 1``) when both
    are in ``t``'s document and that label is supervised."""
    ids, labels = mb.seq_ctx.input_ids[0], mb.labels[0]
    bounds = mb.seq_ctx.doc_bounds
    hidden_all = model(seq_ctx=mb.seq_ctx, return_hidden_states=True).hidden_states
    sums, counts = [0.0] * len(model.mtp), [0] * len(model.mtp)
    for start, end in zip(bounds[:-1], bounds[1:]):
        hidden = hidden_all[:, start:end]
        n = end - start
        positions = torch.arange(n)[None]
        cos_sin = model.rotary_emb(positions, hidden.dtype)
        for depth, block in enumerate(model.mtp, start=1):
            embeds = torch.zeros_like(hidden)
            for t in range(n - depth):
                embeds[0, t] = model.embed_tokens.weight[ids[start + t + depth]]
            hidden, _ = block(hidden, embeds, cos_sin, AttentionMaskSpec())
            logits = hidden[0].float() @ model.lm_head.weight.float().T
            for t in range(n - depth):
                target = int(labels[start + t + depth])
                if target != -100:
                    sums[depth - 1] += float(F.cross_entropy(logits[t], torch.tensor(target)))
                    counts[depth - 1] += 1
    return sums, counts


class TestShiftInPack:
    @pytest.mark.parametrize("size", [2, 3])
    @pytest.mark.parametrize("shift", [1, 2, 3])
    def test_shares_give_the_whole_packs_shift(self, size, shift):
        """Cut into shares, the shift of the pack's ids and labels is the whole pack's, cut: a share's last positions
        read the next share's values, and documents (one of 5 tokens across the cut at 24) are the pack's."""
        mb = pack([9, 13, 5, 20], supervised_tail=5)  # 47 tokens: padded to a multiple of the shares
        shares = [split_for_context_parallel(mb, rank, size) for rank in range(size)]
        whole = split_for_context_parallel(mb, 0, 1)
        positions = whole.seq_ctx.position_ids
        want_ids = shift_within_documents(whole.seq_ctx.input_ids, positions, shift, fill=-1)
        want_labels = shift_within_documents(whole.labels, positions, shift, fill=-100)
        got_ids = torch.cat([shift_in_pack(s.seq_ctx.pack_input_ids, s.seq_ctx, shift, -1) for s in shares], 1)
        got_labels = torch.cat(
            [shifted_targets(s.labels, s.seq_ctx.position_ids, shift, s.seq_ctx) for s in shares], 1
        )
        length = want_ids.shape[1]  # the shares' padding (one token for 2 shares) has no token ahead
        assert torch.equal(got_ids[:, :length], want_ids) and (got_ids[:, length:] == -1).all()
        assert torch.equal(got_labels[:, :length], want_labels) and (got_labels[:, length:] == -100).all()
        counts = sum(mtp_target_counts(s.labels, s.seq_ctx.position_ids, 3, s.seq_ctx) for s in shares)
        assert counts.tolist() == reference_counts(mb, 3)

    def test_a_share_without_the_packs_labels_is_refused(self):
        share = split_for_context_parallel(pack([9, 14]), 0, 2)
        share.seq_ctx.pack_labels = None
        with pytest.raises(ValueError, match="needs the whole pack's labels"):
            shifted_targets(share.labels, share.seq_ctx.position_ids, 1, share.seq_ctx)


class TestShiftWithinDocuments:
    def test_values_come_from_the_same_document_or_are_filled(self):
        ctx = SequenceContext.from_lengths(torch.arange(7)[None], [3, 4])
        values = torch.arange(10, 17)[None]
        one = shift_within_documents(values, ctx.position_ids, 1, fill=-1)
        two = shift_within_documents(values, ctx.position_ids, 2, fill=-1)
        assert one.tolist() == [[11, 12, -1, 14, 15, 16, -1]]
        assert two.tolist() == [[12, -1, -1, 15, 16, -1, -1]]

    def test_embeddings_shift_per_row_of_a_batch(self):
        values = torch.randn(2, 5, 3)
        shifted = shift_within_documents(values, torch.arange(5)[None], 2)
        assert torch.equal(shifted[:, :3], values[:, 2:]) and not shifted[:, 3:].any()


@pytest.mark.usefixtures("hf_impl")
class TestMTPParity:
    def test_depth_equals_transformers_mtp_model(self, mtp_dir):
        path, _ = mtp_dir(torch.float32)
        hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", experts_implementation="eager")
        hf._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{LAYERS}.*"]  # transformers' pattern names layer 61
        hf.config.name_or_path = str(path)
        reference = MtpModel.from_pretrained(hf).eval()
        model = load(path)
        ids = torch.randint(0, _COMMON["vocab_size"], (1, 12))
        with torch.no_grad():
            last = hf.eval()(input_ids=ids, output_hidden_states=True).hidden_states[-1]
            expected = reference._project_to_logits(
                reference.forward_layer(0, last[:, :-1], torch.arange(11)[None], None, input_ids=ids[:, 1:])
            )
            hidden = model(input_ids=ids, return_hidden_states=True).hidden_states
            embeds = shift_within_documents(model.embed_tokens(ids), torch.arange(12)[None], 1)[:, :-1]
            cos_sin = model.rotary_emb(torch.arange(11)[None], embeds.dtype)  # the 11 positions transformers runs
            out, routing = model.mtp[0](hidden[:, :-1], embeds, cos_sin, AttentionMaskSpec())
            logits = out @ model.lm_head.weight.T
        assert torch.equal(hidden, last)
        assert routing is not None  # layer num_hidden_layers >= first_k_dense_replace: an MoE depth
        assert torch.equal(logits, expected)


class TestMTPLoss:
    def test_packed_losses_equal_a_per_document_reference(self):
        model = initialized(tiny_config(mtp_layers=2))
        mb = pack([9, 5, 14, 3])
        with torch.no_grad():
            out = model(seq_ctx=mb.seq_ctx, labels=mb.labels)
            sums, counts = reference_mtp_losses(model, mb)
        assert out.extras["mtp_num_tokens"].tolist() == counts
        assert mtp_target_counts(mb.labels, mb.seq_ctx.position_ids, 2).tolist() == counts
        torch.testing.assert_close(out.extras["mtp_loss_sum"], torch.tensor(sums), rtol=1e-5, atol=0)

    def test_supervised_rows_give_the_losses_of_all_rows(self):
        model = initialized(tiny_config(mtp_layers=2))
        mb = pack([20, 100, 120, 80], supervised_tail=12)
        assert mb.seq_ctx.loss_positions is not None  # the training forward runs the heads on these rows only
        with torch.no_grad():
            rows = model(seq_ctx=mb.seq_ctx, labels=mb.labels, return_logits=False).extras
            every = model(seq_ctx=mb.seq_ctx, labels=mb.labels, return_logits=True).extras
        assert torch.equal(rows["mtp_num_tokens"], every["mtp_num_tokens"])
        assert rows["mtp_num_tokens"].tolist() == reference_counts(mb, 2)
        torch.testing.assert_close(rows["mtp_loss_sum"], every["mtp_loss_sum"], rtol=1e-5, atol=0)

    def test_mtp_gradient_reaches_the_shared_embedding_and_head(self):
        model = initialized(tiny_config(mtp_layers=1))
        mb = pack([9, 12])
        out = model(seq_ctx=mb.seq_ctx, labels=mb.labels, return_logits=False)
        out.extras["mtp_loss_sum"].sum().backward()
        assert model.mtp[0].eh_proj.weight.grad.abs().sum() > 0
        assert model.lm_head.weight.grad.abs().sum() > 0 and model.embed_tokens.weight.grad.abs().sum() > 0
        assert model.layers[0].self_attn.o_proj.weight.grad.abs().sum() > 0  # through the main hidden states


class TestMTPOff:
    def test_state_loss_and_router_rows_are_those_without_mtp(self):
        off, on = initialized(tiny_config(mtp_layers=0)), initialized(tiny_config(mtp_layers=1))
        assert set(off.state_dict()) == {k for k in on.state_dict() if not k.startswith("mtp.")}
        assert all(torch.equal(p, on.state_dict()[k]) for k, p in off.state_dict().items())
        assert not any(k.startswith(MTP) for name in off.checkpoint_tensors() for k in off.hf_keys(name))
        mb = pack([9, 5, 14])
        with torch.no_grad():
            a = off(seq_ctx=mb.seq_ctx, labels=mb.labels)
            b = on(seq_ctx=mb.seq_ctx, labels=mb.labels)
        assert torch.equal(a.loss, b.loss) and torch.equal(a.logits, b.logits)
        assert set(a.extras) == {"router_prob_sum", "router_z_sum", "tokens_per_expert", "router_num_tokens"}
        assert torch.equal(a.extras["tokens_per_expert"], b.extras["tokens_per_expert"][:1])
        assert list(off.layer_stacks()) == ["language"] and len(off.moe_blocks()) == 1


class TestMTPParts:
    def test_depths_are_shard_units_moe_blocks_and_attention(self):
        model = initialized(tiny_config(mtp_layers=2))
        assert list(model.layer_stacks()) == ["language", "mtp"]
        assert model.shard_units()[-2:] == list(model.mtp)
        assert model.moe_blocks()[-2:] == [block.layer.mlp for block in model.mtp]
        assert model.attention_modules()[-1] is model.mtp[1].layer.self_attn
        mb = pack([9, 12])
        with torch.no_grad():
            loads = model(seq_ctx=mb.seq_ctx, labels=mb.labels).extras["tokens_per_expert"]
            unrun = model(seq_ctx=mb.seq_ctx).extras["tokens_per_expert"]  # no targets: the depths do not run
        assert loads.shape[0] == 3 and (loads.sum(1) == 21 * 2).all()  # every token routed in every MoE block
        assert unrun.shape[0] == 3 and not unrun[1:].any()
        model.update_router_bias(loads, 0.1)  # one row per MoE block

    def test_checkpointing_recomputes_the_depths_with_equal_gradients(self):
        mb = pack([9, 12])
        grads, calls = [], []
        for checkpointing in (False, True):
            model = initialized(tiny_config(mtp_layers=1))
            if checkpointing:
                callback = ActivationCheckpointing()
                callback.transform_model(model)
                assert callback.checkpointed_layers == {"language": [0, 1], "mtp": [0]}
            calls.append(0)
            index = len(calls) - 1
            model.mtp[0].eh_proj.register_forward_pre_hook(lambda *_, i=index: calls.__setitem__(i, calls[i] + 1))
            out = model(seq_ctx=mb.seq_ctx, labels=mb.labels, return_logits=False)
            (out.loss_sum + out.extras["mtp_loss_sum"].sum()).backward()
            grads.append({k: p.grad for k, p in model.named_parameters() if p.grad is not None})
        assert calls == [1, 2]
        assert grads[0].keys() == grads[1].keys()
        assert all(torch.equal(grads[0][k], grads[1][k]) for k in grads[0])


class TestMTPCheckpoint:
    def test_load_then_save_is_byte_identical(self, mtp_dir, tmp_path):
        path, source = mtp_dir(torch.bfloat16)
        model = load(path)
        model.save_hf(tmp_path / "out")
        reader = CheckpointReader(tmp_path / "out")
        saved = {k: reader.load(k) for k in reader.keys()}
        assert set(saved) == set(source)
        for key, tensor in source.items():
            assert saved[key].dtype == tensor.dtype, key
            assert torch.equal(saved[key].view(torch.uint8), tensor.view(torch.uint8)), key

    def test_weights_land_in_their_modules(self, mtp_dir):
        path, source = mtp_dir(torch.float32)
        block: MTPBlock = load(path).mtp[0]
        pairs = {
            "enorm.weight": block.enorm.weight,
            "hnorm.weight": block.hnorm.weight,
            "eh_proj.weight": block.eh_proj.weight,
            "shared_head.norm.weight": block.norm.weight,
            "self_attn.q_a_proj.weight": block.layer.self_attn.q_a_proj.weight,
            "mlp.experts.3.down_proj.weight": block.layer.mlp.experts.down[3],
            "mlp.gate.e_score_correction_bias": block.layer.mlp.gate.e_score_correction_bias,
        }
        for key, param in pairs.items():
            assert torch.equal(param, source[MTP + key]), key

    def test_an_embedding_copy_that_differs_is_refused(self, mtp_dir, tmp_path):
        path, source = mtp_dir(torch.float32)
        tensors = dict(source)
        tensors[f"{MTP}shared_head.head.weight"] = tensors[f"{MTP}shared_head.head.weight"] + 1
        bad = tmp_path / "bad"
        bad.mkdir()
        (bad / "config.json").write_bytes((path / "config.json").read_bytes())
        save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(CheckpointError, match="shared_head.head.weight differs from lm_head.weight"):
            load(bad)

    def test_without_mtp_the_mtp_layer_is_ignored(self, mtp_dir, tmp_path):
        path, source = mtp_dir(torch.float32)
        model = load(path, mtp_layers=0)
        model.save_hf(tmp_path / "out")
        saved = set(CheckpointReader(tmp_path / "out").keys())
        assert saved == {k for k in source if not k.startswith(MTP)}


# packs whose documents cross the split, so that the last positions of rank 0 read tokens and score labels of rank 1:
# dense labels (the head runs on every row; a document of 5 tokens across the split at 24), and sparse ones (the
# supervised rows only; each document's last 12 tokens labelled, one document's ending 10 positions after the split)
CP_PACKS = {"dense": ([9, 13, 5, 20], None), "sparse": ([40, 125, 145], 12)}
# fp32, the same sums split over 2 ranks (Ulysses all-to-all, gradients added over the ranks): measured <= 1e-7
# relative on the MTP losses, <= 7.3e-6 relative on gradients of magnitude >= 1e-3 and <= 3e-8 absolute on all
CP_TOL = {"rtol": 1e-5, "atol": 1e-6}


@pytest.fixture(scope="module")
def cp_mtp_results(tmp_path_factory) -> list[dict]:
    """Each rank's logged MTP losses, counts and averaged gradients, per pack, from one spawn of 2 processes."""
    from tests.strategies.test_context_parallel import spawned_results

    return spawned_results(_cp_mtp_worker, tmp_path_factory.mktemp("cp_mtp"))


@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(CP_PACKS))
class TestMTPContextParallel:
    """2 context-parallel ranks (one pack split in two shares, Ulysses attention) train the MTP depths as one
    process trains the whole pack: logged ``mtp_loss_<k>``, counts, and every gradient of the step's loss (next-token
    plus MTP term, averaged over the ranks as FSDP reduces them)."""

    def test_losses_counts_and_gradients_equal_one_process(self, cp_mtp_results, name):
        mb = pack(*CP_PACKS[name])
        assert (mb.seq_ctx.loss_positions is not None) == (name == "sparse")
        end = split_for_context_parallel(mb, 0, 2).seq_ctx.seq_len
        tails = [shift_within_documents(mb.labels, mb.seq_ctx.position_ids, k, -100)[0, end - k : end] for k in (1, 2)]
        assert any((tail != -100).any() for tail in tails), "rank 0's last positions score labels of rank 1"
        want = _mtp_step(initialized(tiny_config(mtp_layers=2)), mb, DataRanks(1, lambda t: t))
        assert want["counts"].tolist() == reference_counts(mb, 2) and min(want["counts"]) > 0
        for rank, results in enumerate(cp_mtp_results):
            got = results[name]
            assert got["rows"] == (name == "sparse"), "the share's head runs on its supervised rows"
            assert torch.equal(got["counts"], want["counts"]), rank
            assert torch.equal(got["scored"], want["counts"]), "the shares' scored positions add up to the pack's"
            for k in (1, 2):
                key = f"mtp_loss_{k}"
                torch.testing.assert_close(got["logged"][key], want["logged"][key], **CP_TOL, msg=f"{rank} {key}")
            assert got["grads"].keys() == want["grads"].keys() and "mtp.1.eh_proj.weight" in want["grads"]
            for key, grad in want["grads"].items():
                message = f"rank {rank} {key}"
                torch.testing.assert_close(got["grads"][key], grad, **CP_TOL, msg=lambda m, n=message: f"{n}: {m}")


def _mtp_step(model, mb, ranks: DataRanks) -> dict:
    """One step of ``model`` on ``mb`` as ``LanguageModule`` takes it: the next-token loss over the ranks' tokens plus
    :class:`MTPLosses`' term, both scaled by the ranks (the gradient reduction averages them); the logged losses,
    the step's counts, the positions this rank scored (summed over the ranks) and the gradients (averaged)."""
    losses = MTPLosses(2, 0.3)
    losses.start_step(1, torch.device("cpu"))
    losses.count_step([mb], ranks)
    out = model(seq_ctx=mb.seq_ctx, labels=mb.labels, return_logits=False)
    tokens = ranks.sum(torch.tensor(float(mb.num_tokens)))
    (out.loss_sum / tokens * ranks.size + losses.extra_loss(out, ranks)).backward()
    losses.after_optimizer_step(model, [out.extras], torch.ones(()), ranks)
    grads = {}
    for key, param in model.named_parameters():
        if param.grad is not None:
            grads[key] = ranks.sum(param.grad.clone()) / ranks.size
    scored = ranks.sum(out.extras["mtp_num_tokens"].clone())
    return {"logged": losses.step_metrics(), "counts": losses._tokens.long(), "scored": scored, "grads": grads}


def _cp_mtp_worker(rank: int, port: int, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    ranks = DataRanks(2, lambda t: (dist.all_reduce(t), t)[1])
    results = {}
    for name, (lengths, tail) in CP_PACKS.items():
        model = initialized(tiny_config(mtp_layers=2))
        for module in model.attention_modules():  # the MTP depths' attention too
            module.use_context_parallel(dist.group.WORLD)
        share = split_for_context_parallel(pack(lengths, tail), rank, 2)
        results[name] = {**_mtp_step(model, share, ranks), "rows": share.seq_ctx.loss_positions is not None}
    torch.save(results, f"{out_path}.{rank}")
    dist.destroy_process_group()
