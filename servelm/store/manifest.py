"""Checksums for model folders: the `servelm_import.json` manifest written after an import or a
hub fetch.

A manifest names the source the folder was built from (a GGUF: its file name + sha256; a hub
snapshot: the repo id + the commit it was fetched at) and the sha256 and size of every file the
import or fetch wrote. It is the last file written into a folder, so "manifest present and every
listed file present with its recorded size" means the folder is complete; hashing every file
again (`verify_hashes=True`, `problems`, `servelm fetch --verify`) is the slow, thorough check.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

MANIFEST_NAME = "servelm_import.json"
MANIFEST_FORMAT = 1
_CHUNK = 1 << 20


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file, read in chunks so large weight files need no extra memory."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _write(
    folder: Path, source: dict[str, str], files: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    manifest = {"format": MANIFEST_FORMAT, "source": source, "files": files}
    # Through a temporary name: a reader sees the whole manifest or none.
    partial = folder / f".{MANIFEST_NAME}.partial"
    partial.write_text(json.dumps(manifest, indent=2) + "\n")
    partial.replace(folder / MANIFEST_NAME)
    return manifest


def write_manifest(folder: Path, source_name: str, source_sha256: str) -> dict[str, Any]:
    """Hash every file in `folder` (not the manifest itself) and write the manifest last."""
    files = {
        p.name: {"sha256": sha256_file(p), "size": p.stat().st_size}
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name != MANIFEST_NAME
    }
    return _write(folder, {"file": source_name, "sha256": source_sha256}, files)


def write_snapshot_manifest(
    folder: Path, repo_id: str, commit: str, files: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """The manifest of a hub snapshot: `files` maps each fetched file's repo path to its sha256
    and size (already checked against the hub's own checksums by the caller)."""
    return _write(folder, {"repo": repo_id, "revision": commit}, dict(sorted(files.items())))


def read_manifest(folder: str | Path) -> dict[str, Any] | None:
    """The parsed manifest, or None when it is missing or unreadable."""
    path = Path(folder) / MANIFEST_NAME
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    # Anything not shaped like our manifest counts as absent: the folder gets rebuilt.
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != MANIFEST_FORMAT
        or not isinstance(manifest.get("source"), dict)
        or not isinstance(manifest.get("files"), dict)
        or not all(isinstance(e, dict) and "size" in e for e in manifest["files"].values())
    ):
        return None
    return manifest


def is_complete(
    folder: str | Path, source_sha256: str | None = None, verify_hashes: bool = False
) -> bool:
    """True when `folder` holds a finished import (of `source_sha256`, when given)."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    if manifest is None:
        return False
    if source_sha256 is not None and manifest["source"].get("sha256") != source_sha256:
        return False
    for name, entry in manifest["files"].items():
        path = folder / name
        if not path.is_file() or path.stat().st_size != entry["size"]:
            return False
        if verify_hashes and sha256_file(path) != entry["sha256"]:
            return False
    return True


def problems(folder: str | Path, verify_hashes: bool = True) -> dict[str, str]:
    """What is wrong with `folder` against its manifest, by file name ("missing", "size ...,
    expected ...", "sha256 differs from the manifest"); {} when intact."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    if manifest is None:
        return {
            MANIFEST_NAME: "missing or unreadable: a fetch or import that did not finish, or a "
            "folder servelm did not make (its own folders are checked when they load)"
        }
    found = {}
    for name, entry in manifest["files"].items():
        path = folder / name
        if not path.is_file():
            found[name] = "missing"
        elif path.stat().st_size != entry["size"]:
            found[name] = f"size {path.stat().st_size}, expected {entry['size']}"
        elif verify_hashes and sha256_file(path) != entry.get("sha256"):
            found[name] = "sha256 differs from the manifest"
    return found
