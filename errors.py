"""The project's error types and the one way an exception becomes one line. A leaf: it imports
nothing of the project, so any module can raise these without loading another."""
from __future__ import annotations


class ConfigError(ValueError):
    """A bad configuration or input; the message is one line and names the key (or the file, the
    data row, the rank). Printed once, exit code 2 (failures.exit_bad_input)."""


class NodeConfigError(ConfigError):
    """A launch error only the ranks of one node find (its device count): that node's first rank
    prints it, not only rank 0 (failures.exit_bad_input)."""


class ModelError(ConfigError):
    """A model folder that cannot be used (unsupported family, missing weights, a template that
    does not render): one line naming `model.path`."""


class StartError(ConfigError):
    """Bad input found at start-up, the same on every rank (a run folder locked by another job
    or not writable, a missing or damaged checkpoint): printed once as ``<prefix>: <message>``,
    exit code 2 on every rank (failures.exit_bad_input)."""

    def __init__(self, message: str, prefix: str = "error"):
        super().__init__(message)
        self.prefix = prefix


def causes(e: BaseException, depth: int = 0) -> list[BaseException]:
    """`e` and what is inside it: causes, contexts, and the per-rank failures of torch's
    CheckpointException (whose own message is a multi-line traceback)."""
    if depth > 8:
        return [e]
    out = [e]
    for inner in [e.__cause__, e.__context__] + [
            f[0] for f in (getattr(e, "failures", None) or {}).values() if isinstance(f, tuple)]:
        if isinstance(inner, BaseException) and inner is not e:
            out += causes(inner, depth + 1)
    return out


def one_line(e: BaseException, limit: int = 300, typed: bool = True) -> str:
    """`Type: message` (`typed=False`: the message alone) with the message's whitespace (newlines
    included) collapsed, at most `limit` characters; a CheckpointException is described by the
    first rank's error inside it."""
    if getattr(e, "failures", None):
        e = next((c for c in causes(e)[1:] if not getattr(c, "failures", None)), e)
    message = " ".join(str(e).split())
    text = (f"{type(e).__name__}: {message}" if typed else message) if message else type(e).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."
