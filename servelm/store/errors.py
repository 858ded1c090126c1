"""The store's user-facing errors (the CLI prints them without a traceback)."""

from __future__ import annotations


class ModelSpecError(ValueError):
    """A model spec servelm cannot turn into a model folder (the user's to fix: the CLI prints
    it without a traceback)."""


class ModelNotFoundError(ModelSpecError, FileNotFoundError):
    """A spec that looks like a path names nothing on disk."""


class HubUnavailableError(ModelSpecError, ImportError):
    """A hub id, without the optional huggingface-hub installed."""


class ModelFileError(ValueError):
    """A model whose spec is right but whose files servelm cannot read: a JSON file that does not
    parse, a missing tokenizer.json, a corrupt or truncated GGUF. The message names the file; the
    CLI prints it without a traceback and exits 1, as for a model the engine refuses."""
