"""Scheduler trace records, the JSONL writer and reader, and trace analysis."""
