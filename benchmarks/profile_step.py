"""Where a training step's time goes, by op, for xtl and transformers on the tiny recipe's model and token mix.

Usage::

    python benchmarks/profile_step.py [--threads 1 --steps 10 --warmup 3 --top 15 --compile none|layers|model
                                       --no-fused --precision bf16-mixed|32-true]

Method:

1. Model: the tiny recipe's Qwen3 (vocab 1600, hidden 128, intermediate 384, 4 layers, 4 heads, 2 kv heads,
   head_dim 32, tied embeddings), random init with seed 0, saved once as an HF directory; transformers loads it
   with SDPA, xtl with ``from_hf`` (``attn_impl: sdpa``; fused q/k/v and gate/up unless ``--no-fused``;
   ``--compile`` applies xtl's ``Compile`` callback, inductor, before the warm-up steps).
2. Tokens: documents with the tiny task's shape (lengths 16..60 tokens, 28% of each document's labels
   supervised: the assistant turn at its end), drawn with seed 0 until they fill two 512-token packs. xtl gets the
   two packs (``SequenceContext`` with the documents' bounds and ``loss_positions``, its collate's contract);
   transformers gets the same documents as one batch padded to the longest, labels -100 outside the supervised
   tokens and on padding (what ``transformers.Trainer`` with ``group_by_length`` feeds it). Both score the same
   tokens.
3. One step: forward with loss under the precision (``bf16-mixed``: CPU autocast bf16 around the forward, fp32
   weights), backward, fused AdamW step, ``zero_grad(set_to_none)``. Threads pinned (``--threads``), ``--warmup``
   untimed steps per side, then ``--steps`` steps per side under ``torch.profiler`` (CPU activities), the sides
   alternating step by step.
4. Printed per side: milliseconds per step (profiled, so a little slower than unprofiled), and the ``--top`` ops by
   self CPU time per step with their share and call count per step -- the remaining cost by op. This script
   explains ``train_step.py``'s breakdown; it makes no speed claim of its own.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from _paired import load_average, pin_threads, print_configs

PACK, PACKS, VOCAB = 512, 2, 1600
SUPERVISED = 0.28  # the tiny task's share of supervised tokens
SIDES = ("xtl", "transformers")


def main() -> None:
    """Parse arguments, build both sides on the same weights and tokens, profile them alternately, print."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10, help="profiled steps per side")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per side first")
    parser.add_argument("--top", type=int, default=15, help="ops listed per side")
    parser.add_argument("--compile", default="none", choices=["none", "layers", "model"])
    parser.add_argument("--no-fused", action="store_true", help="xtl with separate q/k/v and gate/up projections")
    parser.add_argument("--precision", default="bf16-mixed", choices=["bf16-mixed", "32-true"])
    args = parser.parse_args()
    pin_threads(args.threads)
    _quiet()
    print(f"load average before: {load_average()}")
    docs = _documents()
    with tempfile.TemporaryDirectory(prefix="xtl-profile-") as tmp:
        _save_model(Path(tmp))
        steps = {side: _step_fn(side, Path(tmp), docs, args) for side in SIDES}
    print_configs(**_configs(args, docs))
    for _ in range(args.warmup):
        for side in SIDES:
            steps[side]()
    spent = dict.fromkeys(SIDES, 0.0)
    ops: dict[str, dict[str, list[float]]] = {side: {} for side in SIDES}
    for i in range(args.steps):
        for side in SIDES if i % 2 == 0 else SIDES[::-1]:
            with (
                _stderr_silenced(),
                torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile,
            ):
                start = time.perf_counter()
                steps[side]()
                spent[side] += time.perf_counter() - start
            for event in profile.key_averages():
                totals = ops[side].setdefault(event.key, [0.0, 0])
                totals[0] += event.self_cpu_time_total
                totals[1] += event.count
    for side in SIDES:
        print(f"\n[{side}] {spent[side] / args.steps * 1e3:.1f} ms per step (profiled, {args.steps} steps)")
        print(_top_ops(ops[side], args.steps, args.top))
    print(f"\nload average after: {load_average()}")


def _top_ops(ops: dict[str, list[float]], steps: int, top: int) -> str:
    """The ``top`` ops by self CPU time: ms per step, share of all ops' self time, calls per step."""
    total = sum(us for us, _ in ops.values()) or 1.0
    rows = sorted(ops.items(), key=lambda kv: -kv[1][0])[:top]
    lines = [f"  {'op':60s} {'ms/step':>8s} {'share':>6s} {'calls/step':>10s}"]
    for name, (us, calls) in rows:
        lines.append(f"  {name[:60]:60s} {us / steps / 1e3:8.2f} {us / total:6.1%} {calls / steps:10.1f}")
    lines.append(f"  {'all ops (self CPU)':60s} {total / steps / 1e3:8.2f}")
    return "\n".join(lines)


# ---- sides ------------------------------------------------------------------------------------------------------


