"""The cost profiles of the simulated executor, by name or by file.

Named: the roofline profiles (`engine.executor.roofline.SIM_PROFILES`) and the measured
profiles that ship in `measured_profiles/` (`NAME.json`). Any other measured profile is
given as the path of its JSON file (`engine.executor.measured`).
"""

from __future__ import annotations

from pathlib import Path

from engine.executor.measured import MeasuredProfile, read_measured_profile
from engine.executor.roofline import SIM_PROFILES, SimProfile

CostProfile = SimProfile | MeasuredProfile
MEASURED_PROFILE_DIR = Path(__file__).resolve().parent / "measured_profiles"


def sim_profile_names() -> tuple[str, ...]:
    """Every named profile: the roofline ones, then the shipped measured ones."""
    shipped = sorted(path.stem for path in MEASURED_PROFILE_DIR.glob("*.json"))
    return (*SIM_PROFILES, *shipped)


def get_sim_profile(name_or_path: str) -> CostProfile:
    """The profile named `name_or_path`, else the measured profile in that file. ValueError
    listing the names for neither, or saying what is wrong with the file."""
    if name_or_path in SIM_PROFILES:
        return SIM_PROFILES[name_or_path]
    shipped = MEASURED_PROFILE_DIR / f"{name_or_path}.json"
    if Path(name_or_path).name == name_or_path and shipped.is_file():
        return _named(read_measured_profile(shipped), name_or_path)
    if Path(name_or_path).is_file():
        return read_measured_profile(name_or_path)
    raise ValueError(f"unknown sim profile {name_or_path!r}: neither a name (known: "
                     f"{', '.join(sim_profile_names())}) nor a measured profile's file")


def _named(profile: MeasuredProfile, name: str) -> MeasuredProfile:
    if profile.name != name:
        raise ValueError(f"the shipped profile file {name}.json names itself {profile.name!r}")
    return profile
