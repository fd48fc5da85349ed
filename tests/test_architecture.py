"""The package's layering: no import cycles (function-level imports count), pure math stays pure,
the library imports neither plotting nor the command line."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "headsurgeon"


def module_files() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__.py``)."""
    files = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        files[".".join(parts)] = path
    return files


def lazy_exports() -> dict[str, str]:
    """``headsurgeon._EXPORTS``: public name -> module, imported when the name is first used."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in node.targets
        ):
            return {k: f"headsurgeon.{v}" for k, v in ast.literal_eval(node.value).items()}
    return {}


def is_main_block(node: ast.AST) -> bool:
    """``if __name__ == "__main__":``"""
    test = getattr(node, "test", None)
    return (
        isinstance(node, ast.If)
        and isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Name)
        and test.left.id == "__name__"
        and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in test.comparators)
    )


def is_type_checking_block(node: ast.AST) -> bool:
    """``if TYPE_CHECKING:``: imports for type checkers only, never run."""
    return isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"


def nodes_that_run(tree: ast.AST) -> list[ast.AST]:
    """Every node of ``tree`` (functions included) except those of ``__main__`` blocks and
    ``TYPE_CHECKING`` blocks (neither runs when the module is imported)."""
    found, todo = [], [tree]
    while todo:
        node = todo.pop()
        if is_main_block(node) or is_type_checking_block(node):
            continue
        found.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return found


def imports_of(name: str, path: Path, modules: set[str], exports: dict[str, str]) -> set[str]:
    """The package modules that ``name`` imports anywhere in its file (functions included).

    Importing ``a.b.c`` runs ``a`` and ``a.b`` first, so parent packages count too, except the
    packages ``name`` itself lies in: those are already being imported when ``name`` runs (a
    package's ``__init__`` importing its modules, which import each other, is no cycle; naming
    the package itself, ``from headsurgeon.repair import X`` inside ``headsurgeon.repair.*``, still
    counts). ``from headsurgeon import load_model`` counts as importing the module that defines it.
    A ``if __name__ == "__main__":`` block is skipped: it runs only in the ``__main__`` module of
    ``python -m``, a separate module that nothing imports, so it cannot close a cycle.
    """
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def add(target: str) -> None:
        parts = target.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            own_package = i < len(parts) and name.startswith(prefix + ".")
            if prefix in modules and not own_package:
                found.add(prefix)

    for node in nodes_that_run(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: len(name.split(".")) - node.level + is_package]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            add(source)
            for alias in node.names:
                if f"{source}.{alias.name}" in modules:
                    add(f"{source}.{alias.name}")
                elif source == "headsurgeon" and alias.name in exports:
                    add(exports[alias.name])
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            add(node.args[0].value)
    found.discard(name)
    return found


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    exports = lazy_exports()
    return {name: imports_of(name, path, set(files), exports) for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_the_import_graph_is_read_including_imports_inside_functions():
    graph = import_graph()
    assert "headsurgeon.dtypes" in graph["headsurgeon.alibi"]
    assert "headsurgeon.loading" in graph["headsurgeon.checkpoints"]
    # headsurgeon/__init__.py imports progress through importlib.import_module
    assert "headsurgeon.progress" in graph["headsurgeon"]


def test_imports_in_functions_count_and_main_blocks_do_not():
    tree = ast.parse(
        "def f():\n    import headsurgeon.loading\n"
        "if __name__ == '__main__':\n    import headsurgeon.checkpoints\n"
    )
    imported = {
        alias.name
        for node in nodes_that_run(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    assert imported == {"headsurgeon.loading"}


def test_no_import_cycles_in_the_package():
    assert cycles(import_graph()) == []


def test_a_cycle_is_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_the_leaves_import_only_errors():
    for leaf in ("headsurgeon.dtypes", "headsurgeon.validation", "headsurgeon.inputs"):
        assert import_graph()[leaf] <= {"headsurgeon", "headsurgeon.errors"}


@pytest.mark.slow  # a subprocess
def test_the_alibi_math_loads_no_model_io():
    code = (
        "import sys, headsurgeon.alibi; "
        "print(sorted(m for m in sys.modules if m.startswith(('headsurgeon', 'transformers', "
        "'transformer_lens', 'safetensors', 'huggingface_hub', 'plotly'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    loaded = set(ast.literal_eval(out.strip().splitlines()[-1]))
    pure = {"alibi", "dtypes", "errors", "progress", "validation"}
    assert loaded <= {"headsurgeon"} | {f"headsurgeon.{m}" for m in pure}


def test_the_model_modules_docstrings_name_everything_they_export():
    for name in ("backend", "long_context", "dtypes", "loading", "exact_alibi", "checkpoints"):
        module = importlib.import_module(f"headsurgeon.{name}")
        unlisted = [n for n in module.__all__ if n not in module.__doc__]
        assert not unlisted, f"headsurgeon.{name}'s docstring does not name {unlisted}"
        assert all(hasattr(module, n) for n in module.__all__)


# --- the library imports neither plotting nor the command line ------------------------------------

# Modules that draw, write reports or parse command lines; nothing in the library imports them.
PRESENTATION = ("headsurgeon.plots", "headsurgeon.reports", "headsurgeon.cli")
# The library modules the issue names, checked in a fresh interpreter each.
LIBRARY = ("alibi", "probes", "census", "classify", "surgery", "finetune", "evals", "blindness",
           "repair", "data")  # fmt: skip
TOOLS = ("classify", "blindness", "repair")  # python -m headsurgeon.<tool>


def is_presentation(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in PRESENTATION)


def library_modules() -> dict[str, Path]:
    files = module_files().items()
    return {n: p for n, p in files if n != "headsurgeon" and not is_presentation(n)}


def test_no_library_module_imports_plotting_or_the_command_line_even_inside_functions():
    graph = import_graph()
    for name, path in library_modules().items():
        presentation = sorted(m for m in graph[name] if is_presentation(m))
        assert not presentation, f"{name} imports {presentation}"
        third_party = {
            alias.name.split(".")[0]
            for node in nodes_that_run(ast.parse(path.read_text()))
            if isinstance(node, ast.Import)
            for alias in node.names
        } | {
            (node.module or "").split(".")[0]
            for node in nodes_that_run(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom) and not node.level
        }
        assert not third_party & {"plotly", "argparse", "kaleido"}, (name, third_party)


def test_the_tools_main_blocks_hand_over_to_the_cli_package():
    files = module_files()
    for tool in TOOLS:
        tree = ast.parse(files[f"headsurgeon.{tool}"].read_text())
        [block] = [node for node in tree.body if is_main_block(node)]
        imported = {n.module for n in ast.walk(block) if isinstance(n, ast.ImportFrom)}
        assert imported == {f"headsurgeon.cli.{tool}"}, tool
        assert tree.body[-1] is block, f"headsurgeon.{tool}: the __main__ block comes last"


def test_console_scripts_are_the_cli_entries():
    import tomllib

    pyproject = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())
    scripts = pyproject["project"]["scripts"]
    assert scripts == {f"headsurgeon-{t}": f"headsurgeon.cli.{t}:entry" for t in TOOLS}
    for tool in TOOLS:
        assert callable(importlib.import_module(f"headsurgeon.cli.{tool}").entry)


@pytest.mark.slow
@pytest.mark.parametrize("name", LIBRARY)
def test_importing_a_library_module_loads_no_plotting_and_no_cli(name):
    code = (
        f"import sys, headsurgeon.{name}; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('plotly', 'kaleido') "
        f"or m.startswith({PRESENTATION!r})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    ).stdout
    assert ast.literal_eval(out.strip().splitlines()[-1]) == [], f"headsurgeon.{name}"


def test_plots_exports_every_public_function_and_names_it_in_its_docstring():
    import inspect

    from headsurgeon import plots

    public = {
        name
        for name, value in vars(plots).items()
        if not name.startswith("_")
        and (inspect.isfunction(value) or inspect.isclass(value))
        and value.__module__ == plots.__name__
    }
    assert public <= set(plots.__all__)
    assert all(hasattr(plots, name) for name in plots.__all__)
    unlisted = [name for name in plots.__all__ if name not in plots.__doc__]
    assert not unlisted, f"plots' docstring does not name {unlisted}"


def test_the_type_checking_imports_and_the_lazy_exports_agree():
    """What IDEs see (the TYPE_CHECKING block) is what ``import headsurgeon`` serves."""
    import headsurgeon

    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    spelled = {
        alias.name: node.module.removeprefix("headsurgeon.")
        for block in tree.body
        if isinstance(block, ast.If) and getattr(block.test, "id", None) == "TYPE_CHECKING"
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert spelled == headsurgeon._EXPORTS
    for name, module in headsurgeon._EXPORTS.items():
        assert getattr(headsurgeon, name) is getattr(
            importlib.import_module(f"headsurgeon.{module}"), name
        ), name


@pytest.mark.parametrize("name", sorted(module_files()))
def test_every_module_declares_and_documents_what_it_exports(name):
    """``__all__`` holds every public function and class, and the docstring names each of them
    (the docstring's list of exports cannot drift from the code)."""
    path = module_files()[name]
    tree = ast.parse(path.read_text())
    if name == "headsurgeon":
        return  # the package gathers its API in _EXPORTS (tested above)
    declared = [
        node.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and [getattr(t, "id", None) for t in node.targets] == ["__all__"]
    ]
    assert declared, f"{name} has no __all__"
    exported = ast.literal_eval(declared[0])
    defined = {
        node.name
        for node in tree.body
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_")
    }
    assert defined <= set(exported), f"{name}: public but not in __all__: {defined - set(exported)}"
    docstring = ast.get_docstring(tree) or ""
    undocumented = [n for n in exported if n not in docstring]
    assert not undocumented, f"{name}'s docstring does not name {undocumented}"


def test_only_the_backend_imports_transformer_lens():
    """Both TransformerLens majors stay one module's business (issue 15)."""
    importers = set()
    for name, path in module_files().items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            if any(n.split(".")[0] == "transformer_lens" for n in names):
                importers.add(name)
    assert importers == {"headsurgeon.backend"}
