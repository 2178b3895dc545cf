"""The recipe reader of ``xtl memory --config``: the memory-relevant settings of ``xtl fit --config ...``.

The files are merged by ``xtl fit``'s own parser, nothing is built. The layout comes from the strategy's
:class:`~xtl.strategies.layout.ParallelLayout` (the sizes a run would use), and every model transform among the
callbacks (activation checkpointing, offload, LoRA, QLoRA, ...) states its own memory settings through
:meth:`~xtl.strategies.parallelize.ModelTransform.memory_settings`, so a new transform is read without a change here.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from xtl.errors import ConfigError, short_message
from xtl.tools._cli import ToolInputError

if TYPE_CHECKING:
    from xtl.strategies.layout import ParallelLayout

GPU_MEMORY_COMMENT = re.compile(r"^#\s*gpu-memory:\s*(\S+)", re.MULTILINE)
# what a recipe means when no callback sets it (``TrainSetup``'s own defaults describe a typical large run)
WITHOUT_A_CALLBACK = {"recompute": "none", "offload": False, "lora_rank": 0, "qlora": False}


@dataclass
class Recipe:
    """The memory-relevant settings of ``xtl fit --config FILE ...``, read by :func:`read_recipe`.

    Attributes:
        files (list[str]): The config files, in merge order.
        model (str | dict | None): ``model.init_args.model`` as written (alias, HF directory, ``env:VAR``, or a
            dict of config fields).
        model_overrides (dict | None): ``model.init_args.model_overrides``.
        setup (dict[str, Any]): The ``TrainSetup`` fields the recipe decides.
        read_from (dict[str, str]): For each setting, the recipe keys it was read from.
        micro_batches_per_step (int): ``data.micro_batches_per_step``.
        gpu_memory (int | None): Bytes of GPU memory the recipe targets (its ``# gpu-memory:`` line).
        gpu_memory_file (str | None): The file that states ``gpu_memory``.
    """

    files: list[str]
    model: str | dict | None
    model_overrides: dict | None
    setup: dict[str, Any]
    read_from: dict[str, str]
    micro_batches_per_step: int = 1
    gpu_memory: int | None = None
    gpu_memory_file: str | None = None

    def to_dict(self) -> dict:
        """Return a JSON-serializable dict.

        Returns:
            dict: The settings.
        """
        return asdict(self)

    def render(self) -> str:
        """Return the settings as text, one ``setting: value (read from)`` line each.

        Returns:
            str: Report text.
        """
        lines = [f"recipe: {' + '.join(self.files)} (merged as xtl fit merges them)"]
        lines += [f"  {key}: {source}" for key, source in self.read_from.items()]
        return "\n".join(lines)


def read_recipe(paths: Sequence[str | Path]) -> Recipe:
    """Read the memory-relevant settings of ``xtl fit --config paths[0] --config paths[1] ...``.

    Read: the model (``model.init_args.model`` and ``model_overrides``), GPUs (``trainer.devices`` x
    ``trainer.num_nodes``), the strategy (``FSDPStrategy``: ZeRO-3 over the layout of its
    ``data_parallel_replicate_size``, ``data_parallel_shard_size`` and ``expert_parallel_size``, and its
    ``param_dtype``), the sequence length (``data.pack_max_length``, one packed sequence per micro-batch),
    ``data.micro_batches_per_step``, the memory settings of every model-transform callback (none set: no recompute,
    no offload, no LoRA), the frozen weights in the dtype ``xtl fit`` stores them (FSDP: fp32; one device:
    ``model.init_args.param_dtype``), and the GPU memory the recipe targets from a ``# gpu-memory: 80GiB`` comment
    line (the last file stating one wins).

    Args:
        paths (Sequence[str | Path]): The recipe, then fragments.

    Returns:
        Recipe: The settings.

    Raises:
        ToolInputError: A missing file or one that does not parse; a layout ``xtl memory`` does not model
            (``devices: auto``, a strategy other than ``FSDPStrategy`` on several GPUs) or one the strategy refuses;
            a callback whose arguments it refuses; two callbacks that decide the same setting (a run applies one
            of each); QLoRA without LoRA.
    """
    files = [str(path) for path in paths]
    for name in files:
        if not Path(name).is_file():
            raise ToolInputError(f"--config {name}: no such file")
    config = _merged_config(files)
    trainer, data = config.get("trainer") or {}, config.get("data") or {}
    module = (config.get("model") or {}).get("init_args") or {}
    setup: dict[str, Any] = {}
    read_from: dict[str, str] = {"model": f"{module.get('model')!r} (model.init_args.model)"}

    devices, nodes = trainer.get("devices", "auto"), trainer.get("num_nodes") or 1
    setup.update(nodes=int(nodes), gpus_per_node=_device_count(devices))
    gpus = setup["nodes"] * setup["gpus_per_node"]
    read_from["gpus"] = f"{gpus} = trainer.devices {devices} x trainer.num_nodes {nodes}"

    strategy_path, strategy_args = _class_and_args(trainer.get("strategy"))
    fsdp = _is_subclass(strategy_path, "xtl.strategies", "FSDPStrategy")
    if fsdp:
        layout = _layout(strategy_args, gpus)
        setup.update(zero=3, dp_replicate=layout.dp_replicate, ep=layout.ep, cp=layout.cp)
        read_from["zero"] = "3 (trainer.strategy FSDPStrategy)"
        read_from["layout"] = (
            f"{layout.describe()}, dp {layout.dp_size} (trainer.strategy.init_args: data_parallel_replicate_size, "
            "data_parallel_shard_size, context_parallel_size, expert_parallel_size)"
        )
    elif gpus > 1:
        raise ToolInputError(
            f"trainer.strategy {strategy_path or trainer.get('strategy')!r} on {gpus} GPUs is not modelled: "
            "xtl memory models xtl.strategies.FSDPStrategy (ZeRO-3)"
        )
    compute_bytes, dtype_source = _compute_dtype_bytes(strategy_args, trainer, module)
    setup.update(param_bytes=compute_bytes, grad_bytes=compute_bytes, act_bytes=compute_bytes)
    read_from["compute dtype"] = f"{compute_bytes}-byte parameters, gradients and activations ({dtype_source})"

    if data.get("pack_max_length") is not None:
        setup.update(seq_len=int(data["pack_max_length"]), micro_batch_size=1)
        read_from["seq_len"] = f"{setup['seq_len']} (data.pack_max_length; one packed sequence per micro-batch)"
    micro_batches = int(data.get("micro_batches_per_step") or 1)
    read_from["micro_batches_per_step"] = f"{micro_batches} (data.micro_batches_per_step)"

    _read_transforms(trainer.get("callbacks") or [], setup, read_from)
    if setup["lora_rank"]:
        frozen, source = _frozen_dtype_bytes(fsdp, trainer, module)
        setup["frozen_bytes"] = frozen
        read_from["frozen weights"] = f"{frozen}-byte ({source})"

    gpu_memory, gpu_memory_file = None, None
    for name in files:
        stated = GPU_MEMORY_COMMENT.findall(Path(name).read_text())
        if stated:
            gpu_memory, gpu_memory_file = parse_memory_size(stated[-1], f"{name}: # gpu-memory:"), name
    return Recipe(
        files=files,
        model=module.get("model"),
        model_overrides=module.get("model_overrides"),
        setup=setup,
        read_from=read_from,
        micro_batches_per_step=micro_batches,
        gpu_memory=gpu_memory,
        gpu_memory_file=gpu_memory_file,
    )


def parse_memory_size(text: str, where: str) -> int:
    """Bytes of a memory size such as ``80GiB`` or ``141GB``.

    Raises:
        ToolInputError: ``text`` is not one, naming ``where``.
    """
    match = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]+)", text.strip())
    if not match or match.group(2).lower() not in _MEMORY_UNITS or float(match.group(1)) <= 0:
        raise ToolInputError(f"{where} {text!r} is not a memory size such as 80GiB, 141GB or 40GiB")
    return int(float(match.group(1)) * _MEMORY_UNITS[match.group(2).lower()])


# ---- private ---------------------------------------------------------------------------------------------------

_MEMORY_UNITS = {"mib": 2**20, "gib": 2**30, "tib": 2**40, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_DTYPE_BYTES = {"bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2, "float32": 4, "fp32": 4, "float": 4}


def _merged_config(files: list[str]) -> dict[str, Any]:
    """The config ``xtl fit --config f1 --config f2 ...`` runs, parsed by xtl's CLI parser, nothing instantiated."""
    from xtl.cli import ParseOnlyCLI, XTLArgumentParser  # imports Lightning: only with --config

    class RaisingParser(XTLArgumentParser):
        def error(self, message: str, ex: Exception | None = None) -> None:
            first = next((line.strip() for line in str(message).splitlines() if line.strip()), "invalid config")
            raise ToolInputError(f"--config {' '.join(files)}: {first}")

    class ParseOnly(ParseOnlyCLI):
        def init_parser(self, **kwargs: Any) -> XTLArgumentParser:
            self.parser_class = RaisingParser
            return super().init_parser(**kwargs)

    cli = ParseOnly(args=[arg for name in files for arg in ("--config", name)], run=False)
    return cli.config.as_dict()


def _device_count(devices: Any) -> int:
    if isinstance(devices, (list, tuple)):
        return len(devices)
    if isinstance(devices, int) and devices > 0:
        return devices
    if isinstance(devices, str) and devices.strip().isdigit() and int(devices) > 0:
        return int(devices)
    if isinstance(devices, str) and "," in devices:
        return len([d for d in devices.split(",") if d.strip()])
    raise ToolInputError(f"trainer.devices is {devices!r}: give the GPUs per node with --gpus-per-node")


def _class_and_args(value: Any) -> tuple[str | None, dict[str, Any]]:
    if isinstance(value, dict):
        return value.get("class_path"), value.get("init_args") or {}
    return (value if isinstance(value, str) else None), {}


def _import_class(class_path: str | None) -> type | None:
    """The class ``class_path`` names (``None``: not a dotted path to a class)."""
    if not class_path or "." not in class_path:
        return None
    owner, _, attr = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(owner), attr)
    except (ImportError, AttributeError):
        return None
    return cls if isinstance(cls, type) else None


