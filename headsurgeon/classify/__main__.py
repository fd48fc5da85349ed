"""``python -m headsurgeon.classify``: the command-line tool :mod:`headsurgeon.cli.classify`,
the same entry as ``python -m headsurgeon classify`` and ``headsurgeon-classify``.

Exports nothing. Importing ``headsurgeon.cli`` (the parent of the tool's module) installs the
Ctrl-C handler of a starting tool before its heavy imports.
"""

from headsurgeon.cli.classify import entry

__all__ = []

if __name__ == "__main__":
    entry()
