"""The OpenAI-compatible HTTP server: FastAPI in one process, the engine loop in another."""
