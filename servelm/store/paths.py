"""Where the model store lives on disk.

The store is a plain folder of model folders (`<store>/<name>/config.json ...`). Its location is
chosen once here so every sub-command (fetch, serve, chat) agrees on it.
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

STORE_ENV = "SERVELM_MODEL_STORE"
# in a store model's folder: the C kernel's packed weights, kept between starts (model/packed_cache)
PACKED_FOLDER = ".packed"
# in a folder imported from a GGUF file: the file's own blocks of the quantized projections that
# the C kernel reads (store/gguf_import writes it, model/loader serves from it, a hub fetch
# takes it)
GGUF_BLOCKS_FILE = "model.gguf-blocks"


def default_store_dir() -> Path:
    """`$SERVELM_MODEL_STORE` if set, else the per-user cache folder `.../servelm/models`."""
    override = os.environ.get(STORE_ENV)
    if override:
        return Path(override).expanduser()
    return Path(platformdirs.user_cache_dir("servelm")) / "models"
