"""Hub snapshots: `servelm fetch ORG/NAME [--revision REV]` into `<store>/<org>--<name>`.

What a fetch does, in order:
1. A folder whose manifest already names this repo at the pinned commit, with every file intact,
   is used as it is: no request reaches the hub (so `HF_HUB_OFFLINE=1` is fine there). A branch
   or tag costs one request to learn its commit.
2. Otherwise the manifest is removed first (its presence means complete), files that fail the
   check are deleted (huggingface_hub trusts a local file whose recorded commit matches), and
   `huggingface_hub.snapshot_download` fetches the top-level files serving reads, at the commit.
   huggingface_hub keeps per-file metadata in `<folder>/.cache/huggingface/`, so after an
   interrupted fetch the files that finished are not fetched again; a connection cut mid-file is
   resumed with an HTTP range request inside the same fetch.
3. Every fetched file is hashed once: its sha256 goes into the manifest and is compared with
   the hub's own checksum (LFS sha256, or the git blob id of a small file), so the manifest
   records what the hub published, not whatever arrived.
4. The manifest is written last (`manifest.write_snapshot_manifest`).

The token is huggingface_hub's own: `$HF_TOKEN`, else a saved `hf auth login`. Nothing here
passes one, so nothing overrides it; `$HF_ENDPOINT` likewise picks the hub (or a mirror).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from servelm.store.errors import HubUnavailableError, ModelSpecError
from servelm.store.manifest import (
    MANIFEST_NAME,
    problems,
    read_manifest,
    sha256_file,
    write_snapshot_manifest,
)
from servelm.store.paths import GGUF_BLOCKS_FILE

log = logging.getLogger(__name__)

# The files serving reads: config, tokenizer, chat template, weights (+ their index), and the
# GGUF blocks a folder made by `servelm fetch FILE.gguf` keeps (the loader serves its
# projections from them), so that such a folder pushed to a hub comes back whole.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", GGUF_BLOCKS_FILE]
# A model folder is read at its top level only: nested copies (onnx/, original/) are left out.
HUB_IGNORE = ["*/*"]
COMMIT_RE = re.compile(r"[0-9a-f]{40}")


def snapshot_folder(store: Path, repo_id: str) -> Path:
    """`<store>/<org>--<name>`: the folder layout the Helm chart's init container relies on."""
    return store / repo_id.replace("/", "--")


def _hub():
    try:
        import huggingface_hub
        import huggingface_hub.constants
        import huggingface_hub.errors
        import huggingface_hub.utils  # (a lazy package: submodules are imported by name)
    except ImportError as exc:
        raise HubUnavailableError(
            "downloading from the Hugging Face hub needs the optional dependency "
            "huggingface-hub: pip install 'servelm[hub]'"
        ) from exc
    return huggingface_hub


def _recorded_commit(manifest: dict[str, Any] | None, repo_id: str) -> str | None:
    if manifest is None or manifest["source"].get("repo") != repo_id:
        return None
    return manifest["source"].get("revision")


