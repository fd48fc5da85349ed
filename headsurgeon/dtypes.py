"""Names of float formats and devices, parsed into torch objects with one-line errors.

A leaf module: it imports nothing of the package but its errors, so the pure math
(:mod:`headsurgeon.alibi`) and every I/O module can use it.

>>> parse_dtype("bf16")
torch.bfloat16
"""

from __future__ import annotations

import torch

from headsurgeon.defaults import DTYPE_NAMES
from headsurgeon.errors import InvalidArgumentError

__all__ = [
    "parse_device",
    "parse_dtype",
]

DTYPES = {name: getattr(torch, canonical) for name, canonical in DTYPE_NAMES.items()}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Return the torch dtype for a name such as ``"float32"``, ``"bf16"`` or ``torch.float16``."""
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
    elif isinstance(dtype, str) and dtype.lower() in DTYPES:
        return DTYPES[dtype.lower()]
    raise InvalidArgumentError(f"unknown dtype {dtype!r}; use one of float32, bfloat16, float16")


def check_trainable(dtype: str | torch.dtype) -> torch.dtype:
    """``dtype`` parsed; :class:`InvalidArgumentError` if a model in it cannot be fine-tuned.

    Float16 would need loss scaling (its gradients underflow), which fine-tuning does not do.
    """
    parsed = parse_dtype(dtype)
    if parsed == torch.float16:
        raise InvalidArgumentError(
            "fine-tuning a float16 model needs loss scaling, which is not supported; "
            "load the model in bfloat16 or float32"
        )
    return parsed


def parse_device(device: str | torch.device) -> torch.device:
    """Return a usable torch device, or raise :class:`InvalidArgumentError` saying why not."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise InvalidArgumentError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from e
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidArgumentError(f"device {device!r} requested but CUDA is not available")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise InvalidArgumentError(
                f"device {device!r} does not exist: {torch.cuda.device_count()} CUDA device(s)"
            )
    elif parsed.type == "mps" and not torch.backends.mps.is_available():
        raise InvalidArgumentError(f"device {device!r} requested but MPS is not available")
    elif parsed.type not in ("cpu", "cuda", "mps"):
        raise InvalidArgumentError(f"unsupported device {device!r}; use cpu, cuda or mps")
    return parsed
