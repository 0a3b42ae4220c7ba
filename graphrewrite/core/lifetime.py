"""What a command-line run never frees. The `graphrewrite` command ends its process with
`os._exit` once every output is written and flushed (`cli.main.entry`), so a large object
dropped on the way (the 150k-node TensorFlow graph an import check built: half a second to free;
a rewrite's two graphs and their analyses when the command returns) only costs the time to free
what the exit would drop at once. Library callers free as usual: `hold` keeps nothing until
`hold_until_exit` is called."""

from __future__ import annotations

__all__ = ["hold_until_exit", "hold"]

_held: list | None = None


def hold_until_exit() -> None:
    """From now on `hold` keeps what it is given for the rest of the process (call this only
    where the process ends without freeing anything, as the command's entry does)."""
    global _held
    if _held is None:
        _held = []


def hold(value) -> None:
    """Keep `value` alive to the end of the process if `hold_until_exit` was called; else
    nothing (the caller's reference was the last, and it is freed as usual)."""
    if _held is not None:
        _held.append(value)
