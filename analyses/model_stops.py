"""Follow the model through a verb: every headsurgeon function it is passed to, in call order.

Issue 40's measure of how often the code questions the model again: a *stop* is a function of
the package that receives the model object as an argument (each counted once, at its first
call: a training step per batch is one stop); a *return up* is a stop in a module of a higher
layer than the stop before it (docs/architecture.md's layers); a *re-entry* is a stop in a
module visited before, after another module. ``calls`` counts every call. Printed for
``hs.run_census`` and ``hs.repair_heads`` (one short pass) on the bundled ``organism``.

    python analyses/model_stops.py            # the counts, and each stop with --list
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import headsurgeon as hs

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from test_architecture import LAYERS  # noqa: E402  (the layers, as the architecture test has them)

PACKAGE = Path(hs.__file__).parent
RANK = {module: rank for rank, modules in enumerate(LAYERS.values()) for module in modules}


def _layer(module: str) -> int:
    parts = module.split(".")[1:]
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in RANK:
            return RANK[".".join(parts[:n])]
    return -1


def follow(model, call) -> list[tuple[str, str]]:
    """``(module, function)`` of every package function that received ``model``, in order."""
    stops: list[tuple[str, str]] = []

    def profile(frame, event, arg):  # noqa: ANN001
        if event != "call":
            return
        code = frame.f_code
        if not code.co_filename.startswith(str(PACKAGE)):
            return
        names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        if any(frame.f_locals.get(name) is model for name in names):
            stops.append((frame.f_globals.get("__name__", "?"), code.co_name))

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return stops


def summary(calls: list[tuple[str, str]]) -> dict[str, int]:
    """Counts over the distinct functions, in the order of their first call (a loop's repeats,
    e.g. a training step per batch, are one stop); ``calls``: every call."""
    stops = list(dict.fromkeys(calls))
    modules = [m for m, _ in stops]
    ups = sum(_layer(b) > _layer(a) for a, b in zip(modules, modules[1:], strict=False))
    seen, reentries = set(), 0
    for previous, module in zip([None, *modules], modules, strict=False):
        if module != previous and module in seen:
            reentries += 1
        seen.add(module)
    return {
        "stops": len(stops),
        "modules": len(set(modules)),
        "returns up": ups,
        "re-entries": reentries,
        "calls": len(calls),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print every stop")
    args = parser.parse_args()
    model = hs.load_model("organism")
    verbs = {
        "run_census": lambda: hs.run_census(
            model, hs.to_sequences(model, seq_len=32, n_seqs=4), progress=False
        ),
        "repair_heads": lambda: hs.repair_heads(
            model,
            heads="L0H0",
            passes=1,
            control=False,
            census_n_seqs=4,
            census_seq_len=32,
            n_eval_seqs=4,
            train_seq_len=32,
            finetune_config=hs.FinetuneConfig(steps=2, batch_size=2, eval_every=2),
            progress=False,
        ),
    }
    for name, call in verbs.items():
        stops = follow(model, call)
        print(name, summary(stops))
        if args.list:
            for module, function in dict.fromkeys(stops):
                print(f"    {module}.{function}")


if __name__ == "__main__":
    main()
