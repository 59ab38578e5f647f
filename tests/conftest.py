"""Shared fixtures: the test-sized tiny target (built once into the cache) and a throwaway API key."""

import os
import secrets
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("DRAFTSMITH_PROGRESS", "log")

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_target() -> Path:
    """Folder of the `tiny-test` target (same architecture as the demo target, built in seconds)."""
    from draftsmith.target import resolve_target

    return resolve_target("tiny-test", log=lambda *a: None)


@pytest.fixture(scope="session")
def target_tokenizer(tiny_target):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_target)


@pytest.fixture
def api_key_file(tmp_path) -> tuple[Path, str]:
    """A key file holding a fresh random key, for tests that check the key never leaks."""
    key = "sk-or-v1-" + secrets.token_hex(32)
    path = tmp_path / "openrouter.key"
    path.write_text(key + "\n")
    return path, key


def python() -> str:
    return sys.executable
