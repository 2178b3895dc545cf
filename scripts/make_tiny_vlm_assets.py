"""Generate the embedded tiny vision-language task in ``xtl/assets/tiny_vlm/`` (deterministic, no downloads).

    python scripts/make_tiny_vlm_assets.py [--out xtl/assets/tiny_vlm] [--seed 0]

Writes

- ``tokenizer.json`` / ``tokenizer_config.json`` / ``chat_template.jinja``: the embedded tiny tokenizer
  (``xtl/assets/tiny``) plus the Qwen-VL vision tokens ``<|vision_start|>``, ``<|vision_end|>``,
  ``<|image_pad|>`` (ids 1542, 1543, 1544);
- ``images/NNNN.png``: 64x64 PNGs with 1-3 shapes of one kind (circle, square, triangle) and one color (red, green,
  blue, yellow) on a white background, one shape per quadrant;
- ``train.jsonl`` (every training image with each of the three questions, shuffled) / ``eval.jsonl`` (one random
  question per held-out image, with its ``"answer"`` and ``"question"`` kind), in the HF/Qwen content format:
  "What color are the shapes?", "What shape are they?", "How many shapes are there?".
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
from pathlib import Path

from PIL import Image, ImageDraw
from transformers import AutoTokenizer

from xtl.data.tiny import tiny_assets_dir

SIZE = 64
NUM_TRAIN = 1500  # images; each is asked all three questions
NUM_EVAL = 150  # images; one random question each
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
COLORS = {"red": (220, 30, 30), "green": (30, 170, 40), "blue": (30, 60, 220), "yellow": (235, 200, 20)}
SHAPES = ("circle", "square", "triangle")
QUESTIONS = {
    "color": "What color are the shapes?",
    "shape": "What shape are they?",
    "count": "How many shapes are there?",
}


def main() -> None:
    """Write the assets."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=tiny_assets_dir().parent / "tiny_vlm")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out: Path = args.out
    if (out / "images").exists():
        shutil.rmtree(out / "images")
    (out / "images").mkdir(parents=True)
    tokenizer = AutoTokenizer.from_pretrained(tiny_assets_dir())
    tokenizer.add_tokens(VISION_TOKENS, special_tokens=True)
    tokenizer.save_pretrained(out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    for key in ("is_local", "local_files_only"):  # machine-specific keys save_pretrained adds
        config.pop(key, None)
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    rng = random.Random(args.seed)
    train = [r for i in range(NUM_TRAIN) for r in make_records(i, rng, out / "images")]
    rng.shuffle(train)
    held_out = [rng.choice(make_records(i, rng, out / "images")) for i in range(NUM_TRAIN, NUM_TRAIN + NUM_EVAL)]
    write_jsonl(out / "train.jsonl", train, with_answer=False)
    write_jsonl(out / "eval.jsonl", held_out, with_answer=True)
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"wrote {NUM_TRAIN + NUM_EVAL} images, {len(train)} + {len(held_out)} records ({total / 1e6:.2f} MB)")


def make_records(index: int, rng: random.Random, image_dir: Path) -> list[dict]:
    """Draw one image and ask each question about it.

    Args:
        index: Image number (file name).
        rng: Random source.
        image_dir: Where the PNG goes.

    Returns:
        list[dict]: ``{"messages": [...], "answer": str, "question": kind}`` per question kind.
    """
    color, shape, count = rng.choice(list(COLORS)), rng.choice(SHAPES), rng.randint(1, 3)
    draw_image(color, shape, count, rng).save(image_dir / f"{index:04d}.png", optimize=True)
    records = []
    for kind, question in QUESTIONS.items():
        answer = {"color": color, "shape": shape, "count": str(count)}[kind]
        content = [{"type": "image", "image": f"images/{index:04d}.png"}, {"type": "text", "text": question}]
        messages = [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]
        records.append({"messages": messages, "answer": answer, "question": kind})
    return records


def draw_image(color: str, shape: str, count: int, rng: random.Random) -> Image.Image:
    """``count`` shapes of one kind and color, each in its own quadrant, jittered in place and size."""
    image = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    half = SIZE // 2
    for cell in rng.sample(range(4), count):
        x0, y0 = (cell % 2) * half, (cell // 2) * half
        side = rng.randint(14, 22)
        x, y = x0 + rng.randint(2, half - side - 2), y0 + rng.randint(2, half - side - 2)
        box = (x, y, x + side, y + side)
        fill = COLORS[color]
        if shape == "circle":
            draw.ellipse(box, fill=fill)
        elif shape == "square":
            draw.rectangle(box, fill=fill)
        else:
            draw.polygon([(x + side / 2, y), (x, y + side), (x + side, y + side)], fill=fill)
    return image


def write_jsonl(path: Path, records: list[dict], with_answer: bool) -> None:
    """One record per line (``answer`` and ``question`` kept only for evaluation files)."""
    with path.open("w", encoding="utf-8") as f:
        for r in records:
            row = r if with_answer else {"messages": r["messages"]}
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
