"""llamapipe.core.host_memory: with glibc, freed activation memory is kept, so repeated steps stop page-faulting."""
import os
import platform
import subprocess
import sys
import textwrap

import pytest

from llamapipe.core.host_memory import USER_VARIABLES, keep_freed_host_memory

# A step that holds 128 MiB of 1 MiB tensors at its peak and frees them all. Whether glibc's dynamic
# thresholds trim that depends on the heap's layout, so the baseline pins glibc's initial thresholds
# (128 KiB) through its own variables: the freed top of the heap goes back to the OS and every step faults
# it in anew. Kept memory is reused.
STEPS = textwrap.dedent("""
    import sys, torch
    from llamapipe.core.host_memory import USER_VARIABLES, keep_freed_host_memory, minor_page_faults
    kept = sys.argv[1] == "keep" and keep_freed_host_memory()
    def step():
        held = [torch.ones(256 * 1024) for _ in range(128)]
        del held
    for _ in range(3):
        step()
    start = minor_page_faults()
    for _ in range(10):
        step()
    print(kept, (minor_page_faults() - start) / 10)
""")


def _faults_per_step(mode: str) -> tuple[bool, float]:
    env = dict(os.environ)
    for name in USER_VARIABLES + ("GLIBC_TUNABLES", "LD_PRELOAD"):
        env.pop(name, None)
    if mode == "release":
        env.update({name: str(128 * 1024) for name in USER_VARIABLES})
    out = subprocess.run([sys.executable, "-c", STEPS, mode], capture_output=True, text=True, check=True, env=env)
    kept, faults = out.stdout.split()
    return kept == "True", float(faults)


def test_kept_memory_stops_per_step_page_faults():
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc malloc only")
    released, released_faults = _faults_per_step("release")      # the user's variables win: not tuned
    kept, kept_faults = _faults_per_step("keep")
    assert (released, kept) == (False, True)
    # 128 MiB is 32,768 small pages (64 huge pages where transparent huge pages are always on)
    assert released_faults >= 60, released_faults
    assert kept_faults < released_faults / 20, (kept_faults, released_faults)


@pytest.mark.parametrize("name,value", [("MALLOC_TRIM_THRESHOLD_", "131072"),
                                        ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=131072"),
                                        ("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")])
def test_the_users_malloc_choice_wins(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    assert keep_freed_host_memory() is False


def test_pretrain_keeps_host_memory_unless_told_and_losses_do_not_change(tmp_path):
    from tests.cli import TINY, read_metrics, torchrun
    args = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1", "--global-batch-size", "4",
            "--train-iters", "3"]
    logs, losses = [], []
    for extra in ([], ["--release-host-memory"]):
        jsonl = str(tmp_path / f"m{len(extra)}.jsonl")
        proc = torchrun(2, TINY + args + extra + ["--metrics-jsonl", jsonl])
        assert proc.returncode == 0, proc.stderr[-3000:]
        logs.append(proc.stdout + proc.stderr)
        losses.append([r["lm_loss"] for r in read_metrics(jsonl)])
    glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    assert ("malloc keeps freed memory" in logs[0]) == glibc
    assert "malloc keeps freed memory" not in logs[1]
    assert len(losses[0]) == 3 and losses[0] == losses[1]
