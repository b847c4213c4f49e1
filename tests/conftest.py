"""The fast tier first: tests/unit runs before the tiers that start Ray clusters and workers, so a
failing run says so within minutes rather than after the slow tests."""


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: "unit" not in item.path.parent.parts[-1:])  # stable: each tier keeps its order
