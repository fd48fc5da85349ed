"""The house's measures that issue 53 sets goals for, read from the source.

    python analyses/architecture_metrics.py [--list]

Counts: modules and lines; module ``__getattr__`` functions; comparisons on ``MAJOR``; distinct
public names (every module's ``__all__``); the longest public docstrings (lines); each verb of
``headsurgeon.__all__`` by its parameters besides its data, ``model``/``models`` and ``progress``
(deprecated keyword-only cut parameters, which warn, left out). Static where it can be (the
``ast`` of each file); the signatures by import.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
from pathlib import Path

import headsurgeon as hs

PACKAGE = Path(hs.__file__).parent
NOT_COUNTED = {
    "model",
    "models",
    "data",
    "corpora",
    "haystack",
    "progress",
    "self",
}  # data: by name
DEPRECATED = {"seq_len", "n_seqs", "prepend_bos"}  # keyword-only copies that warn (issue 53)


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _all(tree: ast.Module) -> list[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                return [
                    e.value for e in getattr(node.value, "elts", []) if isinstance(e, ast.Constant)
                ]
    return []


def measures(list_them: bool) -> None:
    trees = {name: ast.parse(path.read_text(encoding="utf-8")) for name, path in modules().items()}
    lines = sum(len(p.read_text(encoding="utf-8").splitlines()) for p in modules().values())
    getattrs = [
        name
        for name, tree in trees.items()
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__"
    ]
    majors = [
        f"{name}:{node.lineno}"
        for name, tree in trees.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Compare)
        and any(isinstance(n, ast.Name) and n.id == "MAJOR" for n in [node.left, *node.comparators])
    ]
    public = sorted({n for tree in trees.values() for n in _all(tree)})
    docstrings = []
    for name, tree in trees.items():
        exported = set(_all(tree))
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name in exported:
                doc = ast.get_docstring(node) or ""
                docstrings.append((len(doc.splitlines()), f"{name}.{node.name}"))
    docstrings.sort(reverse=True)
    verbs = []
    for name in hs.__all__:
        obj = getattr(hs, name)
        if inspect.isfunction(obj):
            params = inspect.signature(obj).parameters.values()
            kept = [
                p.name
                for p in params
                if p.name not in NOT_COUNTED
                and not (p.kind is p.KEYWORD_ONLY and p.name in DEPRECATED)
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
            ]
            verbs.append((len(kept), name))
    verbs.sort(reverse=True)
    print(f"modules {len(trees)}, lines {lines}")
    print(f"module __getattr__: {len(getattrs)} ({', '.join(getattrs)})")
    print(f"MAJOR compared: {len(majors)} ({', '.join(majors)})")
    print(f"public names (distinct, every __all__): {len(public)}")
    print("longest public docstrings (lines): " + ", ".join(f"{n} {d}" for n, d in docstrings[:8]))
    print("verbs by parameters: " + ", ".join(f"{v} {n}" for n, v in verbs[:10]))
    if list_them:
        print("\n".join(public))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="print every public name")
    importlib.import_module("headsurgeon")
    measures(parser.parse_args().list)


if __name__ == "__main__":
    main()
