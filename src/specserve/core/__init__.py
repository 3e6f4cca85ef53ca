"""The basement of the floor plan (docs/ARCHITECTURE.md): configuration, errors, sampling
parameters, requests and their per-step share, the paged KV cache. Every other package may
import it; it imports none of them."""
