"""`servelm plan`: numbers out of range refused by flag, and hub ids taken only as what they
name (a catalog model under its own owner), never another owner's repo of the same name."""

import json

import pytest

from servelm.cli import main
from servelm.planner.catalog import get_model
from servelm.planner.shapes import ShapeError


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--gpu-memory-gb", "-3"], "--gpu-memory-gb: not a number > 0: '-3'"),
        (["--gpu", "custom", "--gpu-memory-gb", "0"], "--gpu-memory-gb: not a number > 0: '0'"),
        (["--gpu-memory-gb", "nan"], "--gpu-memory-gb: not a number > 0: 'nan'"),
        (["--gpu-bandwidth-gbs", "0"], "--gpu-bandwidth-gbs: not a number > 0: '0'"),
        (["--gpu-tflops", "-1"], "--gpu-tflops: not a number > 0: '-1'"),
        (["--block-size", "0"], "--block-size: not an integer >= 1: '0'"),
        (["--typical-len", "0"], "--typical-len: not an integer >= 1: '0'"),
        (["--allowance-gb", "-1"], "--allowance-gb: not a number >= 0: '-1'"),
        (["--tp", "0"], "--tp: not an integer >= 1: '0'"),
        (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization: not a number in (0, 1]"),
    ],
)
def test_numbers_out_of_range_are_refused_by_flag(flags, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "llama-3.1-8b", *flags])
    assert exit_.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"servelm plan: error: argument {says}"), last


def test_a_hub_id_is_planned_only_under_its_catalog_owner(capsys):
    assert get_model("meta-llama/Llama-3.1-8B").name == "llama-3.1-8b"  # base id, same shape
    assert get_model("QWEN/Qwen2.5-7B-Instruct").name == "qwen2.5-7b"  # owners ignore case
    with pytest.raises(ShapeError, match="the catalog's llama-3.1-8b is meta-llama's"):
        get_model("nobody/llama-3.1-8b")
    assert main(["plan", "nobody/llama-3.1-8b", "--json"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "servelm fetch nobody/llama-3.1-8b" in err and len(err.splitlines()) == 1
    assert main(["plan", "meta-llama/Llama-3.1-8B-Instruct", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == "llama-3.1-8b"


def test_an_unknown_hub_id_points_at_fetch(capsys):
    assert main(["plan", "HuggingFaceTB/SmolLM2-360M-Instruct"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'HuggingFaceTB/SmolLM2-360M-Instruct'" in err
    assert "`servelm fetch HuggingFaceTB/SmolLM2-360M-Instruct` prints one" in err


def test_the_help_says_what_a_model_can_be(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    said = " ".join(capsys.readouterr().out.split())
    assert "catalog name (see --list) or its hub id" in said
    assert "local model folder / config.json" in said
