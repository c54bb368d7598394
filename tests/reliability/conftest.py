"""The reliability tests check how runs end and what they record, never a number that depends on
the precision: every module runs as on a CPU without bf16 kernels (``MEMLAB_CPU_BF16=0``, the
suite's ``no_cpu_bf16``: ``precision=auto`` is fp32 on any machine), spawned runs included."""

import pytest


@pytest.fixture(scope="module", autouse=True)
def _cpu_without_bf16(no_cpu_bf16):
    """Set up before each module's own fixtures (autouse comes first in its scope)."""
