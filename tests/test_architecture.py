"""The package's layering: each module imports only from its own layer or the layers below (the
docs/architecture.md's table, :data:`LAYERS`), no import cycles (function-level imports count), pure
math stays pure, the library imports neither plotting nor the command line, and the tools enter
through ``cli/`` only (every ``__main__.py`` is an entry, the layer above presentation)."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "headsurgeon"


def page_layers() -> dict[str, tuple[str, ...]]:
    """The layers of docs/architecture.md's table, lowest first: layer -> its modules (the names
    in backticks of its second column). A module may import from its own layer and the layers
    below, never above. A module of a subpackage (``repair.pipeline``) is in its package's layer;
    a new module is placed in the page's table first (test_every_module_has_a_layer). Every
    ``__main__`` module (``headsurgeon/__main__.py``, ``headsurgeon/classify/__main__.py``...) is
    an entry, whatever package it lies in."""
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    rows = [line.split("|")[1:3] for line in page.splitlines() if line.startswith("| ")]
    return {
        layer.strip(): tuple(re.findall(r"`(\w+)`", modules))
        for layer, modules in rows
        if layer.strip() != "layer"
    }


LAYERS = page_layers()


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
    """``headsurgeon``'s public names -> the module that serves each on first use: its
    ``_EXPORTS``, and the specialist names it still serves for one release (``_MOVED``)."""
    import headsurgeon

    return {
        **{name: module for name, (module, _) in headsurgeon._EXPORTS.items()},
        **headsurgeon._MOVED,
    }


def type_checking_imports() -> dict[str, tuple[str, str]]:
    """Public name -> (module, its name there): the imports of ``__init__.py``'s
    ``TYPE_CHECKING`` block, which IDEs and type checkers read."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text(encoding="utf-8"))
    [block] = [node for node in tree.body if is_type_checking_block(node)]
    return {
        alias.asname or alias.name: (node.module, alias.name)
        for node in block.body
        if isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names
    }


def is_entry(module: str) -> bool:
    """A ``__main__`` module: what ``python -m`` runs, and nothing imports."""
    return module.split(".")[-1] == "__main__"


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
    # headsurgeon/__init__.py serves the version through importlib.import_module
    assert "headsurgeon.outputs" in graph["headsurgeon"]
    assert "headsurgeon.progress" in graph["headsurgeon.backend"]


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


def test_a_package_importing_its_own_modules_is_no_cycle_but_importing_its_init_is(tmp_path):
    modules = {"headsurgeon", "headsurgeon.repair", "headsurgeon.repair.policy"}
    path = tmp_path / "pipeline.py"
    path.write_text("from headsurgeon.repair.policy import f\n")
    assert imports_of("headsurgeon.repair.pipeline", path, modules, {}) == {
        "headsurgeon.repair.policy"
    }
    path.write_text("from headsurgeon.repair.policy import f\nfrom headsurgeon.repair import g\n")
    assert imports_of("headsurgeon.repair.pipeline", path, modules, {}) == {
        "headsurgeon.repair",
        "headsurgeon.repair.policy",
    }


def test_a_cycle_is_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_the_leaves_import_only_errors_and_the_defaults():
    graph = import_graph()
    assert graph["headsurgeon.defaults"] == set()  # imports nothing, so every layer may read it
    for leaf in ("headsurgeon.dtypes", "headsurgeon.validation", "headsurgeon.inputs"):
        assert graph[leaf] <= {"headsurgeon", "headsurgeon.errors", "headsurgeon.defaults"}


# --- the layer order ------------------------------------------------------------------------------

LAYER_OF = {module: rank for rank, modules in enumerate(LAYERS.values()) for module in modules}
LAYER_NAMES = list(LAYERS)


def layer_of(module: str) -> int | None:
    """The rank of ``module``'s layer in :data:`LAYERS` (0: leaves; entries: every ``__main__``);
    None for the package root, the lazy facade that serves every layer's names (it imports only
    ``outputs``, for the version, itself)."""
    parts = module.split(".")
    if is_entry(module):
        return LAYER_OF["__main__"]
    return None if len(parts) == 1 else LAYER_OF.get(parts[1], -1)


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """One line per import that goes up the layers, naming both modules and their layers."""
    problems = []
    for name in sorted(graph):
        own = layer_of(name)
        for target in sorted(graph[name]):
            theirs = layer_of(target)
            if own is not None and theirs is not None and theirs > own:
                problems.append(
                    f"{name} ({LAYER_NAMES[own]}) imports {target} ({LAYER_NAMES[theirs]}): a "
                    "module may import only from its own layer or the layers below "
                    "(docs/architecture.md; tests/test_architecture.py: LAYERS)"
                )
    return problems


