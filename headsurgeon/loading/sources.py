"""Where a model comes from: a bundled organism, the Hugging Face hub or a local folder.

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
    check_hub_model,
    download_command,
    locate_model,
    organism_names,
)

__all__ = [
    "organism_names",
    "resolve_model",
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
