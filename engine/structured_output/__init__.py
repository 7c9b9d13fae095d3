"""Structured outputs: grammars that constrain what a request may generate.

`spec` (the wire type, imported by `SamplingParams`) and `grammars` (building and checking
grammars in the frontend) have no engine dependencies; `manager` is the engine core's side:
it compiles grammars off the step loop, caches them, and computes each step's token bitmask.
"""
