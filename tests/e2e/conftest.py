"""tests/e2e: the shared in-process engine (tests/e2e/engine.py ``shared_engine``) lives at most as long
as its module, so the environment it sets never reaches another module's tests."""

import pytest


@pytest.fixture(scope="module", autouse=True)
def _close_the_shared_engine():
    yield
    from tests.e2e.engine import release_shared

    release_shared()
