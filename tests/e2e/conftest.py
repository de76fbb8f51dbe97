"""Every test under tests/e2e/ is end-to-end (it launches pretrain.py or a tool as several real processes): each is
marked e2e here, so `pytest -m e2e` and `pytest -m "not e2e"` select by folder."""
from pathlib import Path

import pytest

E2E = Path(__file__).parent


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by the marker
def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.is_relative_to(E2E):
            item.add_marker(pytest.mark.e2e)
