"""Command line entry point: `servelm serve | route | bench | plan | simulate | fetch | generate | chat`.

Each sub-command lives in the package that owns it, as a module with
`add_arguments(parser)` and `run(args) -> int`; this file only wires them up.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# name -> (module that owns it, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("servelm.server.command", "serve a model over an OpenAI-compatible HTTP API"),
    "generate": ("servelm.commands.generate", "generate text for prompts in the terminal"),
    "chat": ("servelm.commands.chat", "chat with a model in the terminal"),
    "fetch": ("servelm.store.command", "prepare a model folder (default model, GGUF file, hub id)"),
    "bench": ("servelm.bench.command", "load-test any OpenAI-compatible server"),
    "plan": ("servelm.planner.command", "size a deployment: memory, KV capacity, concurrency"),
    "simulate": ("servelm.sim.command", "simulate a deployment with the real scheduler"),
    "route": ("servelm.router.command", "route requests across several replicas"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The parser for `argv`. Only the sub-command it names is imported and given its arguments:
    importing all of them takes longer than Python's own start (0.6 s here), and `servelm serve`
    launches its engine process only after parsing. `servelm --help` lists every command from
    COMMANDS without importing any."""
    parser = argparse.ArgumentParser(prog="servelm", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    named = next((a for a in argv if not a.startswith("-")), None)
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == named:
            module = importlib.import_module(module_name)
            module.add_arguments(p)
            p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    from servelm.commands import CommandError
    from servelm.model.config import ModelConfigError
    from servelm.store.errors import ModelFileError, ModelSpecError

    argv = sys.argv[1:] if argv is None else argv
    # the command's name before parsing ends (build_parser names it the same way)
    name = " ".join(["servelm", *[a for a in argv if not a.startswith("-")][:1]])
    try:
        args = build_parser(argv).parse_args(argv)
        status = int(args._run(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not in Python's flush at exit
        return status
    except KeyboardInterrupt:
        # Ctrl-C ends any command with one line, not a traceback; 130 = 128 + SIGINT, the
        # status a shell gives a program the signal killed (commands that can stop cleanly,
        # bench and chat, handle it themselves first)
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # stdout's reader went away (`servelm plan --json | head -1`): nothing more can be
        # written, so end quietly, as a program SIGPIPE kills does (141 = 128 + SIGPIPE).
        # Python's own flush of stdout at exit would raise again: stdout goes to devnull
        # (the recipe in the docs of the signal module). (What rich prints, it handles
        # itself the same way, but exits with 1.)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    except ModelSpecError as exc:  # a bad model path or id: the message says it all
        print(f"servelm {args.command}: {exc}", file=sys.stderr)
        return 2
    except (ModelFileError, ModelConfigError, CommandError) as exc:
        # a model or setting refused at start-up, named in the message: one line and exit 1,
        # as `servelm serve` ends when its engine process refuses one
        print(f"servelm {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
