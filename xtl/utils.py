"""Small process-wide helpers shared by every seam."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from xtl.errors import ConfigError

TINY_ASSETS_DIR = Path(__file__).resolve().parent / "assets" / "tiny"
TINY_PREFIX = "tiny:"
ENV_PREFIX = "env:"


def resolve_path(value: str) -> str:
    """Expand the path forms recipes accept.

    ``env:VAR`` is the value of an environment variable, ``tiny:NAME`` a file of the embedded tiny assets
    (``tiny:`` alone is their folder, which holds the tiny tokenizer), and a leading ``~`` the home directory.
    Anything else is returned unchanged.

    Raises:
        ConfigError: ``env:VAR`` names an unset variable.
    """
    if value.startswith(ENV_PREFIX):
        name = value[len(ENV_PREFIX) :]
        if name not in os.environ:
            raise ConfigError(
                f"{value!r}: environment variable {name} is not set; export it or pass the path directly"
            )
        value = os.environ[name]
    if value.startswith(TINY_PREFIX):
        return str(TINY_ASSETS_DIR / value[len(TINY_PREFIX) :])
    return str(Path(value).expanduser()) if value.startswith("~") else value


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
HUB_FILES = ("*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken")


def resolve_pretrained(value: str, what: str) -> str:
    """A local directory for ``value``: a path (see :func:`resolve_path`) or a Hugging Face hub id.

    A hub id (``Qwen/Qwen3-0.6B``) that is not a local path resolves through ``huggingface_hub``: the local HF cache
    when it holds the files, else a download (config, weights, tokenizer files only). ``HF_HUB_OFFLINE=1`` keeps it
    to the cache.

    Args:
        value: Path, ``env:VAR``, ``tiny:NAME`` or hub id.
        what: The YAML key it came from, for error messages (e.g. ``model.init_args.model``).

    Raises:
        ConfigError: A hub id that is neither cached nor downloadable (offline, unknown repository, no access).
    """
    path = resolve_path(value)
    if Path(path).exists() or not HUB_ID.match(path):
        return path
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return snapshot_download(path, allow_patterns=list(HUB_FILES))
    except LocalEntryNotFoundError:
        offline = " and the hub is offline (HF_HUB_OFFLINE=1)" if constants.HF_HUB_OFFLINE else ""
        raise ConfigError(
            f"{what}: {path!r} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}){offline}; download it "
            "once with network access, or give a local directory"
        ) from None
    except (HfHubHTTPError, OSError) as err:
        raise ConfigError(f"{what}: cannot fetch {path!r} from the Hugging Face hub ({err}); check the id") from None


def apply_umask(path: Path) -> None:
    """Give ``path`` the permissions a plain ``open``/``mkdir`` would (``0o666`` / ``0o777`` less the umask).

    Temporary files and directories are created private (``0o600`` / ``0o700``); renamed into place they would
    otherwise stay unreadable to the rest of a team sharing a run folder.
    """
    umask = os.umask(0)
    os.umask(umask)
    path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


@contextmanager
def atomic_directory(target: str | Path, overwrite: bool = True) -> Iterator[Path]:
    """Yield a temporary directory beside ``target`` that is renamed to ``target`` only on success.

    A crash inside the block leaves ``target`` untouched (the previous good version, or nothing).

    Args:
        target: Final directory path.
        overwrite: Replace an existing ``target``; if False, an existing target raises ``FileExistsError``.
    """
    target = Path(target)
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target} already exists; pass overwrite=True or choose another directory")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    apply_umask(tmp)
    for path in tmp.rglob("*"):
        apply_umask(path)
    if target.exists():
        trash = target.parent / f".{target.name}.old-{os.getpid()}"
        os.replace(target, trash)
        os.replace(tmp, target)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, target)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and an atomic rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        apply_umask(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
