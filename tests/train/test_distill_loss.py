"""The generalized JSD of :mod:`xtl.train.distill_loss` against TRL's ``GKDTrainer.generalized_jsd_loss``, and the
chunked path against the plain one (loss and gradients).

Tolerances: against TRL in fp32, ``1e-6`` absolute and relative (the same operations in the same order: measured
bitwise equal); chunked against plain in fp64, ``1e-10`` (the chunked path sums per-chunk partial sums and
gradients in another order: measured within ``1e-13``).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from xtl.train.distill_loss import chunked_jsd_sum, generalized_jsd_loss, token_jsd

with warnings.catch_warnings():  # "You are importing from 'trl.experimental'"
    warnings.simplefilter("ignore")
    from trl.experimental.gkd.gkd_trainer import GKDTrainer

BETAS = [0.0, 0.5, 1.0]
TEMPERATURES = [1.0, 0.9]
TRL_TOL = {"rtol": 1e-6, "atol": 1e-6}
CHUNK_TOL = {"rtol": 1e-10, "atol": 1e-10}


def _logits(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (3.0 * torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)).requires_grad_()


def _labels(batch: int, length: int, vocab: int) -> torch.Tensor:
    labels = torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(7))
    labels[0, :2] = -100  # a prompt
    labels[1, -3:] = -100  # padding
    return labels


class TestAgainstTRL:
    @pytest.mark.parametrize("beta", BETAS)
    @pytest.mark.parametrize("temperature", TEMPERATURES)
    def test_batchmean_loss_and_gradient(self, beta, temperature):
        student, teacher = _logits(2, 6, 17, seed=0), _logits(2, 6, 17, seed=1)
        labels = _labels(2, 6, 17)
        want = GKDTrainer.generalized_jsd_loss(student, teacher, labels, beta=beta, temperature=temperature)
        (want_grad,) = torch.autograd.grad(want, student)
        got = generalized_jsd_loss(student, teacher, labels, beta=beta, temperature=temperature)
        (got_grad,) = torch.autograd.grad(got, student)
        torch.testing.assert_close(got, want, **TRL_TOL)
        torch.testing.assert_close(got_grad, want_grad, **TRL_TOL)
        assert got.item() > 0

    @pytest.mark.parametrize("reduction", ["sum", "mean", "none", "batchmean"])
    @pytest.mark.parametrize("with_labels", [True, False])
    def test_reductions(self, reduction, with_labels):
        student, teacher = _logits(2, 6, 17, seed=2), _logits(2, 6, 17, seed=3)
        labels = _labels(2, 6, 17) if with_labels else None
        want = GKDTrainer.generalized_jsd_loss(student, teacher, labels, beta=0.3, reduction=reduction)
        got = generalized_jsd_loss(student, teacher, labels, beta=0.3, reduction=reduction)
        torch.testing.assert_close(got, want, **TRL_TOL)

    def test_beta_ends_are_forward_and_reverse_kl(self):
        student, teacher = _logits(4, 9, seed=4, dtype=torch.float64), _logits(4, 9, seed=5, dtype=torch.float64)
        s, t = student.log_softmax(-1), teacher.log_softmax(-1)
        forward = (t.exp() * (t - s)).sum(-1)
        reverse = (s.exp() * (s - t)).sum(-1)
        torch.testing.assert_close(token_jsd(student, teacher, beta=0.0), forward, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(token_jsd(student, teacher, beta=1.0), reverse, rtol=1e-12, atol=1e-12)

    def test_a_fully_masked_batch_is_zero(self):
        student, teacher = _logits(1, 3, 5, seed=6), _logits(1, 3, 5, seed=7)
        labels = torch.full((1, 3), -100)
        assert generalized_jsd_loss(student, teacher, labels).item() == 0.0


class TestChunked:
    """Hidden states and heads (student ``C=8``, teacher ``C_t=12``, ``V=50``), 37 positions in chunks of 5."""

    def _inputs(self):
        dtype = torch.float64
        gen = torch.Generator().manual_seed(11)
        hidden = torch.randn(37, 8, generator=gen, dtype=dtype).requires_grad_()
        weight = torch.randn(50, 8, generator=gen, dtype=dtype).requires_grad_()
        teacher_hidden = torch.randn(37, 12, generator=gen, dtype=dtype).requires_grad_()
        teacher_weight = torch.randn(50, 12, generator=gen, dtype=dtype).requires_grad_()
        mask = torch.rand(37, generator=gen) > 0.3
        return hidden, weight, teacher_hidden, teacher_weight, mask

    @pytest.mark.parametrize("beta", BETAS)
    @pytest.mark.parametrize("temperature", TEMPERATURES)
    @pytest.mark.parametrize("top_k", [None, 7])
    def test_equals_the_plain_path_in_loss_and_gradients(self, beta, temperature, top_k):
        hidden, weight, teacher_hidden, teacher_weight, mask = self._inputs()
        settings = {"beta": beta, "temperature": temperature, "top_k": top_k}
        labels = torch.where(mask, 0, -100)
        plain = generalized_jsd_loss(hidden @ weight.t(), teacher_hidden @ teacher_weight.t(), labels, **settings,
                                     reduction="sum")  # fmt: skip
        want = torch.autograd.grad(plain, (hidden, weight))
        chunked = chunked_jsd_sum(hidden, teacher_hidden, mask, **settings, student_weight=weight,
                                  teacher_weight=teacher_weight, chunk_bytes=4 * 50 * 5)  # fmt: skip
        got = torch.autograd.grad(chunked, (hidden, weight))
        torch.testing.assert_close(chunked, plain, **CHUNK_TOL)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, **CHUNK_TOL)

    def test_student_logits_and_teacher_head(self):
        """The sharded student's form: its logits (from its forward), the teacher's hidden states and head."""
        hidden, weight, teacher_hidden, teacher_weight, mask = self._inputs()
        logits = (hidden @ weight.t()).detach().requires_grad_()
        plain = generalized_jsd_loss(logits, teacher_hidden @ teacher_weight.t(), torch.where(mask, 0, -100),
                                     reduction="sum")  # fmt: skip
        (want,) = torch.autograd.grad(plain, logits)
        chunked = chunked_jsd_sum(logits, teacher_hidden, mask, teacher_weight=teacher_weight, chunk_bytes=4 * 50 * 5)
        (got,) = torch.autograd.grad(chunked, logits)
        torch.testing.assert_close(chunked, plain, **CHUNK_TOL)
        torch.testing.assert_close(got, want, **CHUNK_TOL)

    def test_the_teacher_gets_no_gradient_and_no_grad_mode_computes_the_loss(self):
        hidden, weight, teacher_hidden, teacher_weight, mask = self._inputs()
        loss = chunked_jsd_sum(hidden, teacher_hidden, mask, student_weight=weight, teacher_weight=teacher_weight)
        loss.backward()
        assert teacher_hidden.grad is None and teacher_weight.grad is None
        assert hidden.grad is not None and weight.grad is not None
        assert hidden.grad[~mask].abs().max().item() == 0.0
        with torch.no_grad():
            again = chunked_jsd_sum(hidden, teacher_hidden, mask, student_weight=weight, teacher_weight=teacher_weight)
        torch.testing.assert_close(again, loss.detach(), **CHUNK_TOL)


class TestTopK:
    def test_restricts_both_distributions_to_the_teachers_top_k_and_renormalizes(self):
        student, teacher = _logits(6, 20, seed=8, dtype=torch.float64), _logits(6, 20, seed=9, dtype=torch.float64)
        index = teacher.topk(4, dim=-1).indices
        s = student.gather(-1, index).log_softmax(-1)
        t = teacher.gather(-1, index).log_softmax(-1)
        want = (t.exp() * (t - s)).sum(-1)
        got = token_jsd(student, teacher, beta=0.0, top_k=4)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        (grad,) = torch.autograd.grad(got.sum(), student)
        outside = torch.ones_like(grad, dtype=torch.bool).scatter_(-1, index, False)
        assert grad[outside].abs().max().item() == 0.0
        assert grad[~outside].abs().max().item() > 0.0

    def test_top_1_is_zero_and_the_whole_vocabulary_is_the_full_divergence(self):
        student, teacher = _logits(3, 10, seed=10, dtype=torch.float64), _logits(3, 10, seed=11, dtype=torch.float64)
        assert token_jsd(student, teacher, beta=0.5, top_k=1).abs().max().item() < 1e-12
        torch.testing.assert_close(
            token_jsd(student, teacher, beta=0.5, top_k=10), token_jsd(student, teacher, beta=0.5), rtol=0, atol=0
        )
        assert not torch.allclose(
            token_jsd(student, teacher, beta=0.5, top_k=3), token_jsd(student, teacher, beta=0.5)
        )
