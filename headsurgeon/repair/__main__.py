"""``python -m headsurgeon.repair``: the command-line tool, :mod:`headsurgeon.cli.repair`.

Exports nothing. The import stays under ``__main__``, as in the other tools' modules: nothing
that imports the library loads the command line (``tests/test_architecture.py``).
"""

__all__ = []

if __name__ == "__main__":
    from headsurgeon.cli.repair import entry

    entry()
