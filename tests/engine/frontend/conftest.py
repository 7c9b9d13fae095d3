import pytest

from engine.frontend.tokenizer import load_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer("tiny")
