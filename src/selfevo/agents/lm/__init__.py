"""Language-model backends: local chat models (transformers; a scripted model for tests) and an
OpenAI-compatible chat server over them. Importing this package does not import torch."""

from selfevo.agents.lm.model import (
    ChatModel,
    Completion,
    ModelFault,
    ScriptedModel,
    TransformersChatModel,
    load_chat_model,
    messages_digest,
    smollm2_dir,
)

__all__ = ["ChatModel", "Completion", "ModelFault", "ScriptedModel", "TransformersChatModel",
           "load_chat_model", "messages_digest", "smollm2_dir"]
