"""Calibration against the real engine on this CPU (slow: loads and times the default model)."""

import pytest

from servelm.cli import main
from servelm.sim.profiles import load_profile


@pytest.mark.slow
def test_calibrated_profile_predicts_held_out_steps(tmp_path, default_model_dir):
    # Each shape keeps its fastest time over the rounds, which is what holds noise down. On an
    # AVX2-only CPU the first round takes about 75 s (the decode batches' prompts are computed,
    # untimed), later ones far less (the prefix cache has those prompts): 150 s buys 3-4 rounds
    # there (held-out errors within 8 %; with one round, up to 31 %).
    out = tmp_path / "cpu.json"
    code = main(
        ["simulate", "--calibrate", "--calibrate-model", str(default_model_dir),
         "--calibrate-seconds", "150", "--profile-out", str(out)]
    )  # fmt: skip
    assert code == 0
    saved = load_profile(out)
    assert saved.model == str(default_model_dir)
    held_out = saved.fit["held_out"]
    assert len(held_out) >= 2
    assert all(abs(point["error"]) <= 0.25 for point in held_out), held_out
    # the profile drives a simulation of the model it was measured with
    assert main(["simulate", "--profile", str(out), "--rate", "0.2", "--num-requests", "3",
                 "--input-len", "64", "--output-len", "4"]) == 0  # fmt: skip