def test_every_module_has_a_layer():
    unplaced = sorted(name for name in module_files() if layer_of(name) == -1)
    assert not unplaced, f"place {unplaced} in a layer of LAYERS (and docs/architecture.md's table)"
    placed = [module for modules in LAYERS.values() for module in modules]
    assert len(placed) == len(set(placed)), "a module is in two layers"


def test_the_architecture_page_names_the_layers_lowest_first():
    assert list(LAYERS) == ["leaves", "pure math", "models", "library", "presentation", "entries"]
    assert LAYERS["entries"] == ("__main__",)


def test_each_module_imports_only_from_its_own_layer_or_below():
    problems = layer_violations(import_graph())
    assert not problems, "\n".join(problems)


def test_an_import_up_the_layers_is_named():
    graph = {
        "headsurgeon.checkpoints": {"headsurgeon.surgery", "headsurgeon.heads"},
        "headsurgeon.heads": {"headsurgeon.errors"},
        "headsurgeon.repair.pipeline": {"headsurgeon.repair.policy", "headsurgeon.loading"},
        "headsurgeon": {"headsurgeon.progress"},
    }
    assert layer_violations(graph) == [
        "headsurgeon.checkpoints (models) imports headsurgeon.surgery (library): a module may "
        "import only from its own layer or the layers below (docs/architecture.md; "
        "tests/test_architecture.py: LAYERS)"
    ]


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
    pure = {"alibi", "defaults", "dtypes", "errors", "progress", "validation"}
    assert loaded <= {"headsurgeon"} | {f"headsurgeon.{m}" for m in pure}


# --- the library imports neither plotting nor the command line ------------------------------------

# Modules that draw, write reports or parse command lines; nothing in the library imports them.
PRESENTATION = ("headsurgeon.plots", "headsurgeon.reports", "headsurgeon.cli")
# The library modules the issue names, checked in a fresh interpreter each.
LIBRARY = (
    "alibi",
    "probes",
    "census",
    "classify",
    "surgery",
    "finetune",
    "evals",
    "blindness",
    "repair",
    "data",
    # the modules behind the lazy packages (importing a package alone loads none of them)
    "classify.labels",
    "blindness.analysis",
    "repair.pipeline",
)
TOOLS = importlib.import_module("headsurgeon.__main__").TOOLS  # python -m headsurgeon TOOL


def is_presentation(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in PRESENTATION)


def library_modules() -> dict[str, Path]:
    files = module_files().items()
    return {
        n: p for n, p in files if n != "headsurgeon" and not is_presentation(n) and not is_entry(n)
    }


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


def test_tools_enter_through_the_cli_package_only():
    """No library module has a ``__main__`` block; each tool's package keeps, for one release, a
    ``__main__.py`` (``python -m headsurgeon.TOOL``) that imports only ``headsurgeon.cli`` and
    calls its ``deprecated_entry``."""
    files = module_files()
    for name, path in files.items():
        if not is_entry(name):
            blocks = [node for node in ast.parse(path.read_text()).body if is_main_block(node)]
            assert not blocks or is_presentation(name), f"{name} has a __main__ block"
    for tool in TOOLS:
        tree = ast.parse(files[f"headsurgeon.{tool}.__main__"].read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
            alias.name for n in ast.walk(tree) if isinstance(n, ast.Import) for alias in n.names
        }
        assert imported == {"headsurgeon.cli"}, tool
        assert is_main_block(tree.body[-1]), f"headsurgeon.{tool}: the __main__ block comes last"
    # python -m headsurgeon TOOL calls cli.run(TOOL), which imports headsurgeon.cli.TOOL by name
    # (test_cli checks it runs)
    graph = import_graph()
    assert graph["headsurgeon.__main__"] == {
        "headsurgeon",
        "headsurgeon.cli",
        "headsurgeon.outputs",
    }
    # cli/__init__.py imports nothing heavy: run installs the Ctrl-C handler before the tool loads
    assert graph["headsurgeon.cli"] <= {
        "headsurgeon",
        "headsurgeon.errors",
        "headsurgeon.allocator",
        "headsurgeon.cli.session",
    }


def test_only_the_root_serves_names_through_a_module_getattr():
    """A package imports its names (the tools parse before their heavy imports, in cli/); the
    root's ``__getattr__`` (its lazy API and the names leaving it) is the only one."""
    found = sorted(
        name
        for name, path in module_files().items()
        for node in ast.parse(path.read_text(encoding="utf-8")).body
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__"
    )
    assert found == ["headsurgeon"]


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


