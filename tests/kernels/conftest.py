"""Fixtures shared by the kernel tests."""
import pytest

from flexfa.runtime import plans


@pytest.fixture
def launched(monkeypatch):
    """The (family, splits) of each plan a call makes."""
    made = []
    real = plans.keep

    def spy(call, key, plan):
        made.append((plan.family.name, plan.fixed.get("splits")))
        return real(call, key, plan)
    monkeypatch.setattr(plans, "keep", spy)
    return made
