"""Every test belongs to exactly one layer: ``unit``, ``integration`` or ``e2e`` (pyproject.toml: markers).

A test module says which with ``pytestmark = pytest.mark.<layer>`` at its top (or marks each test where it
mixes layers). Collection fails when a test carries no layer or more than one, so ``make test-unit``
(``-m unit``) cannot silently drop an unmarked test.
"""

from __future__ import annotations

import pytest

LAYERS = ("unit", "integration", "e2e")


@pytest.hookimpl(tryfirst=True)  # before -m deselects anything: every collected test is checked
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    problems = []
    for item in items:
        layers = sorted({mark.name for mark in item.iter_markers() if mark.name in LAYERS})
        if len(layers) != 1:
            found = ", ".join(layers) if layers else "none"
            problems.append(f"  {item.nodeid}: layer markers: {found}")
    if problems:
        raise pytest.UsageError(
            f"{len(problems)} test(s) need exactly one layer marker (unit, integration or e2e): put "
            "`pytestmark = pytest.mark.unit` (or integration, e2e) at the top of the module, or mark each "
            "test where a module mixes layers.\n" + "\n".join(problems))
