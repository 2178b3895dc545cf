"""Generate the tiny vision-language preference sets in ``xtl/assets/tiny_vlm/`` from its SFT rows (deterministic).

    python scripts/make_tiny_vlm_preference.py [--out xtl/assets/tiny_vlm] [--seed 0]

Reads ``train.jsonl`` / ``eval.jsonl`` (written by ``scripts/make_tiny_vlm_assets.py``; run that first) and reuses
their images. Each SFT row is a question about one image and its right answer; its preference pair keeps the question
(image part first, then the text) as the prompt, the right answer as ``chosen`` and, as ``rejected``, a wrong answer
to the same question drawn at random from the answers the training rows give to it (another color, another shape,
another count). Writes

- ``preference_train.jsonl``: the first ``NUM_TRAIN`` training rows as pairs (explicit prompt, conversational);
- ``preference_eval.jsonl``: every held-out row as a pair (its images are never trained on);
- ``kto_train.jsonl`` / ``kto_eval.jsonl``: the same prompts as unpaired rows, each once, even rows with the
  chosen answer labeled ``true``, odd rows with the rejected one labeled ``false``.

Image paths stay relative to the folder of the JSONL files.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NUM_TRAIN = 600  # pairs (and KTO rows) from the first training rows
ASSETS = Path(__file__).resolve().parents[1] / "xtl" / "assets" / "tiny_vlm"


def main() -> None:
    """Write the four files."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ASSETS)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out: Path = args.out
    rng = random.Random(f"vlm-preference-{args.seed}")
    sft = {split: read_jsonl(out / f"{split}.jsonl") for split in ("train", "eval")}
    answers: dict[str, set[str]] = {}
    for row in sft["train"]:
        user, assistant = row["messages"]
        answers.setdefault(question_of(user), set()).add(assistant["content"])
    wrong = {question: sorted(options) for question, options in answers.items()}
    pairs = {
        split: [pair_of(r, wrong, rng) for r in rows]
        for split, rows in (("train", sft["train"][:NUM_TRAIN]), ("eval", sft["eval"]))
    }
    for split, rows in pairs.items():
        write_jsonl(out / f"preference_{split}.jsonl", rows)
        write_jsonl(out / f"kto_{split}.jsonl", unpaired_rows(rows))
    print(f"wrote {len(pairs['train'])} + {len(pairs['eval'])} pairs and as many KTO rows to {out}")


def pair_of(row: dict, answers: dict[str, list[str]], rng: random.Random) -> dict:
    """The preference pair of one SFT row: its question as the prompt, its answer chosen, a wrong one rejected.

    Args:
        row: ``{"messages": [user (image, question), assistant (answer)]}``.
        answers: Every answer the training rows give to each question, sorted.
        rng: Random source of the wrong answer.

    Returns:
        dict: ``{"prompt": [user], "chosen": [assistant], "rejected": [assistant]}``.
    """
    user, assistant = row["messages"]
    answer = assistant["content"]
    wrong = rng.choice([a for a in answers[question_of(user)] if a != answer])
    return {
        "prompt": [user],
        "chosen": [{"role": "assistant", "content": answer}],
        "rejected": [{"role": "assistant", "content": wrong}],
    }


def question_of(user: dict) -> str:
    """The text part of a user turn (the question about its image)."""
    return next(part["text"] for part in user["content"] if part["type"] == "text")


def unpaired_rows(pairs: list[dict]) -> list[dict]:
    """KTO rows from pairs: each prompt once, the chosen answer labeled true (even rows) or the rejected one false."""
    return [
        {"prompt": p["prompt"], "completion": p["chosen" if i % 2 == 0 else "rejected"], "label": i % 2 == 0}
        for i, p in enumerate(pairs)
    ]


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a JSONL file."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """One row per line."""
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
