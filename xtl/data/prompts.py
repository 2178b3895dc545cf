"""Prompt data for RL (``kind: prompt`` sources): rows with a prompt, a reference answer and a data source, drawn
in a resumable order.

A row of a prompt source is a JSONL object with ``messages`` (a trailing assistant turn is the reference answer,
not part of the prompt) or ``prompt`` (messages or text), and optionally ``answer`` (the reference answer; it wins
over a trailing assistant turn) and ``data_source`` (judgers route on it; default: the source's ``data_source``).
A source's ``match`` keeps the rows whose last user message matches a regular expression (e.g. the arithmetic part
of a mixed set; the text parts of a message whose content is a list of parts).

A message's content may be a list of parts, as in chat SFT data for vision-language models
(:mod:`xtl.data.multimodal`): ``{"type": "text", "text": ...}`` and ``{"type": "image", "image": path}``. Image paths
are resolved relative to the JSONL file's folder (as the SFT path does) and must exist; the row keeps its image parts,
with absolute paths, and lists the paths under ``images`` in order of appearance (absent for a row without images).

The RL module draws its prompts itself (:meth:`PromptSet.take`): how many depends on what it filters and refills,
which a data loader cannot know ahead. The order is a seeded permutation per epoch; the state is one number, the
prompts consumed by all ranks. Several tasks in one run draw per task (:meth:`PromptSet.take_task`: the rows of one
``data_source``, in an order of their own, with a count of their own).
"""

from __future__ import annotations

import json
import re
import zlib
from pathlib import Path
from typing import Any

import torch

from xtl.data.item import DataError
from xtl.data.sources import SourceSpec
from xtl.utils import resolve_path

PROMPT_KIND = "prompt"


class PromptSet:
    """The rows of ``kind: prompt`` sources and the resumable order they are drawn in.

    Args:
        sources: The sources (concatenated in order).
        seed: Seed of the order.
        key: The YAML key of the sources, for error messages.
    """

    def __init__(self, sources: list[SourceSpec], seed: int = 0, key: str = "data.sources") -> None:
        self.sources = list(sources)
        self.seed = seed
        self.key = key
        self.consumed = 0
        self.task_consumed: dict[str, int] = {}  # per task (data_source), by all ranks (take_task)
        self._rows: list[dict[str, Any]] | None = None
        self._task_rows: dict[str, list[dict[str, Any]]] = {}

    @property
    def rows(self) -> list[dict[str, Any]]:
        """The rows (read once): ``prompt`` (messages), ``answer``, ``data_source``, ``index`` and, for a row with
        images, ``images`` (their absolute paths).

        Raises:
            DataError: No row at all, or a bad source (see :func:`read_prompt_rows`).
        """
        if self._rows is None:
            self._rows = read_prompt_rows(self.sources)
            if not self._rows:
                raise DataError(f"{self.key}: no prompt row in {', '.join(s.path for s in self.sources)}")
        return self._rows

    def take(self, count: int, rank: int = 0, world_size: int = 1) -> list[dict[str, Any]]:
        """This rank's next ``count`` rows; every rank calls it together (all ranks consume ``count`` each)."""
        rows, out = self.rows, []
        for i in range(count):
            epoch, offset = divmod(self.consumed + i * world_size + rank, len(rows))
            out.append(rows[int(self._order(epoch, len(rows))[offset])])
        self.consumed += count * world_size
        return out

    @property
    def tasks(self) -> list[str]:
        """The rows' ``data_source`` values, in order of first appearance."""
        return list(dict.fromkeys(row["data_source"] for row in self.rows))

    def take_task(self, task: str, count: int, rank: int = 0, world_size: int = 1) -> list[dict[str, Any]]:
        """This rank's next ``count`` rows of ``task`` (rows whose ``data_source`` is ``task``), in a seeded order
        of that task's own; every rank calls it together.

        Raises:
            DataError: No row has that ``data_source``.
        """
        if task not in self._task_rows:
            rows = [row for row in self.rows if row["data_source"] == task]
            if not rows:
                raise DataError(
                    f"model.init_args.rollout.tasks: no prompt row of {self.key} has data_source {task!r} "
                    f"(they have: {', '.join(self.tasks)})"
                )
            self._task_rows[task] = rows
        rows, out, done = self._task_rows[task], [], self.task_consumed.get(task, 0)
        salt = zlib.crc32(task.encode())
        for i in range(count):
            epoch, offset = divmod(done + i * world_size + rank, len(rows))
            out.append(rows[int(self._order(epoch, len(rows), salt)[offset])])
        self.task_consumed[task] = done + count * world_size
        return out

    def loader(self, batch_size: int) -> torch.utils.data.DataLoader:
        """Every row in file order, ``batch_size`` at a time, the same on every rank (evaluation)."""
        return torch.utils.data.DataLoader(self.rows, batch_size=batch_size, collate_fn=list)

    def _order(self, epoch: int, size: int, salt: int = 0) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch + salt * 7_919)
        return torch.randperm(size, generator=generator)


