"""Progress bars that suit where they run: ``from headsurgeon.progress import tqdm``.

``tqdm.auto`` picks Jupyter widgets inside a kernel, but without ``ipywidgets`` installed it
falls back to text only after a "IProgress not found" warning for every bar. This module gives
``tqdm.auto.tqdm`` when ``ipywidgets`` is installed (widgets in Jupyter, text elsewhere) and
plain text ``tqdm.std.tqdm`` otherwise, so a notebook shows text bars, never that warning.

Exports: tqdm
"""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("ipywidgets") is not None:
    from tqdm.auto import tqdm
else:
    from tqdm.std import tqdm

__all__ = ["tqdm"]
