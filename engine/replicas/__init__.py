"""Engine replicas: routing requests among several engines, and serving them on Ray Serve."""
