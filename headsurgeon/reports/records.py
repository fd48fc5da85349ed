"""What the writers' JSON files record: values made JSON-safe, the versions of the packages used.

Every JSON file a writer emits goes through :func:`json_safe` (NaN and infinities as ``null``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__: list[str] = []


# Recorded in heads.json and report.json.
VERSIONED = ("headsurgeon", "torch", "transformer-lens", "transformers", "plotly")


def package_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    result = {}
    for package in VERSIONED:
        try:
            result[package] = version(package)
        except PackageNotFoundError:
            result[package] = "not installed"
    return result


def json_safe(value: Any) -> Any:
    """``value`` with NaN and infinities as ``None`` and numpy scalars as Python ones, in depth.

    >>> json_safe({"a": [1.0, float("nan")], "b": np.int64(3)})
    {'a': [1.0, None], 'b': 3}
    """
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, np.generic):
        return json_safe(value.item())
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    return value