def test_plots_serves_every_public_name_of_its_modules():
    """``from headsurgeon.plots import f`` works for every public function and class of its
    modules (a setting such as ``notebook.NOTEBOOK_OUTPUTS`` is set on its own module); the
    helpers the figure modules share stay out of ``__all__`` (and of the API reference)."""
    import pkgutil

    from headsurgeon import plots

    for info in pkgutil.iter_modules(plots.__path__):
        module = importlib.import_module(f"{plots.__name__}.{info.name}")
        functions = {n for n in module.__all__ if callable(getattr(module, n))}
        assert functions <= set(plots.__all__), module.__name__
    assert all(hasattr(plots, name) for name in plots.__all__)


def test_the_type_checking_imports_are_what_the_package_serves():
    """What IDEs see (the TYPE_CHECKING block) is what ``import headsurgeon`` serves: one list."""
    import headsurgeon

    assert type_checking_imports() == headsurgeon._EXPORTS
    assert sorted(headsurgeon._EXPORTS) == headsurgeon.__all__ == dir(headsurgeon)
    assert {
        "repair_heads",
        "finetune_heads",
        "classify_heads",
        "reinit_heads",
        "ablate_heads",
    } <= set(headsurgeon.__all__)
    for name, (module, attribute) in headsurgeon._EXPORTS.items():
        assert getattr(headsurgeon, name) is getattr(importlib.import_module(module), attribute)
    assert headsurgeon.repair_heads is importlib.import_module("headsurgeon.repair").repair
    assert headsurgeon.finetune_heads is importlib.import_module("headsurgeon.finetune").finetune


def declared_all(tree: ast.Module) -> list[str] | None:
    """A module's ``__all__`` as written (a list of strings), None without one."""
    for node in tree.body:
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if [getattr(t, "id", None) for t in targets] == ["__all__"]:
                return ast.literal_eval(node.value)  # the root's is computed: not read here
    return None


def bound_names(tree: ast.Module) -> set[str]:
    """The names a module binds at its top level: definitions, assignments, imports."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.ClassDef) and node in tree.body:
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


# The public surface: the distinct names of every module's __all__ (issue 53: at most 400; 638
# before, when every helper another file used was listed).
MAX_PUBLIC_NAMES = 400


@pytest.mark.parametrize("name", sorted(module_files()))
def test_every_module_declares_its_public_names(name):
    """``__all__`` is the public surface (what the API reference shows); every other name is
    internal: a plain name may serve the package's other modules, an underscored one only its
    file. ``__all__`` names only what the module binds, never an underscored name."""
    if name == "headsurgeon":
        return  # the root gathers its API in its TYPE_CHECKING block (tested above)
    tree = ast.parse(module_files()[name].read_text(encoding="utf-8"))
    exported = declared_all(tree)
    assert exported is not None, f"{name} has no __all__"
    assert not [n for n in exported if n.startswith("_")], name
    missing = set(exported) - bound_names(tree)
    assert not missing, f"{name}'s __all__ names what it does not define: {sorted(missing)}"


def test_the_public_surface_stays_small():
    import headsurgeon

    public = set(headsurgeon.__all__) | {
        n
        for name, path in module_files().items()
        if name != "headsurgeon"
        for n in declared_all(ast.parse(path.read_text(encoding="utf-8"))) or []
    }
    assert len(public) <= MAX_PUBLIC_NAMES, (
        f"{len(public)} public names: a helper other modules share stays out of __all__"
    )


def test_only_the_backend_imports_transformer_lens():
    """Both TransformerLens majors stay one package's business (issue 15)."""
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
    assert importers and all(
        name == "headsurgeon.backend" or name.startswith("headsurgeon.backend.")
        for name in importers
    ), importers


def test_only_the_backend_reads_the_transformer_lens_major():
    """What differs between TransformerLens 3.x and 4.x is asked of the backend by name
    (``backend.wraps_hf_model``, ``backend.TRANSFORMER_LENS``, ...), never as ``MAJOR``."""
    readers = {
        name
        for name, path in module_files().items()
        if not (name == "headsurgeon.backend" or name.startswith("headsurgeon.backend."))
        and re.search(r"\bMAJOR\b", path.read_text(encoding="utf-8"))
    }
    assert not readers, sorted(readers)


def test_the_major_is_compared_once():
    """The backend object is chosen once (``backend.BACKEND``); no other line compares ``MAJOR``
    (issue 53, item 3)."""
    comparisons = [
        name
        for name, path in module_files().items()
        for line in path.read_text(encoding="utf-8").splitlines()
        if re.search(r"\bMAJOR\s*(<|>|==|!=)|(<|>|==|!=)\s*MAJOR\b", line)
    ]
    assert comparisons == ["headsurgeon.backend"], comparisons


