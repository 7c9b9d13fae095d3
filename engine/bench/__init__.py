"""Benchmarks behind `continuum bench ...`; each prints a table and can write JSON."""
