"""The serving engine: configs, requests, the KV cache, the scheduler and (later) execution."""

__version__ = "0.1.0"
