"""headsurgeon: census, underflow blindness and surgical repair of ALiBi attention heads.

The root holds the API a researcher reaches for first, about thirty names (``dir(headsurgeon)``
shows exactly these); each concept lives in its own module (docs/architecture.md), and the
specialist names live only there (``from headsurgeon.census import sink_rate``). Names are
imported on first use (PEP 562), so ``import headsurgeon`` loads neither torch nor
TransformerLens. The ``TYPE_CHECKING`` block is what IDEs and type checkers read; ``_EXPORTS``
says where each name is served from, and a test holds the two equal.

The verbs are functions: ``classify_heads``, ``reinit_heads``, ``ablate_heads``, and
``repair_heads`` (the repair pipeline, also ``python -m headsurgeon repair``) and
``finetune_heads`` (masked fine-tuning). The last two are exported under those names because
``headsurgeon.repair`` and ``headsurgeon.finetune`` are packages (``import headsurgeon.repair``
makes ``headsurgeon.repair`` the package); ``from headsurgeon.repair import repair`` and ``from
headsurgeon.finetune import finetune`` are the same functions.

The modules and subpackages (``headsurgeon.plots``, ``headsurgeon.reports``, ...) are reachable
as attributes too (``hs.plots``), imported on first use; they are not part of ``dir()``.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from headsurgeon.blindness import (
        analytic_blindness as analytic_blindness,
        analytic_rounding as analytic_rounding,
        measure_blindness as measure_blindness,
        mitigation as mitigation,
    )
    from headsurgeon.census import run_census as run_census
    from headsurgeon.checkpoints import save_hf as save_hf
    from headsurgeon.classify import (
        Thresholds as Thresholds,
        classify_heads as classify_heads,
        threshold_sweep as threshold_sweep,
    )
    from headsurgeon.corpus_sources import load_dataset_texts as load_dataset_texts
    from headsurgeon.data import to_sequences as to_sequences
    from headsurgeon.domains import compare_corpora as compare_corpora
    from headsurgeon.evals import (
        needle as needle,
        passkey as passkey,
        perplexity as perplexity,
        retrieval_by_distance as retrieval_by_distance,
    )
    from headsurgeon.finetune import (
        FinetuneConfig as FinetuneConfig,
        finetune as finetune_heads,  # noqa: F401 (a verb: served by _EXPORTS)
    )
    from headsurgeon.heads import (
        Heads as Heads,
        HeadSet as HeadSet,
    )
    from headsurgeon.importance import (
        ablate_heads as ablate_heads,
        head_importance as head_importance,
    )
    from headsurgeon.loading import (
        alibi_slopes as alibi_slopes,
        load_model as load_model,
        model_info as model_info,
        model_shape as model_shape,
    )
    from headsurgeon.precision import precision_effect as precision_effect
    from headsurgeon.received import secondary_sinks as secondary_sinks
    from headsurgeon.repair import (
        RepairConfig as RepairConfig,
        RepairResult as RepairResult,
        repair as repair_heads,  # noqa: F401 (a verb: served by _EXPORTS)
    )
    from headsurgeon.sink_cache import sink_cache_effect as sink_cache_effect
    from headsurgeon.surgery import (
        reinit_heads as reinit_heads,
        save_pruned as save_pruned,
    )
    from headsurgeon.window import window_effect as window_effect

# The API: name -> (module, its name there). Equal to the TYPE_CHECKING block above
# (tests/test_architecture.py: test_the_type_checking_imports_are_what_the_package_serves).
_EXPORTS = {
    "ablate_heads": ("headsurgeon.importance", "ablate_heads"),
    "alibi_slopes": ("headsurgeon.loading", "alibi_slopes"),
    "analytic_blindness": ("headsurgeon.blindness", "analytic_blindness"),
    "analytic_rounding": ("headsurgeon.blindness", "analytic_rounding"),
    "classify_heads": ("headsurgeon.classify", "classify_heads"),
    "compare_corpora": ("headsurgeon.domains", "compare_corpora"),
    "FinetuneConfig": ("headsurgeon.finetune", "FinetuneConfig"),
    "finetune_heads": ("headsurgeon.finetune", "finetune"),
    "head_importance": ("headsurgeon.importance", "head_importance"),
    "Heads": ("headsurgeon.heads", "Heads"),
    "HeadSet": ("headsurgeon.heads", "HeadSet"),
    "load_dataset_texts": ("headsurgeon.corpus_sources", "load_dataset_texts"),
    "load_model": ("headsurgeon.loading", "load_model"),
    "measure_blindness": ("headsurgeon.blindness", "measure_blindness"),
    "mitigation": ("headsurgeon.blindness", "mitigation"),
    "model_info": ("headsurgeon.loading", "model_info"),
    "model_shape": ("headsurgeon.loading", "model_shape"),
    "needle": ("headsurgeon.evals", "needle"),
    "passkey": ("headsurgeon.evals", "passkey"),
    "perplexity": ("headsurgeon.evals", "perplexity"),
    "precision_effect": ("headsurgeon.precision", "precision_effect"),
    "reinit_heads": ("headsurgeon.surgery", "reinit_heads"),
    "save_pruned": ("headsurgeon.surgery", "save_pruned"),
    "RepairConfig": ("headsurgeon.repair", "RepairConfig"),
    "RepairResult": ("headsurgeon.repair", "RepairResult"),
    "repair_heads": ("headsurgeon.repair", "repair"),
    "retrieval_by_distance": ("headsurgeon.evals", "retrieval_by_distance"),
    "run_census": ("headsurgeon.census", "run_census"),
    "save_hf": ("headsurgeon.checkpoints", "save_hf"),
    "secondary_sinks": ("headsurgeon.received", "secondary_sinks"),
    "sink_cache_effect": ("headsurgeon.sink_cache", "sink_cache_effect"),
    "threshold_sweep": ("headsurgeon.classify", "threshold_sweep"),
    "Thresholds": ("headsurgeon.classify", "Thresholds"),
    "to_sequences": ("headsurgeon.data", "to_sequences"),
    "window_effect": ("headsurgeon.window", "window_effect"),
}

# Specialist names the root used to serve: still reachable as ``headsurgeon.NAME`` for one
# release, with a DeprecationWarning naming their module; not in ``__all__`` or ``dir()``.
_MOVED = {
    "BlindnessMeasurement": "headsurgeon.blindness",
    "checkpoint_dtype": "headsurgeon.checkpoints",
    "corpus_changes": "headsurgeon.domains",
    "FinetuneResult": "headsurgeon.finetune",
    "bos_mass_objective": "headsurgeon.finetune",
    "GU_PROTOCOL": "headsurgeon.census",
    "HeadMask": "headsurgeon.surgery",
    "HeadParameters": "headsurgeon.surgery",
    "HeadStats": "headsurgeon.probes",
    "keep_freed_memory": "headsurgeon.allocator",
    "loss_by_position": "headsurgeon.evals",
    "mask_gradients": "headsurgeon.surgery",
    "ModelShape": "headsurgeon.loading",
    "PrecisionEffect": "headsurgeon.precision",
    "recommended_config": "headsurgeon.repair",
    "Retrieval": "headsurgeon.evals",
    "run_in_blocks": "headsurgeon.long_context",
    "SecondarySinks": "headsurgeon.received",
    "SinkCacheEffect": "headsurgeon.sink_cache",
    "sink_rate": "headsurgeon.census",
    "use_exact_alibi": "headsurgeon.loading",
    "weight_changes": "headsurgeon.checkpoint_diff",
    "WindowEffect": "headsurgeon.window",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    import importlib

    if name in _EXPORTS:
        module, attribute = _EXPORTS[name]
        value = getattr(importlib.import_module(module), attribute)
        globals()[name] = value  # later lookups skip __getattr__
        return value
    if name == "__version__":
        return importlib.import_module("headsurgeon.outputs").headsurgeon_version()
    if name in _MOVED:
        import warnings

        module = _MOVED[name]
        warnings.warn(
            f"headsurgeon.{name} leaves the package root in the next release: "
            f"from {module} import {name}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(module), name)
    import importlib.util

    if not name.startswith("_") and importlib.util.find_spec(f"headsurgeon.{name}"):
        return importlib.import_module(f"headsurgeon.{name}")  # e.g. headsurgeon.plots
    raise AttributeError(f"module 'headsurgeon' has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(__all__)
