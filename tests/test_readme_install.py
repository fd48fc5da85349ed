"""The README's install is what the CI runs: the same virtual environment steps and the same
package specifications, for TransformerLens 3.x, 4.x and the docs."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN = (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def install_section() -> str:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    start = readme.index("<!-- --8<-- [start:install] -->")
    return readme[start : readme.index("<!-- --8<-- [end:install] -->")]


def readme_installs() -> list[list[str]]:
    """The arguments of every ``pip install`` of the README's install section, quotes removed,
    ``--upgrade pip`` left out."""
    found = []
    for match in re.finditer(r"pip install ([^\n`#]+)", install_section()):
        words = shlex.split(match.group(1))
        if words != ["--upgrade", "pip"]:
            found.append(words)
    return found


def ci_environments() -> dict[str, list[str]]:
    """``.ci/run``'s environments: folder -> what its ``fresh_venv`` installs (torch first)."""
    (torch,) = re.findall(r"install -q (torch==[0-9.]+)", RUN)
    return {
        folder: [torch, *args]
        for line in RUN.splitlines()
        if line.startswith("fresh_venv ")
        for folder, *args in [shlex.split(line.removeprefix("fresh_venv "))]
    }


def test_the_readme_install_is_what_the_ci_installs():
    readme, ci = readme_installs(), ci_environments()
    assert readme[0] == ci[".venv-ci"]  # the default: TransformerLens 3.x
    assert ci[".venv-docs"] in readme
    # TransformerLens 4.x: the default line with the README's 4.x specification, as the CI's.
    assert [*readme[0][:-1], "transformer-lens>=4,<5"] == ci[".venv-ci4"]
    assert '"transformer-lens>=4,<5"' in install_section()
    # Both start from a fresh virtual environment and upgrade pip.
    assert "python3 -m venv" in install_section() and "python3 -m venv" in RUN
    assert "pip install --upgrade pip" in install_section()
    assert "pip install -q --upgrade pip" in RUN
    # The CPU build's source is the wheel index PyTorch documents for it.
    assert "https://download.pytorch.org/whl/cpu" in install_section()
