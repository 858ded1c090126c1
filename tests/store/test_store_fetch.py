"""resolve_model spec handling, the store location, and the `servelm fetch` command (no network)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import platformdirs
import pytest

from servelm.store import command, fetch
from servelm.store.fetch import resolve_model
from servelm.store.manifest import is_complete
from servelm.store.paths import default_store_dir


def test_store_dir_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("SERVELM_MODEL_STORE", str(tmp_path / "store"))
    assert default_store_dir() == tmp_path / "store"


def test_store_dir_default_is_user_cache(monkeypatch):
    monkeypatch.delenv("SERVELM_MODEL_STORE", raising=False)
    assert default_store_dir() == Path(platformdirs.user_cache_dir("servelm")) / "models"


def test_model_folder_is_used_as_is(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path), store_dir=tmp_path / "store") == tmp_path
    assert not (tmp_path / "store").exists()


def test_folder_without_config_is_refused(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        resolve_model(str(tmp_path), store_dir=tmp_path / "store")


@pytest.mark.parametrize("spec", ["./missing", "missing/model.gguf", "/no/such/dir", "a/b/c"])
def test_missing_path_is_an_error_not_a_hub_lookup(tmp_path, spec, monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # any hub call would fail loudly
    with pytest.raises(FileNotFoundError, match="no such model"):
        resolve_model(spec, store_dir=tmp_path)


def test_gguf_is_imported_into_store(make_tiny_gguf, tmp_path):
    src, _ = make_tiny_gguf("tiny-chat.gguf")
    folder = resolve_model(str(src), store_dir=tmp_path / "store")
    assert folder == tmp_path / "store" / "tiny-chat"
    assert is_complete(folder)


def test_other_file_is_refused(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(ValueError, match="not a .gguf"):
        resolve_model(str(tmp_path / "weights.bin"), store_dir=tmp_path)


def test_revision_with_local_path_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="--revision"):
        resolve_model(str(tmp_path), store_dir=tmp_path, revision="main")


def test_no_spec_means_default_model(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(fetch, "ensure_default_model", lambda store: calls.append(store) or store)
    assert resolve_model(None, store_dir=tmp_path) == tmp_path
    assert calls == [tmp_path]


# Hub ids are fetched through the real huggingface_hub from a stand-in: test_hub_fetch.py.


def test_hub_without_huggingface_hub_installed(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(ImportError, match=r"servelm\[hub\]"):
        resolve_model("org/model", store_dir=tmp_path)


def _run_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    return command.run(parser.parse_args(argv))


def test_command_prints_folder(make_tiny_gguf, tmp_path, capsys):
    src, _ = make_tiny_gguf()
    assert _run_command([str(src), "--store", str(tmp_path / "store")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "store" / "tiny")


def test_command_reports_errors(tmp_path, capsys):
    assert _run_command(["./missing", "--store", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "no such model" in captured.err


def test_cli_names_a_bad_model_without_a_traceback(tmp_path, capsys):
    from servelm.cli import main

    assert main(["serve", str(tmp_path / "nope")]) == 2
    assert "servelm serve: no such model file or folder" in capsys.readouterr().err
    assert main(["generate", "--model", str(tmp_path), "hi"]) == 2  # a folder, no config.json
    assert "has no config.json" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # argparse: usage and exit status 2
        main(["serve", "--port", "70000"])
    assert exc.value.code == 2 and "not a port" in capsys.readouterr().err