def _is_subclass(class_path: str | None, module: str, name: str) -> bool:
    """Whether ``class_path`` names ``module.name`` or a subclass of it."""
    cls = _import_class(class_path)
    return cls is not None and issubclass(cls, getattr(importlib.import_module(module), name))


def _layout(strategy_args: dict[str, Any], gpus: int) -> ParallelLayout:
    """The :class:`~xtl.strategies.layout.ParallelLayout` the strategy would build on ``gpus`` ranks."""
    from xtl.strategies.layout import ParallelLayout

    try:
        return ParallelLayout.for_world(
            gpus,
            int(strategy_args.get("data_parallel_replicate_size") or 1),
            strategy_args.get("data_parallel_shard_size") or "auto",
            int(strategy_args.get("expert_parallel_size") or 1),
            int(strategy_args.get("context_parallel_size") or 1),
        )
    except ConfigError as exc:
        raise ToolInputError(short_message(exc)) from None


def _read_transforms(callbacks: list[Any], setup: dict[str, Any], read_from: dict[str, str]) -> None:
    """The memory settings each model-transform callback states; what none states gets its no-callback value."""
    from xtl.strategies.parallelize import ModelTransform

    decided_by: dict[str, str] = {}
    for entry in callbacks:
        class_path, init_args = _class_and_args(entry)
        cls = _import_class(class_path)
        if cls is None or not issubclass(cls, ModelTransform):
            continue
        try:
            settings = cls(**init_args).memory_settings()
        except (ConfigError, TypeError, ValueError) as exc:
            raise ToolInputError(f"trainer.callbacks {cls.__name__}: {short_message(exc)}") from None
        for key, value in settings.items():
            if key in decided_by:
                raise ToolInputError(
                    f"the merged config has two callbacks that set {key} ({decided_by[key]} and {cls.__name__}); "
                    "a run applies one of each: drop the fragment that adds the second"
                )
            decided_by[key] = cls.__name__
            setup[key] = value
            read_from[key] = f"{_text(value)} (trainer.callbacks: {cls.__name__})"
    for key, value in WITHOUT_A_CALLBACK.items():
        if key not in decided_by:
            setup[key] = value
            read_from[key] = f"{_text(value)} (no callback in trainer.callbacks sets it)"
    if setup["qlora"] and not setup["lora_rank"]:
        raise ToolInputError(
            f"the {decided_by['qlora']} callback needs a LoRA callback: add callbacks/lora.yaml before it"
        )


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (tuple, list)):
        return ", ".join(str(item) for item in value)
    return "default" if value is None else str(value)


