"""One lm-evaluation-harness run on an xtl model: the settings, the task list, the run and its metrics.

Shared by the :class:`~xtl.callbacks.LMEval` callback and ``xtl eval``. A task is named three ways:

- a task or group of lm-eval's registry (``hellaswag``, ``gsm8k``; datasets come through the user's ``datasets``
  cache, ``HF_DATASETS_CACHE``), or of a folder of task YAML given in ``include_path``;
- a task YAML file (``my_tasks/qa.yaml``): its local ``data_files`` are taken relative to the YAML's folder, so a
  JSONL next to it works from any working directory;
- a task shipped with xtl on the tiny domain: ``tiny_choice`` (multiple choice, log-likelihoods: ``acc``,
  ``acc_norm``) and ``tiny_exact`` (generation, ``exact_match``); both want ``apply_chat_template``, as the tiny
  model answers in its chat format.

The run leaves the caller's random state as it found it (Python, NumPy, torch and CUDA generators): lm-eval seeds
them for its few-shot sampling.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import random
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import torch
from tqdm import tqdm

from xtl.errors import ConfigError, did_you_mean
from xtl.utils import TINY_ASSETS_DIR

SHIPPED_TASKS = {
    "tiny_choice": TINY_ASSETS_DIR / "lm_eval" / "tiny_choice.yaml",
    "tiny_exact": TINY_ASSETS_DIR / "lm_eval" / "tiny_exact.yaml",
}
INSTALL_HINT = "lm-evaluation-harness is not installed: pip install 'xtl[eval]' (or pip install lm-eval)"


@dataclass
class EvalSettings:
    """What to evaluate and how (the options of ``LMEval`` and ``xtl eval``).

    Attributes:
        tasks: Task names, task YAML files, or shipped task names (see the module docstring).
        limit: Documents per task (an int), or a fraction of each task (a float < 1); ``None``: all.
        num_fewshot: Few-shot examples per prompt (``None``: the task's own setting).
        batch_size: Requests per packed forward and prompts per decoding batch.
        max_gen_toks: Decoding budget of generation tasks that set none.
        apply_chat_template: Render prompts with the chat template (few-shot examples as turns when
            ``fewshot_as_multiturn``).
        fewshot_as_multiturn: Few-shot examples as alternating user/assistant turns (with the chat template).
        include_path: Folders of task YAML added to lm-eval's registry.
        seed: Seed of lm-eval's few-shot sampling and of its random generators (restored afterwards).
    """

    tasks: list[str] = field(default_factory=list)
    limit: int | float | None = None
    num_fewshot: int | None = None
    batch_size: int = 16
    max_gen_toks: int = 256
    apply_chat_template: bool = False
    fewshot_as_multiturn: bool = False
    include_path: list[str] = field(default_factory=list)
    seed: int = 1234

    def __post_init__(self) -> None:
        if not self.tasks:
            raise ConfigError("tasks: name at least one task (e.g. [tiny_choice, tiny_exact] or [hellaswag])")
        if self.batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.limit is not None and not self.limit > 0:
            raise ConfigError(f"limit must be > 0 (a count, or a fraction < 1), got {self.limit}")
        if self.num_fewshot is not None and self.num_fewshot < 0:
            raise ConfigError(f"num_fewshot must be >= 0, got {self.num_fewshot}")
        if self.fewshot_as_multiturn and not self.apply_chat_template:
            raise ConfigError("fewshot_as_multiturn needs apply_chat_template: true")
        self.tasks = list(self.tasks)
        self.include_path = [str(p) for p in self.include_path]


def require_lm_eval() -> None:
    """Check that lm-eval can be imported.

    Raises:
        ConfigError: It is not installed (with the install command).
    """
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise ConfigError(INSTALL_HINT) from None


def resolve_tasks(settings: EvalSettings) -> tuple[list[str | dict], Any]:
    """The tasks in the form lm-eval takes, and the task manager that knows them.

    Returns:
        ``(tasks, task_manager)``: names of registry tasks, and config dicts of YAML files.

    Raises:
        ConfigError: A name that is neither a file, a shipped task nor a registry task; a YAML file lm-eval cannot
            read.
    """
    require_lm_eval()
    from lm_eval.tasks import TaskManager
    from lm_eval.tasks._yaml_loader import load_yaml

    tasks: list[str | dict] = []
    names = []
    for entry in settings.tasks:
        path = SHIPPED_TASKS.get(entry) or Path(entry)
        if path.suffix in (".yaml", ".yml") or path.is_file():
            if not path.is_file():
                raise ConfigError(f"tasks: {entry} does not exist")
            try:
                config = load_yaml(path)
            except Exception as err:  # noqa: BLE001 - any unreadable task file is the user's to fix
                raise ConfigError(f"tasks: {path} is not a task YAML lm-eval can read ({err})") from None
            tasks.append(_local_data_files(config, path.parent))
        else:
            names.append(entry)
            tasks.append(entry)
    manager = TaskManager(include_path=settings.include_path or None, include_defaults=False, verbosity="ERROR")
    if any(name not in manager.all_tasks for name in names):  # lm-eval's own index (a few seconds to build)
        manager = TaskManager(include_path=settings.include_path or None, verbosity="ERROR")
    known = set(manager.all_tasks)
    for name in names:
        if name not in known:
            hint = did_you_mean(name, known | set(SHIPPED_TASKS))
            raise ConfigError(
                f"tasks: {name!r} is not a task of lm-eval's registry{hint}, a shipped task "
                f"({', '.join(SHIPPED_TASKS)}) or a task YAML file"
            )
    return tasks, manager


def load_tasks(tasks: list[str | dict], manager: Any) -> list[Any]:
    """Build lm-eval's task objects, which loads their datasets: a check that every task's data can be read, made
    before a run starts; the objects go to :func:`run_lm_eval` in place of ``tasks``.

    Data comes from local files, the ``datasets`` cache or the Hugging Face Hub. When a task may need the Hub and
    the Hub cannot be reached (one short request), the datasets load in offline mode, from the cache, so that a
    machine without network fails at once instead of after the Hub client's retries (half a minute per dataset).

    Args:
        tasks: The tasks of :func:`resolve_tasks`.
        manager: Its task manager.

    Returns:
        lm-eval's built tasks and groups, in the order of ``tasks``.

    Raises:
        ConfigError: A task's dataset cannot be loaded (not on the Hub, not in the cache, no network): one line
            naming the task, its dataset, the reason and what to do.
    """
    import datasets
    from huggingface_hub import constants as hub

    offline = bool(datasets.config.HF_HUB_OFFLINE)
    unreachable = None if offline or not any(_may_need_hub(t) for t in tasks) else _hub_unreachable()
    built = []
    for spec in tasks:
        opened: list[str] = []  # the datasets this task opened, the last one failed
        with contextlib.ExitStack() as stack:
            stack.enter_context(preserved_random_state())
            stack.enter_context(_quiet())
            stack.enter_context(_recording_datasets(opened))
            if unreachable:
                for module in (datasets.config, hub):
                    stack.enter_context(mock.patch.object(module, "HF_HUB_OFFLINE", True))
            try:
                loaded = manager.load([spec])
            except OSError as err:  # ConnectionError, FileNotFoundError, the Hub's HTTP errors, ...
                raise ConfigError(_dataset_error(spec, opened, err, offline, unreachable)) from None
        built.extend(_top_level(loaded))
    return built


def run_lm_eval(
    lm: Any, settings: EvalSettings, tasks: list[Any], manager: Any, log_samples: bool = False
) -> dict | None:
    """Evaluate ``lm`` on ``tasks``; the random state of the process is unchanged afterwards.

    Args:
        lm: The model (an lm-eval ``LM``).
        settings: What to evaluate and how.
        tasks: The tasks of :func:`resolve_tasks`, or the task objects :func:`load_tasks` built of them (used once:
            an evaluation changes them).
        manager: Its task manager.
        log_samples: Keep lm-eval's per-sample logs in the results (``samples``: task -> list of records; see
            :func:`write_samples`).

    Returns:
        lm-eval's results on rank 0 of the model's group, ``None`` on the other ranks.
    """
    from lm_eval import simple_evaluate

    with preserved_random_state(), _quiet():
        return simple_evaluate(
            model=lm,
            tasks=tasks,
            num_fewshot=settings.num_fewshot,
            limit=settings.limit,
            log_samples=log_samples,
            apply_chat_template=settings.apply_chat_template,
            fewshot_as_multiturn=settings.fewshot_as_multiturn,
            task_manager=manager,
            random_seed=settings.seed,
            numpy_random_seed=settings.seed,
            torch_random_seed=settings.seed,
            fewshot_random_seed=settings.seed,
            verbosity="ERROR",
        )


def write_samples(results: dict, samples: dict[str, list[dict]], output: Path) -> list[Path]:
    """Write lm-eval's per-sample logs next to the results JSON ``output``, as ``lm_eval --log_samples
    --output_path <output>`` does: one ``samples_<task>_<date>.jsonl`` per task in ``output``'s folder, each record
    in lm-eval's own format (its ``EvaluationTracker`` writes them), and the tasks' sample hashes in ``results``
    (``task_hashes``, as in lm-eval's results file).

    Each file is written in a temporary folder beside ``output`` and renamed into place, so a file under its final
    name is complete.

    Args:
        results: lm-eval's results (without ``samples``); ``task_hashes`` is added.
        samples: The ``samples`` :func:`run_lm_eval` returned with ``log_samples``.
        output: The results JSON the samples go next to.

    Returns:
        The files written, in task order.
    """
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.utils import hash_string

    results["task_hashes"] = {
        task: hash_string("".join(s["doc_hash"] + s["prompt_hash"] + s["target_hash"] for s in records))
        for task, records in samples.items()
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    date_id = datetime.now().isoformat().replace(":", "-")  # lm-eval's run id in its file names
    written = []
    with tempfile.TemporaryDirectory(prefix=f".{output.name}.samples-", dir=output.parent) as tmp:
        tracker = EvaluationTracker(output_path=str(Path(tmp) / "results.json"))  # a .json path: files beside it
        tracker.date_id = date_id
        with _quiet():
            for task in results["configs"]:
                tracker.save_results_samples(task_name=task, samples=samples[task])
                name = f"samples_{task}_{date_id}.jsonl"
                os.replace(Path(tmp) / name, output.parent / name)
                written.append(output.parent / name)
    return written


def flat_metrics(results: dict, prefix: str = "eval") -> dict[str, float]:
    """``{<prefix>/<task>/<metric>: value}`` of lm-eval's results (numbers only; a filter other than ``none`` is
    appended to the metric: ``exact_match/strict-match``; standard errors left out)."""
    flat = {}
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            metric, comma, filter_name = key.partition(",")
            if not comma or "_stderr" in metric or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue  # alias, sample_len, standard errors, N/A
            name = metric if filter_name in ("", "none") else f"{metric}/{filter_name}"
            flat[f"{prefix}/{task}/{name}"] = float(value)
    return flat


@contextlib.contextmanager
def preserved_random_state() -> Iterator[None]:
    """Restore Python's, NumPy's, torch's and CUDA's random generators on exit."""
    py, npy, cpu = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)
        torch.random.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


# ---- private ---------------------------------------------------------------------------------------------------


_HUB_PROBE_TIMEOUT_S = 5.0


def _may_need_hub(task: str | dict) -> bool:
    """Whether a task may load its dataset from the Hub: a registry name, or a config whose ``dataset_path`` is
    neither a local path nor one of ``datasets``' file formats (``json``, ``csv``, ...)."""
    if isinstance(task, str):
        return True
    from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES

    path = str(task.get("dataset_path") or "")
    return bool(path) and path not in _PACKAGED_DATASETS_MODULES and not Path(path).exists()


