"""llmtune's CLI returns freed CPU memory to the system (glibc's dynamic mmap threshold would keep it: PPO's
quickstart step peaked at 5.4-6.2 GiB resident for 3.65 GiB of tensors, issue 40)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = """
import sys
from llmtune.utils import limit_heap_retention
if sys.argv[1] == "on":
    assert limit_heap_retention()
def rss_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) // 1024
big = bytearray(16 << 20); del big                   # a large block freed: glibc raises its mmap threshold
blocks = [bytearray(4 << 20) for _ in range(100)]    # 400 MiB
keep = blocks[-1:]                                   # one live block above the others, as in a training step
del blocks
print(rss_mib())
"""


def _rss_after_free(mode: str, **env: str) -> int:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    done = subprocess.run([sys.executable, "-c", PROBE, mode], env={**clean, **env}, capture_output=True, text=True,
                          timeout=60, check=True)
    return int(done.stdout.strip())


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's allocator")
def test_freed_blocks_are_returned_to_the_system():
    kept, returned = _rss_after_free("off"), _rss_after_free("on")
    assert kept > 300  # glibc keeps the 400 MiB resident by default
    assert returned < kept - 300


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's allocator")
def test_a_users_malloc_setting_is_left_alone():
    from llmtune.utils import limit_heap_retention

    for name, value in (("MALLOC_MMAP_THRESHOLD_", "65536"), ("LLMTUNE_GLIBC_HEAP", "default")):
        os.environ[name] = value
        try:
            assert limit_heap_retention() is False
        finally:
            del os.environ[name]
