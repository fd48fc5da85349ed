"""``python -m headsurgeon.blindness``: the command-line tool :mod:`headsurgeon.cli.blindness`,
the same entry as ``python -m headsurgeon blindness`` and ``headsurgeon-blindness``.

Exports nothing. Importing ``headsurgeon.cli`` (the parent of the tool's module) installs the
Ctrl-C handler of a starting tool before its heavy imports.
"""

from headsurgeon.cli.blindness import entry

__all__ = []

if __name__ == "__main__":
    entry()
