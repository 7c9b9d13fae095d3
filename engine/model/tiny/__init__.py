"""The embedded default model `tiny`: config, tokenizer and chat template files.

Made by `scripts/make_tiny_model.py`; its weights are drawn from a fixed seed at load time.
"""

from pathlib import Path

TINY_MODEL_DIR = Path(__file__).resolve().parent
