"""The command line: `servelm serve` parses without importing the other sub-commands, whose
imports would delay the engine process it launches; help still lists every command."""

from __future__ import annotations

import subprocess
import sys

from servelm.cli import COMMANDS, build_parser


def _run_python(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    return done.stdout


def test_serve_imports_only_its_own_module():
    out = _run_python(
        "import sys\n"
        "from servelm.cli import COMMANDS, build_parser\n"
        "args = build_parser(['serve', '--port', '8123']).parse_args(['serve', '--port', '8123'])\n"
        "print(args.port, args._run.__module__)\n"
        "print(' '.join(m for m, _ in COMMANDS.values() if m in sys.modules))\n"
    )
    first, loaded = out.splitlines()
    assert first == "8123 servelm.server.command"
    assert loaded.split() == ["servelm.server.command"]


def test_top_level_help_lists_every_command():
    done = subprocess.run(
        [sys.executable, "-m", "servelm.cli", "--help"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0
    for name in COMMANDS:
        assert name in done.stdout


def test_each_command_parses_its_own_help():
    for name in COMMANDS:
        done = subprocess.run(
            [sys.executable, "-m", "servelm.cli", name, "--help"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(f"usage: servelm {name}")


def test_unknown_command_is_a_usage_error():
    done = subprocess.run(
        [sys.executable, "-m", "servelm.cli", "nope"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert "invalid choice: 'nope'" in done.stderr


def test_prefill_admit_cap_reaches_the_scheduler(tiny_model_dir):
    """`--max-prefill-admit-tokens` goes from the command line through EngineArgs to the
    scheduler the engine builds."""
    from servelm.config import EngineArgs
    from servelm.worker.executor import create_engine_core

    args = build_parser(["serve"]).parse_args(
        ["serve", str(tiny_model_dir), "--max-prefill-admit-tokens", "512"]
    )
    engine_args = EngineArgs.from_cli_args(args)
    engine_args.kv_cache_memory = 8 << 20
    core, _ = create_engine_core(engine_args)
    assert core.scheduler.config.max_prefill_admit_tokens == 512
