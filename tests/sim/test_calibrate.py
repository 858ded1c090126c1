"""Calibration against the real engine on this CPU (slow: loads and times the default model)."""

import pytest

from servelm.cli import main
from servelm.sim.profiles import load_profile


@pytest.mark.slow
def test_calibrated_profile_predicts_held_out_steps(tmp_path, default_model_dir):
    out = tmp_path / "cpu.json"
    code = main(
        ["simulate", "--calibrate", "--calibrate-model", str(default_model_dir),
         "--calibrate-seconds", "40", "--profile-out", str(out)]
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