# The modules that may spell a family's model_type, and why: name tables, not branches.
FAMILY_NAME_TABLES = {
    "headsurgeon.families": "the family classes",
    "headsurgeon.loading.numerics": "the published models by name (bloom-560m, ..., bloom)",
    "headsurgeon.loading.checks": "the weight names of every model family, ALiBi or not",
    "headsurgeon.evals.retrieval": "a needle word (falcon), not a family",
    "headsurgeon.checkpoints": "model_card's doctest, a config.json in words",
}


def test_no_family_name_outside_the_family_classes_and_the_name_tables():
    """What differs between BLOOM, MPT and Falcon is a member of its class in
    :mod:`headsurgeon.families`, never a branch on its name (issue 53, item 3)."""
    spelled = {
        name
        for name, path in module_files().items()
        if re.search(r"""["'](bloom|mpt|falcon)["']""", path.read_text(encoding="utf-8"))
    }
    assert spelled <= set(FAMILY_NAME_TABLES), sorted(spelled - set(FAMILY_NAME_TABLES))


MAX_MODULE_LINES = 800


def test_no_module_is_longer_than_800_lines():
    """A module past 800 lines is split by what its parts do (issue 40, item 4)."""
    long = {
        name: n
        for name, path in module_files().items()
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules above {MAX_MODULE_LINES} lines: {long}"


MAX_DOCSTRING_LINES = 30


def test_no_public_docstring_is_longer_than_a_screen():
    """A public function's or class's docstring (a module's top-level name in its ``__all__``)
    holds a summary, a usage example, one line a parameter and a link to the page that explains:
    at most 30 lines, as analyses/architecture_metrics.py counts them (issue 53, item 5)."""
    long = {}
    for name, path in module_files().items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        exported = {  # a literal __all__'s names (the root's is computed and defines nothing)
            element.value
            for node in tree.body
            if isinstance(node, ast.Assign)
            and [getattr(t, "id", None) for t in node.targets] == ["__all__"]
            for element in getattr(node.value, "elts", [])
            if isinstance(element, ast.Constant)
        }
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name in exported:
                n = len((ast.get_docstring(node) or "").splitlines())
                if n > MAX_DOCSTRING_LINES:
                    long[f"{name}.{node.name}"] = n
    assert not long, f"public docstrings above {MAX_DOCSTRING_LINES} lines: {long}"


DOCS = PACKAGE.parent / "docs"


def heading_ids(page: Path) -> set[str]:
    """The ids mkdocs' toc gives a page's headings (Python-Markdown's default slugify)."""
    ids = set()
    for line in page.read_text(encoding="utf-8").splitlines():
        if match := re.match(r"#+\s+(.*)", line):
            text = re.sub(r"[^\w\s-]", "", match.group(1).replace("`", "")).strip().lower()
            ids.add(re.sub(r"[-\s]+", "-", text))
    return ids


def test_the_docs_links_of_the_docstrings_resolve():
    """A docstring's link to the page that explains (``[...](../tools/x.md#heading)``, relative
    to docs/api/, where the API pages render it) names a page and heading that exist: mkdocs
    checks neither in what mkdocstrings renders."""
    broken = []
    for name, path in module_files().items():
        for target in re.findall(r"\]\(([^)\s]+\.md(?:#[^)\s]*)?)\)", path.read_text("utf-8")):
            page, _, anchor = target.partition("#")
            file = (DOCS / "api" / page).resolve()
            if not file.is_file() or (anchor and anchor not in heading_ids(file)):
                broken.append(f"{name}: {target}")
    assert not broken, broken


# --- the root: a small API, no side effects -------------------------------------------------------


@pytest.mark.slow  # a subprocess
@pytest.mark.parametrize("argv0", ["", "-m"])  # "-m": while python -m imports a tool's parents
def test_importing_headsurgeon_loads_no_torch_and_leaves_ctrl_c_alone(argv0):
    code = (
        f"import signal, sys; sys.argv[0] = {argv0!r}; before = signal.getsignal(signal.SIGINT); "
        "import headsurgeon; "
        "print(signal.getsignal(signal.SIGINT) is before, "
        "sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformer_lens')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip().splitlines()[-1] == "True []"


def test_dir_shows_the_api_and_the_version_is_the_installed_one():
    from importlib.metadata import version

    import headsurgeon

    assert dir(headsurgeon) == sorted(headsurgeon._EXPORTS)
    assert 25 <= len(dir(headsurgeon)) <= 35
    assert not {"ast", "os", "sys", "importlib", "signal", "Path"} & set(dir(headsurgeon))
    assert headsurgeon.__version__ == version("headsurgeon")


@pytest.mark.parametrize("name", ["sink_rate", "HeadStats", "run_in_blocks"])
def test_a_specialist_name_warns_and_names_its_module(name):
    import headsurgeon

    module = headsurgeon._MOVED[name]
    with pytest.warns(DeprecationWarning, match=rf"from {module} import {name}"):
        value = getattr(headsurgeon, name)
    assert value is getattr(importlib.import_module(module), name)
    assert name not in headsurgeon.__all__
    assert not set(headsurgeon._MOVED) & set(headsurgeon._EXPORTS)


def test_modules_are_attributes_of_the_root_and_a_typo_is_an_attribute_error():
    import headsurgeon

    assert headsurgeon.plots is importlib.import_module("headsurgeon.plots")
    with pytest.raises(AttributeError, match="no attribute 'lod_model'"):
        headsurgeon.lod_model  # noqa: B018


def test_the_tests_mirror_the_package():
    """Each package of headsurgeon has its tests in the folder of its name (tests/repair/ for
    headsurgeon/repair/), and pytest's pythonpath names every such folder (their helpers import
    one another by module name)."""
    import tomllib

    root = PACKAGE.parent
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    folders = {p.parent.name for p in (root / "tests").glob("*/test_*.py")}
    assert packages == folders, (sorted(packages - folders), sorted(folders - packages))
    config = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))
    pythonpath = config["tool"]["pytest"]["ini_options"]["pythonpath"]
    assert sorted(pythonpath) == sorted(["tests", *(f"tests/{name}" for name in packages)])


