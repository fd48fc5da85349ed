"""What a MODEL argument names, answered without importing torch or TransformerLens.

``locate_model("bloom-560m")`` says whether a name is a bundled organism, a local folder or a
TransformerLens hub name, and refuses a missing path or an unknown name in one line, in
milliseconds: the command-line tools call it before their heavy imports, and
:func:`headsurgeon.loading.resolve_model` builds on it (it then finds or downloads the hub
model's files).

TransformerLens's table of names (official names and aliases) takes seconds to import, so a
snapshot of it ships with the package (``hub_names.json``), recording the TransformerLens
versions it is exact for (3.x and 4.x have the same table). :func:`hub_names` answers from the
snapshot when the installed TransformerLens is one of them, and otherwise asks TransformerLens
itself (slow, still exact). ``analyses/hub_names.py`` checks the snapshot against the installed
version (adding it) or rewrites it; a test holds it equal to the installed table.

>>> locate_model("organism")[1].name
'organism'
>>> locate_model("bigscience/bloom-560m")[2]
'bigscience/bloom-560m'
"""

from __future__ import annotations

import difflib
import functools
import importlib.metadata
import json
import os
import threading
from pathlib import Path

from headsurgeon.errors import ModelNotFoundError, UnknownModelError

__all__ = [
    "SNAPSHOT_FILE",
    "hub_names",
    "installed_transformer_lens",
    "organism_names",
]

ORGANISM_DIR = Path(__file__).parent / "organisms"
DEFAULT_MODEL = "organism-injured"
# {"transformer_lens": [the versions it was read from], "names": {lower-case name or alias:
# official name}}
SNAPSHOT_FILE = Path(__file__).parent / "hub_names.json"


def organism_names() -> list[str]:
    """Short names of the model organisms bundled with the package."""
    if not ORGANISM_DIR.is_dir():
        return []
    return sorted(p.name for p in ORGANISM_DIR.iterdir() if (p / "config.json").exists())


def installed_transformer_lens() -> str:
    """The installed TransformerLens version, read from its package metadata (no import)."""
    return importlib.metadata.version("transformer-lens")


@functools.cache
def snapshot_names() -> dict[str, str] | None:
    """The shipped table of names when it was read from the installed TransformerLens version,
    else None (another version may add or drop names)."""
    snapshot = json.loads(SNAPSHOT_FILE.read_text(encoding="utf-8"))
    return (
        snapshot["names"] if installed_transformer_lens() in snapshot["transformer_lens"] else None
    )


def hub_names() -> dict[str, str]:
    """Every TransformerLens model name and alias (lower case) -> its official hub name: the
    snapshot when it matches the installed version, else TransformerLens's own table."""
    names = snapshot_names()
    if names is not None:
        return names
    from headsurgeon import backend  # seconds: imports TransformerLens (no matching snapshot)

    return backend.hub_names()


def unknown_message(name: str, candidates: list[str]) -> str:
    """The one line for an unknown model ``name``, with up to three close ``candidates``."""
    by_lower = {c.lower(): c for c in candidates}
    close = difflib.get_close_matches(name.lower(), list(by_lower), n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(by_lower[c] for c in close)}? " if close else ""
    return (
        f"unknown model {name!r}: {hint}pass a TransformerLens model name, a bundled organism "
        f"({', '.join(organism_names()) or 'none installed'}) or a local checkpoint folder"
    )


def locate_model(model: str | os.PathLike) -> tuple[str, Path | None, str | None]:
    """What a user's model argument names: (display name, local checkpoint folder or None,
    official hub name or None); exactly one of the last two is set.

    A bundled organism's name, then an existing path, then a TransformerLens name or alias (any
    case). Something that looks like a path (``/``, ``.``, ``~``) but does not exist is a
    :class:`~headsurgeon.errors.ModelNotFoundError`; any other name an
    :class:`~headsurgeon.errors.UnknownModelError` naming the closest known names.
    """
    name = str(model)
    if name in organism_names():
        return name, ORGANISM_DIR / name, None
    path = Path(name).expanduser()
    if path.exists():
        return path.name or name, path, None
    official = hub_names().get(name.lower())
    if official is not None:
        return name, None, official
    looks_like_path = isinstance(model, os.PathLike) or "/" in name or os.sep in name
    if looks_like_path or name.startswith((".", "~")):
        raise ModelNotFoundError(f"model folder {name} does not exist; check the path")
    raise UnknownModelError(unknown_message(name, list(hub_names()) + organism_names()))


def download_command(official: str) -> str:
    """The command that puts the files :func:`headsurgeon.loading.resolve_model` reads of a hub
    model into the Hugging Face cache: huggingface_hub's ``hf`` (``huggingface-cli`` is gone).

    >>> download_command("bigscience/bloom-560m")  # doctest: +NORMALIZE_WHITESPACE
    'hf download bigscience/bloom-560m --include "*.json" --include "*.safetensors"
     --include merges.txt'
    """
    patterns = ('"*.json"', '"*.safetensors"', "merges.txt")
    return " ".join(["hf download", official, *(f"--include {p}" for p in patterns)])


def hub_cache_folder(official: str) -> Path | None:
    """The snapshot folder of hub model ``official`` (``bigscience/bloom-560m``) in the Hugging
    Face cache when it holds the model's config.json, else None. The hub client's own lookup
    (``try_to_load_from_cache``: the cache's ``refs/main`` and ``snapshots/``), no network, no
    torch."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(official, "config.json")
    return Path(found).parent if isinstance(found, str) else None


def not_cached_message(official: str, why: str) -> str:
    """The one line for hub model ``official`` missing from the cache, ``why`` it cannot be
    downloaded now (``HF_HUB_OFFLINE=1``), and the ways to get it."""
    from huggingface_hub import constants

    return (
        f"{official} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and {why}; run "
        "once online to download it, or download it on a connected machine "
        f"({download_command(official)}) and copy the cache here, or pass a local checkpoint "
        "folder"
    )


def hub_reachable(timeout: float = 2.0) -> bool:
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


def check_hub_model(official: str, cached: bool | None = None) -> None:
    """Hub model ``official`` is in the Hugging Face cache, or can be downloaded: otherwise a
    :class:`~headsurgeon.errors.ModelNotFoundError` line now (with ``HF_HUB_OFFLINE=1`` at once;
    else after one request of at most 2 s), before seconds of imports find it missing.
    ``cached``: whether the cache holds it (default: :func:`hub_cache_folder` says)."""
    from huggingface_hub import constants

    if cached if cached is not None else hub_cache_folder(official) is not None:
        return
    if constants.is_offline_mode():
        raise ModelNotFoundError(not_cached_message(official, "HF_HUB_OFFLINE=1"))
    if not hub_reachable():
        raise ModelNotFoundError(
            not_cached_message(official, f"{constants.ENDPOINT} cannot be reached")
        )