def fetch_snapshot(
    repo_id: str, store: Path, revision: str | None = None, *, rehash: bool = False
) -> Path:
    """The folder holding `repo_id` at `revision` (default branch if None), fetched if needed.

    `rehash`: hash the files of a folder that looks complete before trusting it (sizes only
    otherwise), so that `servelm fetch` repairs a folder `servelm fetch --verify` rejects.
    """
    hub = _hub()
    import httpx2  # huggingface_hub's HTTP client

    folder = snapshot_folder(store, repo_id)
    manifest = read_manifest(folder)
    recorded = _recorded_commit(manifest, repo_id)
    bad = problems(folder, verify_hashes=rehash) if recorded else {}
    pinned = revision if revision is not None and COMMIT_RE.fullmatch(revision) else None
    if recorded and not bad:
        if pinned == recorded:  # the pinned commit is here: no request at all
            return folder
        if revision is None and hub.constants.HF_HUB_OFFLINE:  # offline: what was fetched
            return folder
    if hub.constants.HF_HUB_OFFLINE:
        raise ModelSpecError(
            f"HF_HUB_OFFLINE is set and {folder} does not hold {repo_id} at "
            f"{revision or 'its default branch'} intact; fetch it with HF_HUB_OFFLINE=0 "
            "(the container image sets HF_HUB_OFFLINE=1 for serving)"
        )
    api = hub.HfApi()  # no token argument: huggingface_hub reads $HF_TOKEN itself
    where = f" at revision {revision!r}" if revision else ""
    try:
        # a bounded wait: huggingface_hub's own default is none, so a hub (or proxy) that takes
        # the connection and never answers held `servelm fetch` forever ($HF_HUB_ETAG_TIMEOUT)
        timeout = hub.constants.HF_HUB_ETAG_TIMEOUT
        commit = pinned or api.model_info(repo_id, revision=revision, timeout=timeout).sha
        if commit == recorded and not bad:
            return folder
        return _download(hub, api, repo_id, commit, folder, manifest, list(bad))
    except (hub.errors.RepositoryNotFoundError, hub.errors.RevisionNotFoundError) as exc:
        # Gated/private repos raise a subclass of RepositoryNotFoundError: name the class.
        raise ModelSpecError(
            f"{repo_id!r}{where} is neither a local path nor a model on the Hugging Face hub "
            f"({type(exc).__name__}; a gated or private repo needs $HF_TOKEN)"
        ) from exc
    except httpx2.HTTPError as exc:  # not an OSError: would print a traceback
        raise ModelSpecError(
            f"cannot reach the Hugging Face hub at {hub.constants.ENDPOINT} for {repo_id!r}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def _remote_files(hub, api, repo_id: str, commit: str) -> dict[str, Any]:
    """The repo's top-level files at `commit` that serving reads, by path (hub.RepoFile)."""
    entries = [
        e for e in api.list_repo_tree(repo_id, revision=commit) if isinstance(e, hub.RepoFile)
    ]
    wanted = hub.utils.filter_repo_objects(
        entries, allow_patterns=HUB_PATTERNS, ignore_patterns=HUB_IGNORE, key=lambda e: e.path
    )
    return {e.path: e for e in wanted}


def _check(hub, folder: Path, remote: dict[str, Any]) -> tuple[dict[str, dict], list[str]]:
    """Hash each fetched file once: ({path: {sha256, size}}, paths that differ from the hub)."""
    from huggingface_hub.utils.sha import git_hash

    files, mismatched = {}, []
    for name, entry in remote.items():
        path = folder / name
        sha256 = sha256_file(path)
        if entry.lfs is not None:
            matches = sha256 == entry.lfs.sha256
        else:  # a small file in git: its blob id is the git sha1 of its bytes
            matches = git_hash(path.read_bytes()) == entry.blob_id
        if not matches:
            mismatched.append(name)
        files[name] = {"sha256": sha256, "size": path.stat().st_size}
    return files, mismatched


def _download(
    hub, api, repo_id: str, commit: str, folder: Path, manifest: dict | None, bad: list[str]
) -> Path:
    remote = _remote_files(hub, api, repo_id, commit)
    if "config.json" not in remote:
        raise ModelSpecError(
            f"hub repo {repo_id!r} has no config.json; it is not a transformers model"
        )
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MANIFEST_NAME).unlink(missing_ok=True)
    for name in bad:  # huggingface_hub would keep these: their recorded commit matches
        (folder / name).unlink(missing_ok=True)
    for _attempt in (1, 2):
        log.info("fetching %s at %s into %s", repo_id, commit, folder)
        hub.snapshot_download(
            repo_id,
            revision=commit,
            local_dir=folder,
            allow_patterns=HUB_PATTERNS,
            ignore_patterns=HUB_IGNORE,
        )
        files, mismatched = _check(hub, folder, remote)
        if not mismatched:
            break
        log.warning("not as the hub published them, fetching again: %s", ", ".join(mismatched))
        for name in mismatched:
            (folder / name).unlink()
    else:
        raise ModelSpecError(
            f"{repo_id} at {commit}: {', '.join(mismatched)} do not match the hub's checksums "
            "after two downloads"
        )
    # Files of an earlier revision that this one does not have would be read as the model's.
    for name in (manifest or {}).get("files", {}):
        if name not in files:
            (folder / name).unlink(missing_ok=True)
    write_snapshot_manifest(folder, repo_id, commit, files)
    return folder
