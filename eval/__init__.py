"""Workload loaders, the replay client, the simulator and reports."""
