"""Shared fixtures: a tiny random-weight model built once per session, the default model, and
the C kernel variant a test runs on (see tests/kernels/variants.py)."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest

from tests.kernels.variants import params
from tests.tiny_model import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The real SmolLM2-135M-Instruct, imported into the store (slow tests only)."""
    from servelm.store.default import ensure_default_model

    store = os.environ.get("SERVELM_MODEL_STORE")
    return Path(ensure_default_model(store))


@pytest.fixture(scope="module", params=params())
def variant(request) -> str:
    """The name of a C kernel variant (`servelm.kernels.variants`): each test that takes it
    runs once per variant, skipped where this host cannot run that one."""
    return request.param


def pytest_report_header(config) -> list[str]:
    """The C kernel variants this host builds and tests, and those it cannot run (why)."""
    from servelm.kernels import variants
    from servelm.kernels.build import compiler

    if compiler() is None:
        return ["C kernel variants: none (no C compiler)"]
    built = [f"{v.name} ({' '.join(variants.flags(v)) or 'native'})" for v in variants.available()]
    lines = [f"C kernel variants built and tested here: {', '.join(built)}"]
    skipped = [(v.name, variants.unavailable(v)) for v in variants.VARIANTS]
    if any(reason for _, reason in skipped):
        lines.append(
            "C kernel variants skipped: "
            + "; ".join(f"{name} ({reason})" for name, reason in skipped if reason)
        )
    return lines


_VARIANT_OF = pytest.StashKey[dict]()


def pytest_collection_modifyitems(config, items) -> None:
    config.stash[_VARIANT_OF] = {
        item.nodeid: item.callspec.params["variant"]
        for item in items
        if "variant" in getattr(getattr(item, "callspec", None), "params", {})
    }


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """How many tests ran on each kernel variant, and with what outcome."""
    of = config.stash.get(_VARIANT_OF, {})
    counts: dict[str, Counter] = {}
    for outcome in ("passed", "failed", "error", "skipped"):
        for report in terminalreporter.stats.get(outcome, []):
            name = of.get(getattr(report, "nodeid", None))
            if name is not None and (report.when == "call" or outcome != "passed"):
                counts.setdefault(name, Counter())[outcome] += 1
    if counts:  # (the header is left out under -q)
        for line in pytest_report_header(config):
            terminalreporter.write_line(line)
        terminalreporter.write_line(
            "C kernel variant tests: "
            + "; ".join(
                f"{name} " + ", ".join(f"{n} {outcome}" for outcome, n in c.items())
                for name, c in counts.items()
            )
        )
    from tests.golden import NEAR_TIE, NEAR_TIES

    if NEAR_TIES["steps"]:  # the golden tests against transformers ran
        terminalreporter.write_line(
            f"golden tests: {NEAR_TIES['near ties']} of {NEAR_TIES['steps']} greedy steps had "
            f"a top-2 gap below {NEAR_TIE:g}"
        )
