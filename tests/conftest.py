"""Every test belongs to exactly one layer: ``unit``, ``integration`` or ``e2e`` (pyproject.toml: markers).

A test module says which with ``pytestmark = pytest.mark.<layer>`` at its top (or marks each test where it
mixes layers). Collection fails when a test carries no layer or more than one, so ``make test-unit``
(``-m unit``) cannot silently drop an unmarked test.

A test skipped with a reason starting ``SKIPPED LOUDLY`` lacks a tool that CI installs (the etcd binary):
on a developer's machine it skips, but when the ``CI`` environment variable is set (GitHub Actions sets
``CI=true``; ``.ci/run``) the skip is reported as a failure, so CI cannot pass without running it.
"""

from __future__ import annotations

import os

import pytest

LAYERS = ("unit", "integration", "e2e")
MUST_RUN_IN_CI = "SKIPPED LOUDLY"


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> pytest.TestReport:
    report = yield
    if report.skipped and in_ci() and isinstance(report.longrepr, tuple):
        reason = str(report.longrepr[2]).removeprefix("Skipped: ")
        if reason.startswith(MUST_RUN_IN_CI):
            report.outcome = "failed"
            report.longrepr = f"CI is set (CI={os.environ['CI']}), so this test must run, not skip: {reason}"
    return report


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
