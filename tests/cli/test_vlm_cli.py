"""``xtl fit`` on the tiny vision-language recipe: a few steps log ``train/loss``; a missing image exits 2."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from xtl.command import main

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "configs/tiny_vlm_sft.yaml"


def _run(args: list[str], capsys) -> tuple[int, str]:
    try:
        code = main(args)
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    return code, capsys.readouterr().err


def _args(tmp_path: Path, *extra: str) -> list[str]:
    return [
        "fit",
        "--config",
        str(RECIPE),
        "--trainer.max_steps",
        "3",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.default_root_dir",
        str(tmp_path / "run"),
        "--data.cache_dir",
        str(tmp_path / "cache"),
        *extra,
    ]


class TestTinyVLMRecipe:
    def test_three_steps_log_train_loss(self, tmp_path, capsys):
        code, err = _run(_args(tmp_path, "--data.val_sources", "null"), capsys)
        assert code == 0, err
        metrics = next((tmp_path / "run").glob("logs/version_*/metrics.csv"))
        losses = [float(r["train/loss"]) for r in csv.DictReader(metrics.open()) if r.get("train/loss")]
        assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
        assert losses[-1] < losses[0]

    def test_missing_image_exits_2_naming_file_line_and_image(self, tmp_path, capsys):
        data = tmp_path / "d.jsonl"
        good = json.loads((ROOT / "xtl/assets/tiny_vlm/train.jsonl").read_text().splitlines()[0])
        good["messages"][0]["content"][0]["image"] = str(ROOT / "xtl/assets/tiny_vlm" / "images/0000.png")
        bad = json.loads(json.dumps(good))
        bad["messages"][0]["content"][0]["image"] = "images/gone.png"
        data.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
        sources = f"[{{path: {data}}}]"
        code, err = _run(_args(tmp_path, "--data.sources", sources, "--data.val_sources", "null"), capsys)
        assert code == 2, err
        assert "Traceback" not in err
        assert f"{data}:2: image {tmp_path / 'images/gone.png'} does not exist" in err
