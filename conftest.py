"""The order of the suite's modules: under pytest-xdist (``scripts/test.sh``'s first run), and
in a plain run (its second)."""

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Modules holding a ``slow`` test first. ``--dist loadfile`` hands modules to the workers in
    collection order; one of those last left a worker running it alone for minutes while the
    other idled. Only in xdist's workers (where the order is collected). A plain run keeps the
    files' order, but for modules marked ``last``: their fixture waits for the warm-up
    ``scripts/test.sh`` runs in the background, which the other modules leave time for."""
    if not hasattr(config, "workerinput"):
        items.sort(key=lambda item: item.get_closest_marker("last") is not None)
        return
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)  # stable: each module keeps its own order