class StepTickets(torch.utils.data.IterableDataset):
    """Endless step numbers: the train "batches" of an RL run, whose module draws its own prompts."""

    def __iter__(self):  # noqa: ANN204
        step = 0
        while True:
            yield step
            step += 1


def read_prompt_rows(sources: list[SourceSpec]) -> list[dict[str, Any]]:
    """The rows of ``sources``, in order, as ``{"prompt", "answer", "data_source", "index"}`` (and ``images``, the
    absolute paths of a row's images, when it has some).

    Raises:
        DataError: A missing file, a bad line (``file:line``), a bad ``match`` pattern, a missing image.
    """
    rows: list[dict[str, Any]] = []
    for source in sources:
        path = Path(resolve_path(source.path))
        if not path.is_file():
            raise DataError(f"prompt source {path} does not exist (kind: prompt reads JSONL files)")
        try:
            pattern = re.compile(source.match) if source.match else None
        except re.error as err:
            raise DataError(
                f"prompt source {source.path}: match {source.match!r} is not a valid pattern: {err}"
            ) from None
        default_source = source.data_source or source.display_name
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                row = _prompt_row(line, f"{path}:{lineno}", default_source, source.messages_key, path.parent)
                if pattern is None or pattern.search(_last_user_text(row["prompt"])):
                    rows.append({**row, "index": len(rows)})
    return rows


def _prompt_row(line: str, where: str, default_source: str, messages_key: str, root: Path) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(f"{where}: not JSON ({err})") from None
    if not isinstance(record, dict) or not (messages_key in record or "prompt" in record):
        raise DataError(f"{where}: expected an object with {messages_key!r} or 'prompt'")
    answer = record.get("answer")
    if "prompt" in record:
        prompt = record["prompt"]
        prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    else:
        prompt = record[messages_key]
        if prompt and isinstance(prompt[-1], dict) and prompt[-1].get("role") == "assistant":
            answer = prompt[-1].get("content") if answer is None else answer
            prompt = prompt[:-1]
    if not isinstance(prompt, list) or not prompt or not all(isinstance(m, dict) for m in prompt):
        raise DataError(f"{where}: the prompt must be a non-empty list of {{'role': ..., 'content': ...}}")
    images: list[str] = []
    prompt = [_resolve_images(m, where, root, images) for m in prompt]
    row = {"prompt": prompt, "answer": answer, "data_source": record.get("data_source", default_source)}
    if images:
        row["images"] = images
    return row


def _resolve_images(message: dict[str, Any], where: str, root: Path, images: list[str]) -> dict[str, Any]:
    """``message`` with the paths of its image parts made absolute (relative ones are relative to ``root``),
    appended to ``images``."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    parts = []
    for part in content:
        if isinstance(part, dict) and part.get("type") == "image":
            value = part.get("image", part.get("path"))
            if not isinstance(value, str) or not value:
                raise DataError(f"{where}: an image part needs 'image': a file path, got {value!r}")
            path = Path(value).expanduser()
            path = path if path.is_absolute() else root / path
            if not path.is_file():
                raise DataError(f"{where}: image {path} does not exist; fix the path (relative to the JSONL file)")
            images.append(str(path.resolve()))
            part = {**{k: v for k, v in part.items() if k != "path"}, "image": images[-1]}
        parts.append(part)
    return {**message, "content": parts}


def _last_user_text(messages: list[dict[str, Any]]) -> str:
    users = [m.get("content") for m in messages if m.get("role") == "user"]
    if not users:
        return ""
    if isinstance(users[-1], list):  # content parts: their text
        return "".join(str(p.get("text", "")) for p in users[-1] if isinstance(p, dict) and p.get("type") == "text")
    return users[-1] if isinstance(users[-1], str) else ""