def _hub_unreachable() -> str | None:
    """Why the Hugging Face Hub cannot be reached (one request through the Hub client's own session: its proxy
    and certificates, no retries), or ``None`` when it answers."""
    from huggingface_hub import constants as hub
    from huggingface_hub import get_session

    try:
        get_session().head(hub.ENDPOINT, timeout=_HUB_PROBE_TIMEOUT_S)
    except Exception as err:  # noqa: BLE001 - any failure to get an answer is "unreachable"
        return f"the Hugging Face Hub ({hub.ENDPOINT}) cannot be reached ({_first_line(err) or type(err).__name__})"
    return None


@contextlib.contextmanager
def _recording_datasets(opened: list[str]) -> Iterator[None]:
    """Append the path (and configuration) of each ``datasets.load_dataset`` call lm-eval makes to ``opened``."""
    import datasets

    load = datasets.load_dataset

    def recording(path: str, name: str | None = None, *args: Any, **kwargs: Any) -> Any:
        opened.append(f"{path} ({name})" if name else str(path))
        return load(path, name, *args, **kwargs)

    with mock.patch.object(datasets, "load_dataset", recording):
        yield


def _dataset_error(spec: str | dict, opened: list[str], err: OSError, offline: bool, unreachable: str | None) -> str:
    """The one-line message of a task whose dataset failed to load."""
    import datasets

    name = spec if isinstance(spec, str) else spec.get("task", "?")
    dataset = f" ({opened[-1]})" if opened else ""
    cache = datasets.config.HF_DATASETS_CACHE
    if offline:
        reason = f"offline mode is on (HF_HUB_OFFLINE) and it is not in the datasets cache ({cache})"
    elif unreachable:
        reason = f"{unreachable} and it is not in the datasets cache ({cache})"
    else:
        reason = _first_line(err) or type(err).__name__
    return (
        f"tasks: lm-eval task {name}: its dataset{dataset} cannot be loaded: {reason}; run once with network access "
        "to fill the datasets cache (HF_DATASETS_CACHE; later runs read it offline), or name a task whose data is "
        "local (a task YAML with data_files)"
    )


