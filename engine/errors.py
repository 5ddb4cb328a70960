"""One exception hierarchy for the engine; the service maps each class to an HTTP status."""

from __future__ import annotations

ECHO_CHARS = 64  # the most of a client's value an error message repeats


def clipped(text: str, limit: int = ECHO_CHARS) -> str:
    """A client's text as an error names it, cut to its first ``limit`` characters: a
    megabyte-long name is not echoed back (nor logged) whole."""
    return text if len(text) <= limit else text[:limit] + "..."


def quoted(value: object, limit: int = ECHO_CHARS) -> str:
    """``repr`` of a client's value for an error message, cut as :func:`clipped` cuts it."""
    if isinstance(value, str) and len(value) > limit:
        return repr(value[:limit]) + "..."
    return repr(value)


class QttsError(Exception):
    """Base of every error the engine raises on purpose. Its message is one line for a user."""


class BackendError(QttsError):
    """A backend choice the build or the machine cannot serve, or a bad backend setting."""


class NativeBuildError(QttsError):
    """The native ggml layer is missing, stale or failed to load."""


class ModelFileError(QttsError):
    """A model file (GGUF or HF checkpoint) that is missing, malformed or inconsistent.

    The message always starts with the file name, e.g.
    ``model.gguf: tensor dec.blk.1.tconv.weight has shape [...], expected [...]``.
    """

    def __init__(self, path: str, problem: str) -> None:
        self.path = path
        self.problem = problem
        super().__init__(f"{path}: {problem}")


class ConversionError(ModelFileError):
    """A checkpoint folder that `qtts convert` refuses."""


class InputError(QttsError):
    """A bad request input (codes, text, voice, ...). ``field`` names the offending field;
    ``code`` is the machine-readable reason an HTTP error body carries."""

    def __init__(self, field: str, problem: str, *, code: str = "invalid_value") -> None:
        self.field = field
        self.problem = problem
        self.code = code
        super().__init__(f"{field}: {problem}")
