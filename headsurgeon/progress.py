"""Progress bars that suit where they run: ``from headsurgeon.progress import tqdm``.

``tqdm.auto`` picks Jupyter widgets inside a kernel, but without ``ipywidgets`` installed it
falls back to text bars after a "IProgress not found" warning. This module gives
``tqdm.auto.tqdm`` when ``ipywidgets`` is installed (widgets in Jupyter, text elsewhere) and
plain text ``tqdm.std.tqdm`` otherwise. In the second case it also imports ``tqdm.auto`` once,
with that one warning ignored, so that TransformerLens's own ``tqdm.auto`` bars fall back to text
silently too; ``headsurgeon.backend``, the one module that imports TransformerLens, imports this
module first for that reason. Install
``ipywidgets`` for widget bars.

Exports: tqdm
"""

from __future__ import annotations

import importlib.util
import warnings

if importlib.util.find_spec("ipywidgets") is not None:
    from tqdm.auto import tqdm
else:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="IProgress not found")
        import tqdm.auto  # noqa: F401  (imported quietly once; later imports reuse it)
    from tqdm.std import tqdm

__all__ = ["tqdm"]
