"""The frontend: tokenization, validation, detokenization, and the public engine APIs."""
