"""The fast tier first: tests/unit runs before the tiers that start Ray clusters and workers, so a
failing run says so within minutes rather than after the slow tests."""


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.path.parent.name != "unit")  # stable: each tier keeps its order
