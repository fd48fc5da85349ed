"""A fine-tuning batch far too large for memory is refused in one line before anything is
allocated (issue 41), by finetune and by repair before its first census."""

from __future__ import annotations

import pytest
import torch
from conftest import TEXT

import headsurgeon.finetune.trainer as finetune_module
import headsurgeon.probes as probes_module
import headsurgeon.repair.pipeline as repair_module
from headsurgeon import load_model
from headsurgeon.errors import InvalidArgumentError
from headsurgeon.finetune import FinetuneConfig, finetune
from headsurgeon.heads import HeadSet
from headsurgeon.probes import check_training_memory
from headsurgeon.repair import repair


def test_a_huge_batch_is_refused_from_its_size_alone(tiny_model):
    """10^9 sequences: refused by arithmetic on the real free memory, nothing allocated."""
    with pytest.raises(InvalidArgumentError, match="--batch-size") as raised:
        check_training_memory(tiny_model, 10**9, 32)
    assert "\n" not in str(raised.value)
    assert check_training_memory(tiny_model, 4, 32) > 0  # a small batch fits


def test_the_estimate_follows_what_the_backward_pass_keeps(tiny_model):
    full = check_training_memory(tiny_model, 8, 64, available=2**40)
    assert check_training_memory(tiny_model, 16, 64, available=2**40) == 2 * full  # per row
    assert check_training_memory(tiny_model, 8, 64, gradient_checkpointing=True) < full
    assert check_training_memory(tiny_model, 8, 64, loss_chunk=8) < full
    assert check_training_memory(tiny_model, 8, 64, logits=False) < full


@pytest.fixture
def little_free_memory(monkeypatch):
    """16 KiB free, as /proc/meminfo would say it; no step, no census may start."""
    monkeypatch.setattr(probes_module, "_free_memory", lambda device: 16 << 10)

    def never(*args, **kwargs):
        raise AssertionError("ran before the memory check")

    monkeypatch.setattr(finetune_module._Loop, "train_step", never)
    monkeypatch.setattr(repair_module, "run_census", never)


def test_finetune_refuses_before_its_first_step(tiny_model, little_free_memory):
    before = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    tokens = torch.randint(0, 300, (8, 32))
    with pytest.raises(InvalidArgumentError, match=r"fine-tuning a batch of 4 sequences of 32"):
        finetune(tiny_model, HeadSet([(0, 0)]), tokens, config=FinetuneConfig(batch_size=4))
    assert all(torch.equal(v, tiny_model.state_dict()[k]) for k, v in before.items())


def test_repair_refuses_before_its_first_census(injured, little_free_memory):
    with pytest.raises(InvalidArgumentError, match="fine-tuning a batch of 4 sequences of 32"):
        repair(
            load_model(injured),
            TEXT,
            eval_corpus=TEXT,
            eval_on_train=True,
            census_data=TEXT,
            train_seq_len=32,
            finetune_config=FinetuneConfig(batch_size=4),
            progress=False,
        )


def test_cgroup_limits_bound_the_memory_available(tmp_path):
    """A fake cgroup root: v2's memory.max - memory.current and v1's limit - usage bound what
    the check takes as available; "max" and v1's "no limit" number do not."""
    from headsurgeon.allocator import available_memory

    free = available_memory(tmp_path)  # nothing under the root: RAM and RLIMIT_AS only
    assert free is not None and free > 64 << 20
    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "memory.current").write_text("1000\n")
    assert available_memory(tmp_path) == free or abs(available_memory(tmp_path) - free) < 2**28
    (tmp_path / "memory.max").write_text(f"{(48 << 20) + 1000}\n")
    assert available_memory(tmp_path) == 48 << 20
    v1 = tmp_path / "memory"
    v1.mkdir()
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    (v1 / "memory.usage_in_bytes").write_text("5\n")
    assert available_memory(tmp_path) == 48 << 20
    (v1 / "memory.limit_in_bytes").write_text(f"{(16 << 20) + 5}\n")
    assert available_memory(tmp_path) == 16 << 20


def test_the_training_check_takes_the_cgroup_limit(tiny_model, monkeypatch, tmp_path):
    (tmp_path / "memory.max").write_text(f"{1 << 20}\n")
    (tmp_path / "memory.current").write_text("0\n")
    from headsurgeon import allocator

    monkeypatch.setattr(allocator.available_memory, "__defaults__", (tmp_path,))
    with pytest.raises(InvalidArgumentError, match="more than the 0.0 GiB free"):
        check_training_memory(tiny_model, 64, 64)


def test_an_address_space_limit_bounds_the_memory_available():
    """Under ``ulimit -v`` (RLIMIT_AS) far below free RAM, a batch that fits in RAM but not in
    the address space left is refused in one line, not a MemoryError mid-step."""
    import subprocess
    import sys

    code = """
import resource, torch
from headsurgeon.errors import InvalidArgumentError
from headsurgeon.loading import ModelShape, random_model
from headsurgeon.allocator import available_memory
from headsurgeon.probes import check_training_memory
model = random_model(ModelShape(n_layers=2, n_heads=4, d_model=32, d_vocab=64, n_ctx=512))
free = available_memory()
with open("/proc/self/status") as f:
    used = int(next(l for l in f if l.startswith("VmSize")).split()[1]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (used + (256 << 20), resource.RLIM_INFINITY))
left = available_memory()
assert 0 <= left <= 256 << 20 < free, (left, free)
try:
    check_training_memory(model, 64, 512)  # about 0.8 GiB: fits in RAM, not in the limit
except InvalidArgumentError as e:
    print("refused:", e)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("refused: fine-tuning a batch of 64 sequences of 512")
