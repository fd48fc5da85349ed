"""How long the README's first commands take, as written (issue 52).

    python analyses/benchmarks/first_commands.py [--skip-full-repair]

Runs each command of the README's "First commands" block in a fresh temporary folder, in turn,
then the full repair (the README's repair without its quick-form options), and records for
each: wall-clock seconds, the CPU seconds of the process (user + system: what it costs on an
idle machine with one thread), the machine's load average before and after, and whether the
output line the README quotes for it appeared, as written. Writes
``figures/benchmarks/first_commands.{json,md}`` and prints the table.

A busy machine stretches the wall time and not the CPU time: compare the CPU column across
machines, the wall column only with its load.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "figures" / "benchmarks" / "first_commands"
QUICK = {"--passes": 1, "--steps": 1, "--no-control": 0}  # the quick form's options: values


def readme_commands() -> list[str]:
    """The ``python -m headsurgeon`` lines of the README's commands block, comments removed."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = readme.split("[start:commands]", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


def quoted_lines() -> list[str]:
    """The output lines the README quotes (in backticks, after "prints" or "ends with")."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("[start:commands]", 1)[1].split("[end:commands]", 1)[0]
    found = re.findall(r"(?:prints, among its lines,|ends with)\s+`([^`]+)`", section)
    return [re.sub(r"\s+", " ", quote) for quote in found]  # a quote may wrap in the README


def full_repair(commands: list[str]) -> str:
    """The README's repair without its quick-form options: the default run."""
    (repair,) = [c for c in commands if " repair " in c]
    words, kept = iter(shlex.split(repair)), []
    for word in words:
        if word in QUICK:
            for _ in range(QUICK[word]):
                next(words)
        else:
            kept.append(word)
    return shlex.join(kept).replace("--out repaired", "--out repaired-full")


def run(command: str) -> dict:
    """One command in a fresh folder: its times, load and output."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load = os.getloadavg()[0]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        argv = [sys.executable, *shlex.split(command)[1:]]
        done = subprocess.run(argv, cwd=folder, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    output = done.stdout + done.stderr
    return {
        "command": command,
        "exit": done.returncode,
        "wall_s": round(wall, 1),
        "cpu_s": round(cpu, 1),
        "load_before": round(load, 2),
        "load_after": round(os.getloadavg()[0], 2),
        "quoted_seen": [q for q in quoted_lines() if q.removesuffix("...").rstrip(". ") in output],
    }


def table(rows: list[dict], machine: str) -> str:
    lines = [
        "The README's first commands, run as written, each in a fresh folder "
        "(`python analyses/benchmarks/first_commands.py`).",
        "",
        f"Machine: {machine}.",
        "",
        "| command | exit | wall (s) | CPU (s) | load before → after |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| `{r['command']}` | {r['exit']} | {r['wall_s']:.0f} | {r['cpu_s']:.0f} | "
            f"{r['load_before']:.1f} → {r['load_after']:.1f} |"
        )
    seen = [q for r in rows for q in r["quoted_seen"]]
    lines += [
        "",
        "CPU seconds are the user + system time of the tool's process and its children: the "
        "compute a command needs, whatever the load. Its wall time on an idle machine is at "
        "least that with one thread (plus waits: files, the browser's start); other jobs' load "
        "stretches it (the load columns). Lines the README quotes, seen in the outputs as "
        "written: " + ("; ".join(f"`{q}`" for q in seen) if seen else "none") + ".",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-full-repair", action="store_true")
    args = parser.parse_args()
    commands = readme_commands()
    if not args.skip_full_repair:
        commands.append(full_repair(commands))
    machine = (
        f"{os.cpu_count()} cores, Python {platform.python_version()}, "
        f"torch {version('torch')}, transformer-lens {version('transformer-lens')}, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}"
    )
    rows = []
    for command in commands:
        print(f"running: {command}", flush=True)
        rows.append(run(command))
        print(json.dumps(rows[-1]), flush=True)
        # After each command: an interrupted run keeps the ones done.
        OUT.with_suffix(".json").write_text(
            json.dumps({"machine": machine, "runs": rows}, indent=1)
        )
        OUT.with_suffix(".md").write_text(table(rows, machine))
    print(table(rows, machine))


if __name__ == "__main__":
    main()
