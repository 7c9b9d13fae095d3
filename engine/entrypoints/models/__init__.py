"""`continuum models`: fetch catalogued models into the model cache, list and locate them.

Each command is a module with `add_arguments(parser)` and `main(args) -> int`, as `engine.cli`
expects; the work is `engine.model.fetch`'s and `engine.model.catalog`'s.
"""
