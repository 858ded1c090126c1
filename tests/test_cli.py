"""The command line: `servelm serve` parses without importing the other sub-commands, whose
imports would delay the engine process it launches; help still lists every command."""

from __future__ import annotations

import subprocess
import sys

import pytest

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
    scheduler the engine builds; without it, a CPU engine gets the CPU's cap, and 0 turns the
    cap off."""
    from servelm.config import CPU_PREFILL_ADMIT_TOKENS, EngineArgs
    from servelm.worker.executor import create_engine_core

    def cap(*flags: str) -> int:
        args = build_parser(["serve"]).parse_args(
            ["serve", str(tiny_model_dir), "--device", "cpu", *flags]
        )
        engine_args = EngineArgs.from_cli_args(args)
        engine_args.kv_cache_memory = 8 << 20
        core, _ = create_engine_core(engine_args)
        return core.scheduler.config.max_prefill_admit_tokens

    assert cap() == CPU_PREFILL_ADMIT_TOKENS > 0
    assert cap("--max-prefill-admit-tokens", "300") == 300
    assert cap("--max-prefill-admit-tokens", "0") == 0


def test_prefill_admit_cap_defaults_by_device():
    from servelm.config import CPU_PREFILL_ADMIT_TOKENS, EngineArgs

    assert EngineArgs().prefill_admit_tokens("cpu") == CPU_PREFILL_ADMIT_TOKENS
    assert EngineArgs().prefill_admit_tokens("cuda") == 0  # a GPU batches prompts nearly free
    assert EngineArgs(max_prefill_admit_tokens=64).prefill_admit_tokens("cuda") == 64
    assert EngineArgs(max_prefill_admit_tokens=0).prefill_admit_tokens("cpu") == 0


def test_int4_activations_reach_the_quantized_matmul(tiny_model_dir):
    """`--int4-activations` goes from the command line to the C kernel the engine multiplies
    its int4 weights with (a setting of the whole process; the default is set last)."""
    from servelm.config import EngineArgs
    from servelm.kernels.quant_matmul import ACTIVATIONS
    from servelm.worker.executor import create_engine_core
    from tests.kernels.variants import INTEGERS, native

    bits = {}
    for kind in ("int8", "float32", "int16", "auto"):
        args = build_parser(["serve"]).parse_args(
            ["serve", str(tiny_model_dir), "--int4-activations", kind]
        )
        engine_args = EngineArgs.from_cli_args(args)
        engine_args.kv_cache_memory = 8 << 20
        core, _ = create_engine_core(engine_args)
        if core.executor.quant_kernel is None:
            pytest.skip("no C compiler here")
        bits[kind] = core.executor.quant_kernel.activation_bits
    # auto: the build's own choice, int16 where that is its default (AVX2, AVX-512 without
    # BF16), else x as it is
    assert bits.pop("auto") == (16 if native() in INTEGERS else 0)
    if bits["int16"]:  # this build has x in integers (AVX2 or AVX-512 without AMX tiles)
        assert bits == ACTIVATIONS
    else:
        assert bits == dict.fromkeys(ACTIVATIONS, 0)
    with pytest.raises(SystemExit):
        build_parser(["serve"]).parse_args(["serve", "--int4-activations", "int4"])


@pytest.mark.parametrize(
    "flag, value",
    [("--max-num-seqs", "0"), ("--max-num-batched-tokens", "-1"),
     ("--max-prefill-admit-tokens", "-5"), ("--max-prefill-admit-tokens", "many")],
)  # fmt: skip
def test_scheduler_limits_that_would_admit_nothing_are_usage_errors(flag, value, capsys):
    # a step budget, a sequence limit or an admission cap below its least would leave every
    # request waiting for good; the command line refuses them instead
    with pytest.raises(SystemExit) as exit_:
        build_parser(["serve"]).parse_args(["serve", "model", flag, value])
    assert exit_.value.code == 2
    assert f"argument {flag}: not an integer >= " in capsys.readouterr().err


def _engine_argv(command: str, *flags: str) -> list[str]:
    return [command, *({"serve": ["model"], "generate": ["prompt"]}.get(command, [])), *flags]


def assert_usage_error(argv: list[str], flag: str, message: str, capsys) -> None:
    """Parsing `argv` ends with exit 2 and argparse's line for `flag` saying `message`."""
    with pytest.raises(SystemExit) as exit_:
        build_parser(argv).parse_args(argv)
    assert exit_.value.code == 2
    assert f"argument {flag}: {message}" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["serve", "generate", "chat"])
@pytest.mark.parametrize(
    "flag, value, message",
    [("--max-model-len", "0", "not an integer >= 1: '0'"),
     ("--max-model-len", "-5", "not an integer >= 1: '-5'"),
     ("--block-size", "0", "not an integer >= 1: '0'"),
     ("--num-threads", "-1", "not an integer >= 1: '-1'"),
     ("--device", "bogus", "not a device (auto, cpu, cuda or cuda:N): 'bogus'"),
     ("--device", "cuda:x", "not a device (auto, cpu, cuda or cuda:N): 'cuda:x'"),
     ("--gpu-memory-utilization", "0", "not a number in (0, 1]: '0'"),
     ("--gpu-memory-utilization", "1.5", "not a number in (0, 1]: '1.5'"),
     ("--gpu-memory-utilization", "nan", "not a number in (0, 1]: 'nan'")],
)  # fmt: skip
def test_bad_engine_flags_are_usage_errors(command, flag, value, message, capsys):
    # the engine flags every engine command shares: checked while parsing, not once the model
    # has loaded (a block size of 0 divided by zero, --device bogus was torch's traceback, and
    # --max-model-len 0 quietly meant the model's whole context)
    assert_usage_error(_engine_argv(command, flag, value), flag, message, capsys)


def test_good_engine_flags_parse():
    for device in ("auto", "cpu", "cuda", "cuda:1"):
        argv = _engine_argv("serve", "--device", device)
        assert build_parser(argv).parse_args(argv).device == device
    argv = _engine_argv("generate", "--max-model-len", "1", "--block-size", "1",
                        "--num-threads", "1", "--gpu-memory-utilization", "1")  # fmt: skip
    args = build_parser(argv).parse_args(argv)
    assert (args.max_model_len, args.block_size, args.num_threads) == (1, 1, 1)
    assert args.gpu_memory_utilization == 1.0


@pytest.mark.parametrize("command", ["generate", "chat"])
@pytest.mark.parametrize(
    "flag, value, message",
    [("--max-tokens", "-1", "max_tokens must be non-negative"),
     ("--temperature", "-1", "temperature must be non-negative"),
     ("--temperature", "nan", "temperature must be a finite number"),
     ("--top-p", "2", "top_p must be in (0, 1]"),
     ("--top-k", "-5", "top_k must be -1 (off) or positive"),
     ("--top-k", "few", "invalid int value: 'few'")],
)  # fmt: skip
def test_bad_sampling_flags_are_usage_errors(command, flag, value, message, capsys):
    # checked as the engine checks them, while parsing: one line and exit 2, before the model
    # loads, not a traceback after
    assert_usage_error(_engine_argv(command, flag, value), flag, message, capsys)


def test_good_sampling_flags_parse():
    argv = ["generate", "prompt", "--max-tokens", "0", "--temperature", "0", "--top-p", "1",
            "--top-k", "-1", "--sampling-seed", "7"]  # fmt: skip
    args = build_parser(argv).parse_args(argv)
    assert (args.max_tokens, args.temperature, args.top_p, args.top_k, args.sampling_seed) == (
        0, 0.0, 1.0, -1, 7
    )  # fmt: skip