def _first_line(err: BaseException) -> str:
    """The first line of an exception's message."""
    return str(err).strip().partition("\n")[0]


def _top_level(loaded: dict) -> list[Any]:
    """The tasks and groups of one ``TaskManager.load`` that no loaded group contains (what was asked for)."""
    children = {child for names in loaded["group_map"].values() for child in names}
    groups = [group for name, group in loaded["groups"].items() if name not in children]
    return groups or [task for name, task in loaded["tasks"].items() if name not in children]


def _local_data_files(config: dict, folder: Path) -> dict:
    """``config`` with relative local ``dataset_kwargs.data_files`` made relative to ``folder`` (the YAML's)."""
    kwargs = dict(config.get("dataset_kwargs") or {})
    files = kwargs.get("data_files")
    if files is None:
        return config

    def absolute(value: Any) -> Any:
        if isinstance(value, str) and not Path(value).is_absolute() and (folder / value).exists():
            return str((folder / value).resolve())
        if isinstance(value, list):
            return [absolute(v) for v in value]
        if isinstance(value, dict):
            return {k: absolute(v) for k, v in value.items()}
        return value

    kwargs["data_files"] = absolute(files)
    return {**config, "dataset_kwargs": kwargs}


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """lm-eval's and datasets' INFO/WARNING chatter and progress bars off while a run evaluates.

    Two module attributes of lm-eval are swapped meanwhile: the progress bar of its request building (it has no
    switch), and its lookup of the working directory's git commit (a ``git`` subprocess that prints an error outside
    a repository; the commit of the working directory says nothing about the model evaluated here).
    """
    import datasets
    import lm_eval.api.task
    import lm_eval.evaluator
    import lm_eval.loggers.utils

    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(lm_eval.api.task, "tqdm", functools.partial(tqdm, disable=True)))
    for module in (lm_eval.evaluator, lm_eval.loggers.utils):
        stack.enter_context(mock.patch.object(module, "get_git_commit_hash", lambda: None))
    loggers = [logging.getLogger(name) for name in ("lm-eval", "lm_eval", "datasets")]
    levels = [logger.level for logger in loggers]
    bars = datasets.utils.logging.is_progress_bar_enabled()
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    datasets.utils.logging.disable_progress_bar()
    try:
        with stack:
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
        if bars:
            datasets.utils.logging.enable_progress_bar()
