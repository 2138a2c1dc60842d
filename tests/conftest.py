"""Every test sees 8 simulated CPU devices; set before jax initialises.

The tests compile hundreds of small programs and run each for a few steps,
so LLVM's optimisation level is lowered: XLA's own passes (partitioning,
fusion, buffer assignment) are unchanged, compile time drops by a third, and
results are bitwise the same.
"""

import os

os.environ["XLA_FLAGS"] = " ".join(
    f for f in os.environ.get("XLA_FLAGS", "").split()
    if not f.startswith(("--xla_force_host_platform_device_count", "--xla_backend_optimization_level"))
) + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"

import jax  # noqa: E402
import pytest  # noqa: E402

from zero_jax import data as data_lib  # noqa: E402


@pytest.fixture(scope="session")
def corpus():
    return data_lib.stdlib_corpus()


@pytest.fixture(scope="session", autouse=True)
def eight_devices():
    assert jax.device_count() == 8, "tests expect 8 simulated CPU devices"
