"""The model runner and the state it keeps between steps (imports torch)."""
