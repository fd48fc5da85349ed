"""Check the snapshot of TransformerLens's model names against the installed version.

    python analyses/hub_names.py

``headsurgeon/hub_names.json`` holds one table (official names and aliases, lower case ->
official name) and the TransformerLens versions it was read from;
:func:`headsurgeon.model_names.hub_names` answers from it when one of those is installed, so that
the tools refuse an unknown model name without importing TransformerLens. Run this with each
TransformerLens major (3.x and 4.x environments) after upgrading TransformerLens: the installed
version is added when its table is the snapshot's, and otherwise the snapshot becomes its table
(the other versions then ask TransformerLens itself: slow, still exact).
``tests/test_model_names.py`` says when the snapshot is out of date.
"""

from __future__ import annotations

import json

from headsurgeon import backend
from headsurgeon.model_names import SNAPSHOT_FILE, installed_transformer_lens
from headsurgeon.outputs import atomic_write_text


def main() -> None:
    version = installed_transformer_lens()
    names = backend.hub_names()
    snapshot = json.loads(SNAPSHOT_FILE.read_text(encoding="utf-8"))
    if snapshot["names"] == names:
        versions = sorted({*snapshot["transformer_lens"], version})
    else:
        versions = [version]
        print(f"the table differs from TransformerLens {snapshot['transformer_lens']}'s: replaced")
    atomic_write_text(
        SNAPSHOT_FILE,
        json.dumps({"transformer_lens": versions, "names": names}, indent=0) + "\n",
    )
    print(f"wrote {SNAPSHOT_FILE}: {len(names)} names of TransformerLens {', '.join(versions)}")


if __name__ == "__main__":
    main()
