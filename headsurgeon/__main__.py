"""``python -m headsurgeon TOOL [ARGS]``: the command-line tools, one entry.

``python -m headsurgeon classify ARGS`` is ``headsurgeon-classify ARGS`` (and so for
``blindness`` and ``repair``): each reaches ``headsurgeon.cli.TOOL.main`` with ARGS, through
:func:`headsurgeon.cli.run`. ``--help`` lists the tools, ``--version`` prints the version;
no tool or an unknown one is a one-line usage error (exit status 2).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["TOOLS", "main"]

TOOLS = ("classify", "blindness", "repair")
_USAGE = f"usage: python -m headsurgeon {{{','.join(TOOLS)}}} [ARGS]"
_HELP = f"""{_USAGE}

The command-line tools of headsurgeon (each tool's --help lists its options):
  classify    census of every attention head, a label per head, tables and figures
  blindness   underflow blindness of ALiBi heads per dtype: analytic, measured, mitigated
  repair      surgical repair of dead and BOS-sink heads

options:
  -h, --help  show this message and exit
  --version   show headsurgeon's version and exit
"""


def main(argv: Sequence[str] | None = None) -> None:
    """Run the tool ``argv[0]`` with the rest of ``argv`` (default: ``sys.argv[1:]``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (["-h"], ["--help"]):
        print(_HELP, end="")
        sys.exit(0)
    if args[:1] == ["--version"]:
        from headsurgeon.outputs import headsurgeon_version

        print(f"headsurgeon {headsurgeon_version()}")
        sys.exit(0)
    if not args or args[0] not in TOOLS:
        problem = f"unknown tool {args[0]!r}" if args else "no tool named"
        print(f"error: {problem}; {_USAGE} (--help lists the tools)", file=sys.stderr)
        sys.exit(2)
    from headsurgeon import cli  # imports nothing heavy: the tool itself is imported by run

    cli.run(args[0], args[1:])


if __name__ == "__main__":
    main()
