"""Where a model comes from: a bundled organism, the Hugging Face hub or a local folder.

Exports:
    resolve_model(model)   (display name, local checkpoint folder) of a user's model argument
    organism_names()       short names of the model organisms bundled with the package
    ORGANISM_DIR           their folder; DEFAULT_MODEL, the tools' default model
    unknown_message(name, candidates)
                           the unknown-model line with the closest names
    download_command(official)
                           the ``hf download`` command that fills the cache for a hub model
    (these five from :mod:`headsurgeon.model_names`, which names models without importing
    torch or TransformerLens)

A hub name (any TransformerLens name or alias) is read from the Hugging Face cache, else
downloaded after one bounded probe of the hub (``HF_HUB_OFFLINE=1`` respected); an unknown name
is one :class:`~headsurgeon.errors.UnknownModelError` line with the closest known names.

>>> resolve_model("organism")[1].name
'organism'
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from headsurgeon.errors import ModelNotFoundError, first_line
from headsurgeon.loading.files import TOKENIZER_FILES, has_weights
from headsurgeon.model_names import (
    DEFAULT_MODEL,
    ORGANISM_DIR,
    check_hub_model,
    download_command,
    locate_model,
    organism_names,
    unknown_message,
)

__all__ = [
    "DEFAULT_MODEL",
    "ORGANISM_DIR",
    "download_command",
    "organism_names",
    "resolve_model",
    "unknown_message",
]

logger = logging.getLogger(__name__)


def _hub_snapshot(official: str) -> Path:
    """The local folder of a hub model: from the cache, else downloaded (with progress bars)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    patterns = ["config.json", "*.safetensors", "*.safetensors.index.json", *TOKENIZER_FILES]
    try:
        cached = Path(snapshot_download(official, allow_patterns=patterns, local_files_only=True))
        if has_weights(cached):
            return cached
    except LocalEntryNotFoundError:
        pass
    # Offline, or one bounded probe rather than the hub client's own timeouts and retries.
    check_hub_model(official, cached=False)
    logger.info("downloading %s", official)
    try:
        folder = Path(snapshot_download(official, allow_patterns=patterns))
        if not has_weights(folder):  # older repositories ship only pickled weights
            folder = Path(snapshot_download(official, allow_patterns=["pytorch_model*.bin*"]))
    except Exception as e:  # the hub client raises many types (HTTP, connection, disk)
        raise ModelNotFoundError(
            f"downloading {official} failed ({first_line(e)}); download it on a connected "
            f"machine ({download_command(official)}), or pass a local checkpoint folder"
        ) from e
    return folder


def resolve_model(model: str | os.PathLike) -> tuple[str, Path]:
    """Turn a user's model argument into (display name, local checkpoint folder): a hub model's
    from the Hugging Face cache, else downloaded (:func:`headsurgeon.model_names.locate_model`
    names the model first, and refuses a missing path or an unknown name)."""
    name, folder, official = locate_model(model)
    return name, folder if folder is not None else _hub_snapshot(official)
