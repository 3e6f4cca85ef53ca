"""One error type per user-facing failure; each message says what to change."""

from collections.abc import Iterator
from contextlib import contextmanager


class SpecserveError(Exception):
    """Base class of every error specserve raises on purpose."""


class ConfigError(SpecserveError, ValueError):
    """An engine or server option is out of range or inconsistent with another."""


class UnsupportedModelError(SpecserveError):
    """The checkpoint's architecture or a feature of its config is not supported."""


class CheckpointError(SpecserveError):
    """The checkpoint is incomplete or inconsistent: missing files, missing or extra tensors,
    shape mismatches."""


class TensorParallelError(SpecserveError):
    """The ranks of a tensor-parallel group disagree (--debug-tp-check) or one of them died."""


class InvalidRequestError(SpecserveError, ValueError):
    """A request's prompt or sampling parameters are invalid; `field` names the culprit."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class RequestTooLargeError(InvalidRequestError):
    """A request can never fit: longer than the model's context or the whole KV cache."""


@contextmanager
def drafter_errors(path: str | None) -> Iterator[None]:
    """Errors loading the drafter at `path` name its flag and folder (the target, loaded
    first, was fine: without them a missing tensor reads as the target's)."""
    try:
        yield
    except SpecserveError as e:
        raise type(e)(f"--speculative-draft-model-path {path}: {e}") from None
