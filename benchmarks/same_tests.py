"""Only the tests an earlier run had: a pytest plugin for timing an older commit's suite at this one.

    python -m pytest -q -n 3 --dist loadfile -p benchmarks.same_tests --same-tests-as OLD.xml

OLD.xml is the earlier run's JUnit XML (`--junitxml`). A test is kept when its module's file name
and its own name (parameters included) are in it, whichever folder the module lives in now; the
rest are deselected, and the run says how many. Test functions only: this suite has no test classes,
whose JUnit class name would not end in the module's. By hand, not in `make test`
(docs/benchmarks/test-suite.md).
"""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--same-tests-as",
        metavar="JUNIT_XML",
        help="keep only the tests named in this JUnit XML of an earlier run (module file name and test name)",
    )


def _names(junit: str) -> set[str]:
    return {
        f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        for case in ET.parse(junit).getroot().iter("testcase")
    }


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items) -> None:
    junit = config.getoption("same_tests_as")
    if not junit:
        return
    kept = _names(junit)
    keep, drop = [], []
    for item in items:
        (keep if f"{item.path.stem}::{item.name}" in kept else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
