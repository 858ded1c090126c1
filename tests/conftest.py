"""Shared fixtures: a tiny random-weight model built once per session, and the default model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

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
