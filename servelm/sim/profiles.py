"""Device profiles on disk: the JSON `servelm simulate --calibrate` writes and `--profile` reads.

    {"schema": "servelm.sim.profile/1",
     "profile": {DeviceProfile fields},          # rates in the cost model's units (see below)
     "model": "/path/or/catalog name",           # the model the fit was measured with
     "fit": {...}}                               # how well it fitted (points, errors)

Fitted rates are only meaningful with the cost model they were fitted against
(`ModelCost.from_shape(shape, "bf16", "bf16")`): a CPU running float32 weights moves twice the
bytes the cost model counts, and the fitted bandwidth absorbs that factor.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from servelm.sim.roofline import DeviceProfile

SCHEMA = "servelm.sim.profile/1"


@dataclass
class ProfileFile:
    """A saved profile, the model it was measured with, and the fit's report."""

    profile: DeviceProfile
    model: str | None = None
    fit: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "profile": asdict(self.profile),
            "model": self.model,
            "fit": self.fit,
        }

    def write(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)  # as a results file's is made
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")


def load_profile(path: str | Path) -> ProfileFile:
    """Read a profile JSON written by `ProfileFile.write`; ValueError on another kind of file."""
    try:
        data = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not a {SCHEMA} file (not JSON: {exc})") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise ValueError(f"{path}: not a {SCHEMA} file")
    profile = profile_from_dict(data.get("profile") or {}, path)
    return ProfileFile(profile, data.get("model"), data.get("fit") or {})


def profile_from_dict(raw: dict[str, Any], path: str | Path = "profile") -> DeviceProfile:
    """A DeviceProfile from its `asdict` form (unknown keys ignored, the nested profiles of
    a decode stack and of wide steps too)."""
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a profile must be a JSON object")
    missing = {"name", "peak_flops", "mem_bandwidth"} - raw.keys()
    if missing:
        raise ValueError(f"{path}: profile lacks {sorted(missing)}")
    known = {f.name for f in fields(DeviceProfile)}
    values = {k: v for k, v in raw.items() if k in known}
    for nested in ("decode_stack", "wide_step"):
        if values.get(nested) is not None:
            values[nested] = profile_from_dict(values[nested], f"{path} ({nested})")
    defaults = {"compute_efficiency": 1.0, "bandwidth_efficiency": 1.0, "step_overhead_s": 0.0}
    return DeviceProfile(**{**defaults, **values})
