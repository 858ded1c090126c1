"""Checks, made before a run starts, that the files it is asked to write can be written.

A results path that fails only once the results are ready (`--out` under a file, `--plot`
naming a file) costs the whole run and its records; `servelm bench` and `servelm simulate`
check theirs first. A folder missing on the way is no error: the writers make it
(`BenchResult.write_json`, `plots.plot_results`, `ProfileFile.write`).
"""

from __future__ import annotations

import os
from pathlib import Path


def check_out_file(path: str | Path, flag: str = "--out") -> None:
    """ValueError, naming `flag`, where a file could not be written at `path`."""
    file = Path(path)
    if file.is_dir():
        raise ValueError(f"{flag} {path}: is a folder; give the name of a file to write")
    if file.exists() and not os.access(file, os.W_OK):
        raise ValueError(f"{flag} {path}: the file cannot be written (permission denied)")
    _check_folder(file.parent, flag, path)


def check_out_folder(path: str | Path, flag: str = "--plot") -> None:
    """ValueError, naming `flag`, where files could not be written into the folder `path`."""
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{flag} {path}: is a file; give a folder to write the plots into")
    _check_folder(folder, flag, path)


def _check_folder(folder: Path, flag: str, given: str | Path) -> None:
    """The nearest part of `folder` that exists must be a folder this process may write in
    (the parts below it are made when the file is written)."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{flag} {given}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {given}: cannot write in {existing} (permission denied)")
