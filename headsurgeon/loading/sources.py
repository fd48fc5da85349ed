"""Where a model comes from: a bundled organism, the Hugging Face hub or a local folder.

Exports:
    resolve_model(model)   (display name, local checkpoint folder) of a user's model argument
    organism_names()       short names of the model organisms bundled with the package
    ORGANISM_DIR           their folder; DEFAULT_MODEL, the tools' default model
    unknown_message(name, candidates)
                           the unknown-model line with the closest names
    download_command(official)
                           the ``hf download`` command that fills the cache for a hub model

A hub name (any TransformerLens name or alias) is read from the Hugging Face cache, else
downloaded after one bounded probe of the hub (``HF_HUB_OFFLINE=1`` respected); an unknown name
is one :class:`~headsurgeon.errors.UnknownModelError` line with the closest known names.

>>> resolve_model("organism")[1].name
'organism'
"""

from __future__ import annotations

import difflib
import logging
import os
import threading
from pathlib import Path

from headsurgeon import backend
from headsurgeon.errors import ModelNotFoundError, UnknownModelError, first_line
from headsurgeon.loading.files import TOKENIZER_FILES, has_weights

__all__ = [
    "DEFAULT_MODEL",
    "ORGANISM_DIR",
    "download_command",
    "organism_names",
    "resolve_model",
    "unknown_message",
]

logger = logging.getLogger(__name__)


ORGANISM_DIR = Path(__file__).parents[1] / "organisms"
DEFAULT_MODEL = "organism-injured"


def organism_names() -> list[str]:
    """Short names of the model organisms bundled with the package."""
    if not ORGANISM_DIR.is_dir():
        return []
    return sorted(p.name for p in ORGANISM_DIR.iterdir() if (p / "config.json").exists())


def _hub_names() -> dict[str, str]:
    """Map every TransformerLens name and alias (lower case) to its official hub name."""
    return backend.hub_names()


def unknown_message(name: str, candidates: list[str]) -> str:
    by_lower = {c.lower(): c for c in candidates}
    close = difflib.get_close_matches(name.lower(), list(by_lower), n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(by_lower[c] for c in close)}? " if close else ""
    return (
        f"unknown model {name!r}: {hint}pass a TransformerLens model name, a bundled organism "
        f"({', '.join(organism_names()) or 'none installed'}) or a local checkpoint folder"
    )


def _hub_reachable(timeout: float = 2.0) -> bool:
    """One request to the hub, no retries, answered within ``timeout`` seconds.

    Uses the hub client's own session (its proxies and certificates). The request runs in a daemon
    thread because socket timeouts do not cover a name server that never answers.
    """
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    done = threading.Event()
    answered: list[bool] = []

    def probe() -> None:
        try:
            get_session().head(constants.ENDPOINT, timeout=timeout)
            answered.append(True)  # any status code: the server is there
        except Exception:  # any failure to get an HTTP answer means "unreachable"
            pass
        done.set()

    threading.Thread(target=probe, daemon=True).start()
    done.wait(timeout)
    return bool(answered)


def download_command(official: str) -> str:
    """The command that puts the files :func:`resolve_model` reads of a hub model into the
    Hugging Face cache: huggingface_hub's ``hf`` (installed with it; ``huggingface-cli`` is gone).

    >>> download_command("bigscience/bloom-560m")  # doctest: +NORMALIZE_WHITESPACE
    'hf download bigscience/bloom-560m --include "*.json" --include "*.safetensors"
     --include merges.txt'
    """
    patterns = ('"*.json"', '"*.safetensors"', "merges.txt")
    return " ".join(["hf download", official, *(f"--include {p}" for p in patterns)])


def _hub_snapshot(official: str) -> Path:
    """The local folder of a hub model: from the cache, else downloaded (with progress bars)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    patterns = ["config.json", "*.safetensors", "*.safetensors.index.json", *TOKENIZER_FILES]
    try:
        cached = Path(snapshot_download(official, allow_patterns=patterns, local_files_only=True))
        if has_weights(cached):
            return cached
    except LocalEntryNotFoundError:
        pass
    how = (
        f"download it on a connected machine ({download_command(official)}) and copy the "
        "Hugging Face cache here, or pass a local checkpoint folder"
    )
    missing = f"{official} is not in the local Hugging Face cache"
    if constants.is_offline_mode():
        raise ModelNotFoundError(f"{missing} and HF_HUB_OFFLINE=1; {how}")
    # One bounded probe rather than the hub client's own timeouts and retries.
    if not _hub_reachable():
        raise ModelNotFoundError(f"{missing} and {constants.ENDPOINT} cannot be reached; {how}")
    logger.info("downloading %s", official)
    try:
        folder = Path(snapshot_download(official, allow_patterns=patterns))
        if not has_weights(folder):  # older repositories ship only pickled weights
            folder = Path(snapshot_download(official, allow_patterns=["pytorch_model*.bin*"]))
    except Exception as e:  # the hub client raises many types (HTTP, connection, disk)
        raise ModelNotFoundError(f"downloading {official} failed ({first_line(e)}); {how}") from e
    return folder


def resolve_model(model: str | os.PathLike) -> tuple[str, Path]:
    """Turn a user's model argument into (display name, local checkpoint folder)."""
    name = str(model)
    if name in organism_names():
        return name, ORGANISM_DIR / name
    path = Path(name).expanduser()
    looks_like_path = isinstance(model, os.PathLike) or "/" in name or os.sep in name
    looks_like_path = looks_like_path or name.startswith((".", "~"))
    if path.exists():
        return path.name or name, path
    official = _hub_names().get(name.lower())
    if official is not None:
        return name, _hub_snapshot(official)
    if looks_like_path:
        raise ModelNotFoundError(f"model folder {name} does not exist; check the path")
    raise UnknownModelError(unknown_message(name, list(_hub_names()) + organism_names()))
