"""A checkpoint that fails to load names the cause the error shows (issue 41; issue 42 item 2):
threads, memory or the disk are no fault of the checkpoint, and only a damaged file asks for
it to be downloaded again."""

from __future__ import annotations

import errno

import pytest
from safetensors import SafetensorError

from headsurgeon import load_model
from headsurgeon.errors import CheckpointError

FAILURES = [
    (RuntimeError("pthread_create failed: Resource temporarily unavailable"), "start a thread"),
    (RuntimeError("libgomp: Thread creation failed: Resource temporarily unavailable"), "thread"),
    (
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough memory: "
            "you tried to allocate 1073741824 bytes."
        ),
        "ran out of memory",
    ),
    (MemoryError(), r"ran out of memory \(MemoryError\)"),
    (OSError(errno.ENOSPC, "No space left on device"), "found the disk full"),
    (SafetensorError("I/O error: No space left on device (os error 28)"), "found the disk full"),
    (OSError(errno.EIO, "Input/output error"), "failed in the disk or file system"),
    (OSError(errno.EACCES, "Permission denied"), "make it readable"),
    (SafetensorError("Error while deserializing header: HeaderTooLarge"), "is damaged"),
    (ValueError("an unknown refusal"), r"\(an unknown refusal\); fix what it names"),
]


@pytest.mark.parametrize(("error", "cause"), FAILURES, ids=lambda x: str(x)[:30])
def test_a_failed_load_names_the_cause_it_saw(bloom_dir, monkeypatch, error, cause):
    from transformers import AutoModelForCausalLM

    def failing(*args, **kwargs):
        raise error

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", failing)
    with pytest.raises(CheckpointError, match=cause) as raised:
        load_model(bloom_dir)
    message = str(raised.value)
    assert "\n" not in message and str(bloom_dir) in message
    assert ("re-download" in message) == (cause == "is damaged")


def test_a_part_by_part_load_names_the_cause_too(bloom_dir, monkeypatch):
    """3.x builds a placed BLOOM part by part, reading each tensor alone."""
    import safetensors

    from headsurgeon import backend

    if backend.loads_into_device_map():
        pytest.skip("TransformerLens 4.x reads a placed checkpoint with transformers")
    real = safetensors.safe_open

    class Failing:
        def __init__(self, *args, **kwargs):
            self.file = real(*args, **kwargs)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def keys(self):
            return self.file.keys()

        def get_tensor(self, name):
            raise RuntimeError("DefaultCPUAllocator: not enough memory")

    monkeypatch.setattr(safetensors, "safe_open", Failing)
    with pytest.raises(CheckpointError, match=r"model.safetensors ran out of memory \("):
        load_model(bloom_dir, device_map="auto", max_memory={"cpu": "1GiB"})
