"""`servelm fetch [MODEL] [--store DIR] [--revision REV]`: prepare a model folder, print its path.
`servelm fetch --verify DIR`: hash a prepared folder again against its manifest.

Printing only the path on stdout (progress and errors go to stderr) lets scripts write
`servelm serve "$(servelm fetch org/name)"`. `--verify` is what a cluster's init
container runs before the engine starts: exit 0 and one line when every file is intact, else
exit 1 and one line per bad or missing file.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from servelm.store.fetch import resolve_model
from servelm.store.manifest import problems, read_manifest
from servelm.store.paths import STORE_ENV


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        help="hub id (owner/name), a .gguf file, or a model folder "
        "(default: the built-in SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--store",
        type=Path,
        default=None,
        help=f"model store folder (default: ${STORE_ENV}, else the user cache folder)",
    )
    parser.add_argument(
        "--revision", default=None, help="hub branch, tag or commit to pin (hub ids only)"
    )
    parser.add_argument(
        "--verify",
        metavar="DIR",
        type=Path,
        default=None,
        help="hash every file of a prepared model folder against its manifest and report; "
        "exit 1 naming each bad or missing file (no network)",
    )


def verify(folder: Path) -> int:
    found = problems(folder)
    if found:
        for name, why in found.items():
            print(f"servelm fetch --verify: {folder / name}: {why}", file=sys.stderr)
        return 1
    manifest = read_manifest(folder)
    source = manifest["source"]
    what = f"{source['repo']}@{source['revision']}" if "repo" in source else source.get("file", "?")
    print(f"OK {folder}: {len(manifest['files'])} files match the manifest ({what})")
    return 0


def run(args: argparse.Namespace) -> int:
    # Progress lines ("downloading ...") are logged; show them unless logging is set up already.
    if args.verify is not None:
        if args.model is not None or args.revision is not None:
            print("servelm fetch: error: --verify takes only the folder", file=sys.stderr)
            return 2
        return verify(args.verify)
    logging.basicConfig(level=logging.INFO, format="servelm fetch: %(message)s", stream=sys.stderr)
    for name in ("httpx", "httpx2"):  # one INFO line per HTTP request: too many to read
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        # rehash: fetching again repairs a folder that --verify rejects
        folder = resolve_model(
            args.model, store_dir=args.store, revision=args.revision, rehash=True
        )
    except (OSError, ValueError, ImportError, RuntimeError) as exc:
        print(f"servelm fetch: error: {exc}", file=sys.stderr)
        return 1
    print(folder)
    return 0
