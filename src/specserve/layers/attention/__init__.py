"""Attention backends: an interface, a registry, and the pure-PyTorch reference."""

from specserve.layers.attention.base import AttentionBackend, AttentionMetadata
from specserve.layers.attention.torch_ref import TorchAttentionBackend

BACKENDS: dict[str, type[AttentionBackend]] = {"torch": TorchAttentionBackend}


def get_backend(name: str) -> AttentionBackend:
    """Instantiate the backend registered under `name`."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {sorted(BACKENDS)}")
    return BACKENDS[name]()


__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttentionBackend", "get_backend"]
