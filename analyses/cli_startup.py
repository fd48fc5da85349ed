"""How fast the command-line tools answer what needs no model (issue 42, item 1; issue 53).

    python analyses/cli_startup.py [--runs 5] [--baseline CHECKOUT]

Times, in fresh interpreters, each entry of each tool (``python -m headsurgeon TOOL`` and the
console script's function ``headsurgeon.cli.TOOL:entry``) on ``--help``, an unknown model name
(``bloom-56m``) and a bad path (``--texts missing.txt``): the median and the slowest of
``--runs`` wall-clock runs each; and the deprecated ``python -m headsurgeon.TOOL --help`` (2 runs:
it imports the library package first, then warns). In the same run it times ``python -c "import
torch, transformer_lens"``, what every answer cost before the tools parsed their options ahead of
their heavy imports, so that the numbers compare on a machine whose load changes; with
``--baseline``, also ``python -m headsurgeon classify`` from another checkout (the code before
the change: ``git archive COMMIT | tar -x -C /tmp/before``). Writes the table to
``analyses/cli_startup.txt`` (with the machine's cores and load) and prints it.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ("classify", "blindness", "repair")
ENTRIES = {
    "python -m headsurgeon {tool}": ["-m", "headsurgeon", "{tool}"],
    "headsurgeon-{tool}": ["-c", "from headsurgeon.cli.{tool} import entry; entry()"],
}
CASES = {
    "--help": (["--help"], 0),
    "unknown model": (["bloom-56m"], 2),
    "bad path": (["--texts", "missing.txt"], 2),
}
REFERENCE = ["-c", "import torch, transformer_lens"]


def timed(argv: list[str], status: int, runs: int, cwd: str, root: Path = ROOT) -> list[float]:
    """Wall seconds of ``runs`` runs of ``python argv`` with the package of the checkout
    ``root`` (each must exit with ``status``)."""
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    seconds = []
    for _ in range(runs):
        start = time.perf_counter()
        done = subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True)
        seconds.append(time.perf_counter() - start)
        if done.returncode != status:
            raise SystemExit(f"{argv} exited {done.returncode}: {done.stderr.decode()[-500:]}")
    return seconds


def row(name: str, seconds: list[float]) -> str:
    return f"{name:<58} {statistics.median(seconds):7.2f} {max(seconds):7.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="runs of each command (default 5)")
    parser.add_argument("--baseline", type=Path, help="another checkout to time")
    options = parser.parse_args()
    runs = options.runs
    lines = [
        f"CLI startup, {runs} runs each: median and slowest wall seconds",
        f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at the start "
        f"(shared with other jobs); Python {platform.python_version()}, torch {version('torch')}, "
        f"transformer-lens {version('transformer-lens')}",
        "",
        f"{'command':<58} {'median':>7} {'max':>7}",
    ]
    with tempfile.TemporaryDirectory() as cwd:  # no missing.txt, and nothing is written here
        reference = timed(REFERENCE, 0, max(2, runs // 2), cwd)
        lines.append(row('python -c "import torch, transformer_lens"', reference))
        if options.baseline:
            for case, (args, status) in CASES.items():
                command = ["-m", "headsurgeon", "classify", *args]
                seconds = timed(command, status, runs, cwd, root=options.baseline.resolve())
                lines.append(row(f"baseline: python -m headsurgeon classify {case}", seconds))
        for tool in TOOLS:
            for entry, argv in ENTRIES.items():
                for case, (args, status) in CASES.items():
                    command = [a.format(tool=tool) for a in argv] + args
                    name = f"{entry.format(tool=tool)} {case}"
                    lines.append(row(name, timed(command, status, runs, cwd)))
        for tool in TOOLS:  # the deprecated entry, for one release
            seconds = timed(["-m", f"headsurgeon.{tool}", "--help"], 0, 2, cwd)
            lines.append(row(f"python -m headsurgeon.{tool} --help (deprecated)", seconds))
    lines.append(f"\nload average at the end: {os.getloadavg()[0]:.2f}")
    text = "\n".join(lines) + "\n"
    (ROOT / "analyses" / "cli_startup.txt").write_text(text, encoding="utf-8")
    print(text, end="")


if __name__ == "__main__":
    main()
