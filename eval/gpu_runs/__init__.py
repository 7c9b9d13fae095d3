"""Measured runs of the engine on real devices, one folder per device and engine commit:
scheduler traces (`.jsonl.gz`) and `bench agent` reports, as the runs wrote them. The
calibrated cost profiles are fitted to these (`continuum bench calibrate`) and checked
against them (`continuum bench check-calibration`)."""
