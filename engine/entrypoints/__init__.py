"""Ways into the engine from outside Python: the OpenAI-compatible HTTP server."""
