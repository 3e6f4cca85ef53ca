"""specserve: an LLM inference server whose speculative decoding adapts to load."""

from specserve.core.errors import (
    CheckpointError,
    ConfigError,
    InvalidRequestError,
    RequestTooLargeError,
    SpecserveError,
    UnsupportedModelError,
)
from specserve.core.sampling_params import Grammar, SamplingParams

__all__ = [
    "LLM",
    "SamplingParams",
    "Grammar",
    "CompletionOutput",
    "SpecserveError",
    "ConfigError",
    "CheckpointError",
    "UnsupportedModelError",
    "InvalidRequestError",
    "RequestTooLargeError",
]


def __getattr__(name: str):
    # LLM pulls in torch and the model code; import it lazily so `specserve --help` stays fast.
    if name in ("LLM", "CompletionOutput"):
        from specserve import llm

        return getattr(llm, name)
    raise AttributeError(name)
