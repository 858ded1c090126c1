"""Turn a model spec (nothing, a folder, a .gguf file, or a hub id) into a local model folder.

    None                  -> the built-in default model (see default.py)
    path/to/folder        -> itself, if it holds config.json
    path/to/model.gguf    -> imported into <store>/<file stem> (<file stem>-<sha256 prefix>
                             where another file of that name was imported first)
    org/name              -> Hugging Face hub snapshot in <store>/org--name (optionally pinned;
                             see hub.py)

A spec that looks like a path but names nothing on disk is an error, never a hub lookup, so
a typo in a local path does not turn into a confusing network failure.
"""

from __future__ import annotations

import re
from pathlib import Path

from servelm.store.default import ensure_default_model
from servelm.store.errors import HubUnavailableError, ModelNotFoundError, ModelSpecError
from servelm.store.hub import HUB_PATTERNS, fetch_snapshot
from servelm.store.paths import default_store_dir

__all__ = [
    "HUB_PATTERNS",
    "HubUnavailableError",
    "ModelNotFoundError",
    "ModelSpecError",
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


def resolve_model_dir(args) -> Path:
    """The model folder an `EngineArgs` names (fetched or imported on first use)."""
    return Path(resolve_model(args.model, args.store, args.revision))
