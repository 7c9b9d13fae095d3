"""Measured cost profiles that ship with the package: `NAME.json`, each written by
`continuum bench calibrate` (its `command` says how) and named by its file name."""
