"""Every test sees 8 simulated CPU devices; set before jax initialises.

The tests compile hundreds of small programs and run each for a few steps,
so LLVM's optimisation level is lowered: XLA's own passes (partitioning,
fusion, buffer assignment) are unchanged, compile time drops by a third, and
results are bitwise the same.

bf16 values are rounded wherever the program says (no "excess precision"):
by default XLA keeps some bf16 intermediates in float32 inside a fusion, and
its fusions differ between a 1-device program and a sharded one, so the same
rows of the same batch would round differently under two layouts. Without
that, a sharded bf16 step differs from one device only by the order of its
float32 sums, which is what the numerics tests hold to 1e-5.
"""

import os

os.environ["XLA_FLAGS"] = " ".join(
    f for f in os.environ.get("XLA_FLAGS", "").split()
    if not f.startswith(("--xla_force_host_platform_device_count", "--xla_backend_optimization_level",
                         "--xla_allow_excess_precision"))
) + (" --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
     " --xla_allow_excess_precision=false")

# The suite compiles hundreds of programs and runs each a few steps, and a
# single malloc arena makes XLA's compiles about a fifth slower on 2 cores,
# more than the steps gain: the suite and the processes it starts keep glibc's
# defaults. tests/test_host_allocator.py measures the setting itself.
os.environ.setdefault("ZERO_JAX_HOST_ALLOCATOR", "system")

import tempfile  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

from zero_jax.data import corpus as corpus_lib  # noqa: E402

# Identical programs (the same reference run in several modules, a script run
# three times by one test) compile once per session: the workers of one run
# (pytest-xdist names it) and their subprocesses share one cache. An entry
# read while another process still writes it is a warning and a compile
# (jax's own handling), never a wrong program: entries are keyed by the
# program's hash.
_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID")
_CACHE = (os.path.join(tempfile.gettempdir(), f"zero_jax_test_cache_{_RUN}") if _RUN
          else tempfile.mkdtemp(prefix="zero_jax_test_cache_"))
os.makedirs(_CACHE, exist_ok=True)
os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.fixture(scope="session")
def corpus():
    return corpus_lib.stdlib_corpus()


@pytest.fixture(scope="session", autouse=True)
def eight_devices():
    assert jax.device_count() == 8, "tests expect 8 simulated CPU devices"
