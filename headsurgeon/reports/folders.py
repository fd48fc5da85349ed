"""Where the tools write by default: an output folder's name, and where an unfinished run lives.

>>> model_folder_name("bigscience/bloom-560m"), partial_dir("out/repair").name
('bloom-560m', 'repair.partial')
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection, Iterable
from pathlib import Path

from headsurgeon.errors import InvalidArgumentError

__all__: list[str] = []


def partial_dir(out: str | os.PathLike) -> Path:
    """Where the repair CLI keeps an unfinished run of ``out``: ``<out>.partial`` beside it."""
    out = Path(out)
    return out.with_name(out.name + ".partial")


def model_folder_name(model: str | os.PathLike) -> str:
    """A model's name as a folder name (``bigscience/bloom-560m`` -> ``bloom-560m``)."""
    name = Path(str(model).rstrip("/\\")).name or str(model)
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name)


def named_folders(names: Iterable[str], what: str, files: Collection[str] = ()) -> dict[str, str]:
    """``{folder: name}``: each of ``names`` (models, corpora) as the folder a writer gives it
    (:func:`model_folder_name`), checked before any work.

    Two names that give one folder (letters' case aside, as a case-insensitive disk sees them), a
    folder that would be hidden or no folder (``.``, ``..``, ``.x``) and one named as a file of
    the writer's folder (``files``, case aside) raise :class:`InvalidArgumentError` in one line;
    ``what`` names the names (``"corpus"``).

    >>> named_folders(["org/m-1", "m 2"], "model")
    {'m-1': 'org/m-1', 'm-2': 'm 2'}
    """
    taken = {f.casefold(): f for f in files}
    folders: dict[str, str] = {}
    seen: dict[str, str] = {}
    for name in names:
        folder = model_folder_name(name)
        if not folder.strip(".") or folder.startswith("."):
            raise InvalidArgumentError(
                f"the {what} {name!r} gives the folder name {folder!r}, which would be hidden or "
                "no folder; rename it"
            )
        key = folder.casefold()
        if key in seen:
            raise InvalidArgumentError(
                f"the {what} names {seen[key]!r} and {name!r} would share an output folder name, "
                f"{folder!r} (letters' case aside, as some disks see them); rename one"
            )
        if key in taken:
            raise InvalidArgumentError(
                f"the {what} {name!r} gives the folder name {folder!r}, which is the name of a "
                f"file the output folder holds ({taken[key]}); rename it"
            )
        seen[key] = name
        folders[folder] = name
    return folders


def default_out_dir(model: str | os.PathLike, suffix: str) -> Path:
    """A new folder in the working directory named after the model (``<name>-<suffix>[-N]``).

    A name is taken when the folder exists or an unfinished run of it (:func:`partial_dir`) does.
    """
    name = model_folder_name(model)
    candidate, n = Path(f"{name}-{suffix}"), 2
    while any(os.path.lexists(p) for p in (candidate, partial_dir(candidate))):  # dangling too
        candidate, n = Path(f"{name}-{suffix}-{n}"), n + 1
    return candidate
