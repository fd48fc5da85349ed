"""Where the tools write by default: an output folder's name, and where an unfinished run lives.

Exports:
    default_out_dir(model, suffix)   ``<model>-<suffix>[-N]`` in the working directory
    model_folder_name(model)         a model's name as a folder name
    partial_dir(out)                 ``<out>.partial``, where an unfinished repair lives

>>> model_folder_name("bigscience/bloom-560m"), partial_dir("out/repair").name
('bloom-560m', 'repair.partial')
"""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = [
    "default_out_dir",
    "model_folder_name",
    "partial_dir",
]


def partial_dir(out: str | os.PathLike) -> Path:
    """Where the repair CLI keeps an unfinished run of ``out``: ``<out>.partial`` beside it."""
    out = Path(out)
    return out.with_name(out.name + ".partial")


def model_folder_name(model: str | os.PathLike) -> str:
    """A model's name as a folder name (``bigscience/bloom-560m`` -> ``bloom-560m``)."""
    name = Path(str(model).rstrip("/\\")).name or str(model)
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name)


def default_out_dir(model: str | os.PathLike, suffix: str) -> Path:
    """A new folder in the working directory named after the model (``<name>-<suffix>[-N]``).

    A name is taken when the folder exists or an unfinished run of it (:func:`partial_dir`) does.
    """
    name = model_folder_name(model)
    candidate, n = Path(f"{name}-{suffix}"), 2
    while any(os.path.lexists(p) for p in (candidate, partial_dir(candidate))):  # dangling too
        candidate, n = Path(f"{name}-{suffix}-{n}"), n + 1
    return candidate
