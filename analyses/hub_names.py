"""Rewrite the snapshot of TransformerLens's model names for the installed version.

    python analyses/hub_names.py

Writes ``headsurgeon/hub_names/transformer-lens-<major>.json`` (official names and aliases, lower
case -> official name, and the version they were read from), which
:func:`headsurgeon.model_names.hub_names` answers from when that version is installed, so that
the tools refuse an unknown model name without importing TransformerLens. Run it with each
TransformerLens major (3.x and 4.x environments) after upgrading TransformerLens;
``tests/test_model_names.py`` says when a snapshot is out of date.
"""

from __future__ import annotations

import json

from headsurgeon import backend
from headsurgeon.model_names import installed_transformer_lens, snapshot_file
from headsurgeon.outputs import atomic_write_text


def main() -> None:
    version = installed_transformer_lens()
    path = snapshot_file(version.split(".")[0])
    snapshot = {"transformer_lens": version, "names": backend.hub_names()}
    atomic_write_text(path, json.dumps(snapshot, indent=0) + "\n")
    print(f"wrote {path}: {len(snapshot['names'])} names of TransformerLens {version}")


if __name__ == "__main__":
    main()
