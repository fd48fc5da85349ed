"""headsurgeon: census, underflow blindness and surgical repair of ALiBi attention heads.

The public API gathers here; each concept lives in its own module (README: Architecture). Names
are imported on first use (PEP 562): ``import headsurgeon`` stays light, and
``python -m headsurgeon.<tool>`` runs each tool's module as ``__main__`` without the package
importing a second copy first. The ``TYPE_CHECKING`` block below spells every import out, so IDEs
and type checkers see the same names.

Two functions share their module's name and are not exported here, because ``import
headsurgeon.repair`` makes ``headsurgeon.repair`` the module: ``from headsurgeon.repair import
repair`` (the pipeline, also ``python -m headsurgeon.repair``) and ``from headsurgeon.finetune
import finetune``.
"""

import importlib
import importlib.util
import os
import signal
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # explicit re-exports (``X as X``) for IDEs and type checkers
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
        run_census as run_census,
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
    from headsurgeon.evals import (
        Retrieval as Retrieval,
        loss_by_position as loss_by_position,
        needle as needle,
        passkey as passkey,
        perplexity as perplexity,
    )
    from headsurgeon.exact_alibi import (
        alibi_slopes as alibi_slopes,
        use_exact_alibi as use_exact_alibi,
    )
    from headsurgeon.finetune import (
        FinetuneConfig as FinetuneConfig,
        FinetuneResult as FinetuneResult,
        bos_mass_objective as bos_mass_objective,
    )
    from headsurgeon.heads import (
        Heads as Heads,
        HeadSet as HeadSet,
    )
    from headsurgeon.importance import (
        head_importance as head_importance,
    )
    from headsurgeon.loading import (
        ModelShape as ModelShape,
        load_model as load_model,
        model_info as model_info,
        model_shape as model_shape,
    )
    from headsurgeon.long_context import (
        run_in_blocks as run_in_blocks,
    )
    from headsurgeon.probes import (
        HeadStats as HeadStats,
    )
    from headsurgeon.repair import (
        RepairConfig as RepairConfig,
        RepairResult as RepairResult,
        recommended_config as recommended_config,
    )
    from headsurgeon.surgery import (
        HeadMask as HeadMask,
        HeadParameters as HeadParameters,
        mask_gradients as mask_gradients,
        reinit_heads as reinit_heads,
    )

# Public name -> the module (under headsurgeon) that defines it.
_EXPORTS = {
    "BlindnessMeasurement": "blindness",
    "FinetuneConfig": "finetune",
    "FinetuneResult": "finetune",
    "HeadMask": "surgery",
    "HeadParameters": "surgery",
    "HeadSet": "heads",
    "HeadStats": "probes",
    "Heads": "heads",
    "ModelShape": "loading",
    "RepairConfig": "repair",
    "RepairResult": "repair",
    "Retrieval": "evals",
    "Thresholds": "classify",
    "alibi_slopes": "exact_alibi",
    "analytic_blindness": "blindness",
    "bos_mass_objective": "finetune",
    "checkpoint_dtype": "checkpoints",
    "classify_heads": "classify",
    "head_importance": "importance",
    "keep_freed_memory": "allocator",
    "load_model": "loading",
    "mask_gradients": "surgery",
    "measure_blindness": "blindness",
    "mitigation": "blindness",
    "loss_by_position": "evals",
    "model_info": "loading",
    "model_shape": "loading",
    "needle": "evals",
    "passkey": "evals",
    "perplexity": "evals",
    "recommended_config": "repair",
    "reinit_heads": "surgery",
    "run_census": "census",
    "run_in_blocks": "long_context",
    "save_hf": "checkpoints",
    "threshold_sweep": "classify",
    "to_sequences": "data",
    "use_exact_alibi": "exact_alibi",
    "weight_changes": "checkpoints",
}
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
        value = getattr(importlib.import_module(f"headsurgeon.{_EXPORTS[name]}"), name)
    elif not name.startswith("_") and importlib.util.find_spec(f"headsurgeon.{name}"):
        value = importlib.import_module(f"headsurgeon.{name}")  # e.g. headsurgeon.plots
    else:
        raise AttributeError(f"module 'headsurgeon' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
