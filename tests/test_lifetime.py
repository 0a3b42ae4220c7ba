"""What a command-line run never frees: held only once the command's entry asks for it."""

import gc
import weakref

from graphrewrite.core import lifetime


class _Big:
    pass


def test_values_are_held_only_after_hold_until_exit(monkeypatch):
    monkeypatch.setattr(lifetime, "_held", None)
    value = _Big()
    gone = weakref.ref(value)
    lifetime.hold(value)
    del value
    gc.collect()
    assert gone() is None  # a library caller's object is freed as usual
    lifetime.hold_until_exit()
    value = _Big()
    kept = weakref.ref(value)
    lifetime.hold(value)
    del value
    gc.collect()
    assert kept() is not None