def _documents() -> list[tuple[list[int], int]]:
    """``(token ids, supervised tail length)`` per document, filling ``PACKS`` packs of ``PACK`` tokens."""
    rng = random.Random(0)
    docs, used = [], 0
    while True:
        length = rng.randint(16, 60)
        if used + length > PACK * PACKS:
            return docs
        docs.append(([rng.randrange(VOCAB) for _ in range(length)], max(1, round(length * SUPERVISED))))
        used += length


def _save_model(path: Path) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, tie_word_embeddings=True, max_position_embeddings=1024,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(path)


def _step_fn(side: str, path: Path, docs: list[tuple[list[int], int]], args: argparse.Namespace) -> Callable[[], None]:
    """One step of ``side`` (forward with loss, backward, fused AdamW, zero_grad) on the documents."""
    model, forwards = _xtl(path, docs, args) if side == "xtl" else _transformers(path, docs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    autocast = args.precision == "bf16-mixed"

    def step() -> None:
        for forward in forwards:
            with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
                loss = forward()
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _labels(ids: list[int], supervised: int) -> list[int]:
    return [-100] * (len(ids) - supervised) + ids[len(ids) - supervised :]


def _xtl(path: Path, docs: list[tuple[list[int], int]], args: argparse.Namespace) -> tuple[torch.nn.Module, list]:
    from xtl.batch import SequenceContext
    from xtl.callbacks import Compile
    from xtl.ops import shift_labels
    from xtl.train.model_spec import resolve_model_config

    config, _ = resolve_model_config(str(path), {"attn_impl": "sdpa", "fused_projections": not args.no_fused})
    model = config.build()
    model.from_hf(path)
    model.train()
    if args.compile != "none":
        Compile(scope=args.compile).transform_model(model)
    packs: list[list[tuple[list[int], int]]] = [[] for _ in range(PACKS)]
    for doc in docs:  # first fit into the packs
        next(p for p in packs if sum(len(d) for d, _ in p) + len(doc[0]) <= PACK).append(doc)
    forwards = []
    for pack in packs:
        ids = [t for d, _ in pack for t in d]
        pad = PACK - len(ids)
        lengths = [len(d) for d, _ in pack] + ([pad] if pad else [])
        labels = torch.tensor([[t for d, s in pack for t in _labels(d, s)] + [-100] * pad])
        seq_ctx = SequenceContext.from_lengths(torch.tensor([ids + [0] * pad]), lengths, num_padding=pad)
        targets = _shift_within_documents(shift_labels(labels), seq_ctx.doc_bounds)
        seq_ctx.loss_positions = (targets[0] != -100).nonzero().squeeze(1)
        forwards.append(lambda c=seq_ctx, t=targets: model(seq_ctx=c, labels=t, return_logits=False).loss_sum)
    return model, forwards


def _shift_within_documents(targets: torch.Tensor, bounds: tuple[int, ...]) -> torch.Tensor:
    """No target crosses into the next document: each document's last position is ignored."""
    targets = targets.clone()
    targets[0, [b - 1 for b in bounds[1:]]] = -100
    return targets


def _transformers(path: Path, docs: list[tuple[list[int], int]]) -> tuple[torch.nn.Module, list]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").train()
    longest = max(len(d) for d, _ in docs)
    ids = torch.tensor([d + [0] * (longest - len(d)) for d, _ in docs])
    mask = torch.tensor([[1] * len(d) + [0] * (longest - len(d)) for d, _ in docs])
    labels = torch.tensor([_labels(d, s) + [-100] * (longest - len(d)) for d, s in docs])
    return model, [lambda: model(input_ids=ids, attention_mask=mask, labels=labels).loss]


def _configs(args: argparse.Namespace, docs: list[tuple[list[int], int]]) -> dict[str, dict[str, object]]:
    longest = max(len(d) for d, _ in docs)
    common = {
        "precision": args.precision,
        "documents": f"{len(docs)} ({sum(len(d) for d, _ in docs)} tokens, {sum(s for _, s in docs)} supervised)",
        "optimizer": "fused AdamW",
        "threads": torch.get_num_threads(),
    }
    return {
        "xtl": {
            **common,
            "batch": f"{PACKS} packs x {PACK} tokens (first fit), one forward/backward each",
            "attention": "sdpa per document [xtl-only]",
            "projections": "separate" if args.no_fused else "q/k/v and gate/up fused [xtl-only]",
            "head+loss": "fused chunked LM head + CE on supervised rows",
            "compile": args.compile,
        },
        "transformers": {
            **common,
            "batch": f"{len(docs)} x {longest} padded to the longest, one forward/backward",
            "attention": "sdpa (padding mask)",
            "projections": "separate",
            "head+loss": "full logits, ForCausalLMLoss",
            "compile": "none",
        },
    }


@contextlib.contextmanager
def _stderr_silenced() -> Iterator[None]:
    """Drop what native code writes to stderr (the profiler's start/stop lines) while profiling."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def _quiet() -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)


if __name__ == "__main__":
    sys.exit(main())
