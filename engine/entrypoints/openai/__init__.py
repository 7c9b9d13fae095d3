"""The OpenAI-compatible HTTP API (FastAPI), with the job extension and Prometheus metrics."""
