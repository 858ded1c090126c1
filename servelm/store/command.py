"""`servelm fetch [MODEL] [--store DIR] [--revision REV]`: prepare a model folder, print its path.

Printing only the path on stdout (progress and errors go to stderr) lets scripts write
`servelm serve --model "$(servelm fetch org/name)"`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from servelm.store.fetch import resolve_model
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


def run(args: argparse.Namespace) -> int:
    # Progress lines ("downloading ...") are logged; show them unless logging is set up already.
    logging.basicConfig(level=logging.INFO, format="servelm fetch: %(message)s", stream=sys.stderr)
    try:
        folder = resolve_model(args.model, store_dir=args.store, revision=args.revision)
    except (OSError, ValueError, ImportError, RuntimeError) as exc:
        print(f"servelm fetch: error: {exc}", file=sys.stderr)
        return 1
    print(folder)
    return 0
