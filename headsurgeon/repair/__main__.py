"""``python -m headsurgeon.repair``: the command-line tool :mod:`headsurgeon.cli.repair`,
the same entry as ``python -m headsurgeon repair`` and ``headsurgeon-repair``.

Exports nothing. Importing ``headsurgeon.cli`` (the parent of the tool's module) installs the
Ctrl-C handler of a starting tool before its heavy imports.
"""

from headsurgeon.cli.repair import entry

__all__ = []

if __name__ == "__main__":
    entry()