def _compute_dtype_bytes(strategy_args: dict[str, Any], trainer: dict[str, Any], module: dict[str, Any]) -> tuple:
    """Size of the compute dtype and where it came from: the strategy's param_dtype, else precision, else model."""
    candidates = [
        (strategy_args.get("param_dtype"), "trainer.strategy.init_args.param_dtype"),
        ("bfloat16" if str(trainer.get("precision", "")).startswith(("bf16", "16")) else None, "trainer.precision"),
        (module.get("param_dtype") or "float32", "model.init_args.param_dtype"),
    ]
    value, source = next((v, src) for v, src in candidates if v is not None)
    return _dtype_bytes(value, source), f"{source} {value}"


def _frozen_dtype_bytes(fsdp: bool, trainer: dict[str, Any], module: dict[str, Any]) -> tuple[int, str]:
    """Size of the frozen weights as ``xtl fit`` stores them, and why: FSDP keeps every parameter in fp32; one
    device keeps the model's ``param_dtype`` (a ``*-true`` 16-bit precision casts the model)."""
    if fsdp:
        return 4, "FSDPStrategy keeps fp32 parameters, trained or frozen"
    precision = str(trainer.get("precision", ""))
    if precision in ("bf16-true", "16-true"):
        return 2, f"trainer.precision {precision}"
    value = module.get("param_dtype") or "float32"
    return _dtype_bytes(value, "model.init_args.param_dtype"), f"model.init_args.param_dtype {value}"


def _dtype_bytes(value: Any, source: str) -> int:
    name = str(value).removeprefix("torch.").lower()
    if name not in _DTYPE_BYTES:
        raise ToolInputError(f"{source} {value!r} is not a dtype xtl memory knows ({', '.join(_DTYPE_BYTES)})")
    return _DTYPE_BYTES[name]
