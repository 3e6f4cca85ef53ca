"""Attention backends: an interface, a registry, and the pure-PyTorch reference."""

from specserve.layers.attention.base import AttentionBackend, AttentionMetadata
from specserve.layers.attention.torch_ref import TorchAttentionBackend
from specserve.layers.attention.triton_attn import TritonAttentionBackend

BACKENDS: dict[str, type[AttentionBackend]] = {"torch": TorchAttentionBackend}
BACKENDS["triton"] = TritonAttentionBackend  # kernels load on first use


def get_backend(name: str) -> AttentionBackend:
    """Instantiate the backend registered under `name`."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {sorted(BACKENDS)}")
    return BACKENDS[name]()


__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttentionBackend", "get_backend"]
