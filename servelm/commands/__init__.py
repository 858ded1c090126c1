"""Terminal sub-commands that run the engine in-process: `servelm generate` and `servelm chat`."""

from __future__ import annotations

import argparse

from servelm.config import EngineArgs


class CommandError(Exception):
    """Ends a sub-command with its message on one line and exit status 1 (`servelm.cli.main`
    prints it): a model or a setting the engine refused, a prompt it cannot take. What the user
    is to fix gets no traceback."""


def start_llm(args: argparse.Namespace):
    """The in-process engine (`servelm.llm.LLM`) the engine flags describe. A model or setting
    it refuses to start with is a ValueError, as in `servelm serve`'s engine process: a device
    this torch lacks, a KV cache too small, a context longer than the model's, a model file it
    cannot read; that becomes a CommandError, the one line `serve` logs. A model path or hub id
    that names no model stays a ModelSpecError (a usage error, exit 2)."""
    from servelm.llm import LLM
    from servelm.store.errors import ModelSpecError

    try:
        return LLM(**EngineArgs.from_cli_args(args).__dict__)
    except ModelSpecError:
        raise
    except ValueError as exc:
        raise CommandError(str(exc)) from exc
