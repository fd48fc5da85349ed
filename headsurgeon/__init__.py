"""headsurgeon: census, underflow blindness and surgical repair of ALiBi attention heads.

The public API gathers here; each concept lives in its own module (see README.md). Names are
imported on first use (PEP 562), so ``python -m headsurgeon.<tool>`` runs each tool's module once,
as ``__main__``, without the package importing a second copy first.
"""

import importlib
import importlib.util

# Public name -> the module (under headsurgeon) that defines it.
_EXPORTS = {
    "FinetuneConfig": "finetune",
    "HeadMask": "surgery",
    "HeadParameters": "surgery",
    "HeadSet": "surgery",
    "RepairResult": "repair",
    "Thresholds": "classify",
    "alibi_slopes": "exact_alibi",
    "analytic_blindness": "blindness",
    "bos_mass_objective": "finetune",
    "classify_heads": "classify",
    "keep_freed_memory": "allocator",
    "load_model": "loading",
    "mask_gradients": "surgery",
    "measure_blindness": "blindness",
    "mitigation": "blindness",
    "model_info": "loading",
    "model_shape": "loading",
    "needle": "evals",
    "passkey": "evals",
    "perplexity": "evals",
    "reinit_heads": "surgery",
    "run_census": "census",
    "save_hf": "checkpoints",
    "threshold_sweep": "classify",
    "weight_changes": "checkpoints",
}
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"
# Before TransformerLens imports tqdm.auto: text progress bars in Jupyter without ipywidgets,
# without tqdm's "IProgress not found" warning (see headsurgeon.progress).
importlib.import_module("headsurgeon.progress")


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"headsurgeon.{_EXPORTS[name]}"), name)
    elif not name.startswith("_") and importlib.util.find_spec(f"headsurgeon.{name}"):
        value = importlib.import_module(f"headsurgeon.{name}")  # e.g. headsurgeon.plots
    else:
        raise AttributeError(f"module 'headsurgeon' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
