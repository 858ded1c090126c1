"""Turn a model spec (nothing, a folder, a .gguf file, or a hub id) into a local model folder.

    None                  -> the built-in default model (see default.py)
    path/to/folder        -> itself, if it holds config.json
    path/to/model.gguf    -> imported into <store>/<file stem>
    org/name              -> Hugging Face hub snapshot in <store>/org--name (optionally pinned;
                             see hub.py)

A spec that looks like a path but names nothing on disk is an error, never a hub lookup, so
a typo in a local path does not turn into a confusing network failure.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from servelm.store.default import ensure_default_model
from servelm.store.errors import (
    HubUnavailableError,
    ModelFileError,
    ModelNotFoundError,
    ModelSpecError,
)
from servelm.store.hub import HUB_PATTERNS, fetch_snapshot
from servelm.store.paths import default_store_dir

__all__ = [
    "HUB_PATTERNS",
    "HubUnavailableError",
    "ModelFileError",
    "ModelNotFoundError",
    "ModelSpecError",
    "check_model_folder",
    "resolve_model",
    "resolve_model_dir",
]


# Hub ids are "name" or "owner/name" made of letters, digits, "-", "_" and ".".
_HUB_ID_RE = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def _looks_like_hub_id(spec: str) -> bool:
    return bool(_HUB_ID_RE.fullmatch(spec)) and ".." not in spec and not spec.endswith(".gguf")


def resolve_model(
    spec: str | None,
    store_dir: str | Path | None = None,
    revision: str | None = None,
    *,
    rehash: bool = False,
) -> Path:
    """Return a local folder holding config.json, weights and tokenizer for `spec`.

    `revision` (branch, tag or commit) applies to hub ids only. `rehash`: a hub snapshot the
    store already holds is hashed again before it is trusted (`servelm fetch`; a start of
    `servelm serve` checks sizes only). Raises FileNotFoundError for a
    path that does not exist (`ModelNotFoundError`), `ModelSpecError` (a ValueError) for
    anything else that is not a model, or a hub id without huggingface-hub installed.
    """
    store = Path(store_dir).expanduser() if store_dir is not None else default_store_dir()
    store = store.absolute()
    if spec is None:
        if revision is not None:
            raise ModelSpecError("--revision applies to hub ids, not to the default model")
        return ensure_default_model(store)

    path = Path(spec).expanduser()
    if path.exists() and revision is not None:
        raise ModelSpecError(f"--revision applies to hub ids, not to the local path {spec!r}")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelSpecError(f"{path} has no config.json, so it is not a model folder")
        return path.absolute()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelSpecError(f"{path} is a file but not a .gguf; pass a model folder or a GGUF")
        from servelm.store.gguf_import import import_gguf  # numpy + gguf: only when importing

        return import_gguf(path, store / path.stem)
    if not _looks_like_hub_id(spec):
        raise ModelNotFoundError(f"no such model file or folder: {spec}")
    return fetch_snapshot(spec, store, revision, rehash=rehash)


# The JSON files of a model folder that are read at start-up (the tokenizer reads all three,
# in the API process, before the engine starts). One that does not parse would fail there with
# json's own "Expecting value: line 1 column 2", which names no file.
_MODEL_JSON = ("config.json", "generation_config.json", "tokenizer_config.json")


def check_model_folder(folder: Path) -> None:
    """Raise ModelFileError naming the first file of `folder` an engine cannot start from: no
    tokenizer.json, or one of `_MODEL_JSON` that is not a JSON object. (A missing config.json is
    for resolve_model and the engine to report; the weights, for the loader, which reads them.)"""
    tokenizer = folder / "tokenizer.json"
    if not tokenizer.is_file():
        raise ModelFileError(
            f"{tokenizer} not found: servelm needs a fast tokenizer (tokenizer.json)"
        )
    for name in _MODEL_JSON:
        path = folder / name
        if not path.is_file():
            continue
        try:
            value = json.loads(path.read_bytes())
        except OSError as exc:
            raise ModelFileError(f"cannot read {path}: {exc.strerror}") from None
        except ValueError as exc:  # (a JSONDecodeError, or bytes that are not UTF-8)
            raise ModelFileError(f"{path} is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ModelFileError(f"{path} is not a JSON object")


def resolve_model_dir(args) -> Path:
    """The model folder an `EngineArgs` names (fetched or imported on first use), checked for
    the files an engine starts from (`check_model_folder`)."""
    folder = Path(resolve_model(args.model, args.store, args.revision))
    check_model_folder(folder)
    return folder
