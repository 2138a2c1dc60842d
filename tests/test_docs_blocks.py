"""Every ```sh block of docs/*.md runs as written, shortened: as the
README's (tests/test_readme.py, which reads, shortens and runs them; the
slowest pages' blocks under ZERO_JAX_FULL_GRID=1 only, FULL_ONLY there)."""

import pytest

from tests.test_readme import DOCS_RUN, run_block


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("docs_jax_cache")


@pytest.mark.parametrize("heading,block", [(h, b) for _, h, b in DOCS_RUN],
                         ids=[i for i, _, _ in DOCS_RUN])
def test_docs_block_runs(heading, block, cache, tmp_path):
    run_block(heading, block, cache, tmp_path)