# --- an underscore means "this file only" ---------------------------------------------------------

# (importer, name, reason): the only underscored names a package module may take from another
# file. A name another file needs has a plain name (in ``__all__`` only if it is public), so the
# list stays empty unless a reason is written here (issue 40, item 4).
PRIVATE_IMPORTS: tuple[tuple[str, str, str], ...] = ()


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_uses(name: str, source: str, modules: set[str], is_package: bool) -> set[str]:
    """``module._name`` for every underscored name ``name``'s source takes from another package
    module: ``from headsurgeon.x import _y`` (relative too) and ``x._y`` on an imported module
    (``import headsurgeon.x as x``, ``from headsurgeon import x``), functions included."""
    tree = ast.parse(source)
    found: set[str] = set()
    bound: dict[str, str] = {}  # local name -> the package module it is
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "headsurgeon":
                    bound[alias.asname or "headsurgeon"] = (
                        alias.name if alias.asname else "headsurgeon"
                    )
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = name.split(".")
                base = parts[: len(parts) - node.level + is_package]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            for alias in node.names:
                if f"{module}.{alias.name}" in modules:
                    bound[alias.asname or alias.name] = f"{module}.{alias.name}"
                elif module in modules and module != name and is_private(alias.name):
                    found.add(f"{module}.{alias.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_private(node.attr):
            chain, value = [], node.value
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in bound:
                module = ".".join([bound[value.id], *reversed(chain)])
                if module in modules and module != name:
                    found.add(f"{module}.{node.attr}")
    return found


def test_private_uses_are_found_in_both_forms():
    modules = {"headsurgeon", "headsurgeon.plots", "headsurgeon.plots.layout", "headsurgeon.data"}
    source = (
        "from headsurgeon.plots.layout import _check, style\n"
        "from . import layout as lay\n"
        "import headsurgeon.data as data\n"
        "import headsurgeon\n"
        "def f(self):\n"
        "    return lay._wrap, data._texts, headsurgeon.data._more, self._own, _local\n"
    )
    found = private_uses("headsurgeon.plots.grids", source, modules, is_package=False)
    assert found == {
        "headsurgeon.plots.layout._check",
        "headsurgeon.plots.layout._wrap",
        "headsurgeon.data._texts",
        "headsurgeon.data._more",
    }


def test_no_module_uses_another_files_private_names():
    files = module_files()
    found = {
        (importer, use)
        for importer, path in files.items()
        for use in private_uses(importer, path.read_text(), set(files), path.name == "__init__.py")
    }
    allowed = {(importer, name) for importer, name, _ in PRIVATE_IMPORTS}
    assert len(PRIVATE_IMPORTS) <= 5, "an underscore means 'this file only': drop it instead"
    assert found <= allowed, sorted(found - allowed)
