"""Fixtures of the coordinator's in-process tests (tests/coordinator/recorded.py's Recorded)."""
import pytest


@pytest.fixture
def closing():
    """closing(c): c's sockets released when the test ends, however it ends."""
    made = []
    yield made.append
    for c in made:
        c.release_sockets()
