"""headsurgeon: census, underflow blindness and surgical repair of ALiBi attention heads.

The public API gathers here; each concept lives in its own module (docs/architecture.md). Names
are imported on first use (PEP 562): ``import headsurgeon`` stays light, and
``python -m headsurgeon.<tool>`` runs each tool's module as ``__main__`` without the package
importing a second copy first. The ``TYPE_CHECKING`` block below is the one list of the API: IDEs
and type checkers read its imports, and :func:`_exports` reads the same block from this file to
serve each name lazily.

The verbs are functions: ``classify_heads``, ``reinit_heads``, ``ablate_heads``, and
``repair_heads`` (the repair pipeline, also ``python -m headsurgeon.repair``) and
``finetune_heads`` (masked fine-tuning). The last two are exported under those names because
``headsurgeon.repair`` and ``headsurgeon.finetune`` are packages (``import headsurgeon.repair``
makes ``headsurgeon.repair`` the package); ``from headsurgeon.repair import repair`` and ``from
headsurgeon.finetune import finetune`` are the same functions.
"""

import ast
import importlib
import importlib.util
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

# The API: explicit re-exports (``X as X``, or a verb's own name) for IDEs and type checkers,
# and, read by _exports, what ``import headsurgeon`` serves on first use. One list for both.
if TYPE_CHECKING:
    from headsurgeon.allocator import (
        keep_freed_memory as keep_freed_memory,
    )
    from headsurgeon.blindness import (
        BlindnessMeasurement as BlindnessMeasurement,
        analytic_blindness as analytic_blindness,
        measure_blindness as measure_blindness,
        mitigation as mitigation,
    )
    from headsurgeon.census import (
        GU_PROTOCOL as GU_PROTOCOL,
        run_census as run_census,
        sink_rate as sink_rate,
    )
    from headsurgeon.checkpoints import (
        checkpoint_dtype as checkpoint_dtype,
        save_hf as save_hf,
        weight_changes as weight_changes,
    )
    from headsurgeon.classify import (
        Thresholds as Thresholds,
        classify_heads as classify_heads,
        threshold_sweep as threshold_sweep,
    )
    from headsurgeon.data import (
        to_sequences as to_sequences,
    )
    from headsurgeon.domains import (
        compare_corpora as compare_corpora,
        corpus_changes as corpus_changes,
    )
    from headsurgeon.evals import (
        Retrieval as Retrieval,
        loss_by_position as loss_by_position,
        needle as needle,
        passkey as passkey,
        perplexity as perplexity,
        retrieval_by_distance as retrieval_by_distance,
    )
    from headsurgeon.finetune import (
        FinetuneConfig as FinetuneConfig,
        FinetuneResult as FinetuneResult,
        bos_mass_objective as bos_mass_objective,
        finetune as finetune_heads,  # noqa: F401 (a verb: served by _exports)
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
        ModelShape as ModelShape,
        alibi_slopes as alibi_slopes,
        load_model as load_model,
        model_info as model_info,
        model_shape as model_shape,
        use_exact_alibi as use_exact_alibi,
    )
    from headsurgeon.long_context import (
        run_in_blocks as run_in_blocks,
    )
    from headsurgeon.precision import (
        PrecisionEffect as PrecisionEffect,
        precision_effect as precision_effect,
    )
    from headsurgeon.probes import (
        HeadStats as HeadStats,
    )
    from headsurgeon.received import (
        SecondarySinks as SecondarySinks,
        secondary_sinks as secondary_sinks,
    )
    from headsurgeon.repair import (
        RepairConfig as RepairConfig,
        RepairResult as RepairResult,
        recommended_config as recommended_config,
        repair as repair_heads,  # noqa: F401 (a verb: served by _exports)
    )
    from headsurgeon.sink_cache import (
        SinkCacheEffect as SinkCacheEffect,
        sink_cache_effect as sink_cache_effect,
    )
    from headsurgeon.surgery import (
        HeadMask as HeadMask,
        HeadParameters as HeadParameters,
        mask_gradients as mask_gradients,
        reinit_heads as reinit_heads,
    )
    from headsurgeon.window import (
        WindowEffect as WindowEffect,
        window_effect as window_effect,
    )


def _exports() -> dict[str, tuple[str, str]]:
    """Public name -> (module, its name there): the imports of the ``TYPE_CHECKING`` block above,
    read from this file (a few milliseconds, once), so that one list serves both readers."""
    tree = ast.parse(Path(__file__).read_text(encoding="utf-8"))
    [block] = [
        node
        for node in tree.body
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
    ]
    return {
        alias.asname or alias.name: (node.module, alias.name)
        for node in block.body
        if isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names
    }


_EXPORTS = _exports()
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"
_TOOLS = ("headsurgeon-classify", "headsurgeon-blindness", "headsurgeon-repair")


def _interrupted_while_starting(signum: int, frame: object) -> None:
    """Ctrl-C while a tool imports torch and TransformerLens: one line and status 130, at once.

    A ``KeyboardInterrupt`` raised in the middle of an import leaves half-initialised modules
    behind (numpy then fails with a ``RecursionError``, not the interrupt), so nothing can be
    unwound cleanly; and nothing has been written yet, so there is nothing to clean up either.
    ``headsurgeon.cli.run`` puts Python's own handler back before the tool starts work, so that
    from then on an interrupt unwinds and removes what the run was writing.
    """
    os.write(2, b"interrupted\n")
    os._exit(130)


def _starting_a_tool() -> bool:
    """Whether this import is the start of a command-line tool (``python -m headsurgeon.X``, whose
    package import runs while ``sys.argv[0]`` is still ``-m``, or a console script)."""
    program = os.path.basename(sys.argv[0]) if sys.argv else ""
    return program == "-m" or program in _TOOLS


# Only where Ctrl-C would raise (a background job's ignored SIGINT stays ignored).
if _starting_a_tool() and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, _interrupted_while_starting)
# Before TransformerLens imports tqdm.auto: text progress bars in Jupyter without ipywidgets,
# without tqdm's "IProgress not found" warning (see headsurgeon.progress).
importlib.import_module("headsurgeon.progress")


def __getattr__(name: str):
    if name in _EXPORTS:
        module, attribute = _EXPORTS[name]
        value = getattr(importlib.import_module(module), attribute)
    elif not name.startswith("_") and importlib.util.find_spec(f"headsurgeon.{name}"):
        value = importlib.import_module(f"headsurgeon.{name}")  # e.g. headsurgeon.plots
    else:
        raise AttributeError(f"module 'headsurgeon' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
