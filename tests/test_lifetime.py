"""What a command-line run never frees: held only once the command's entry asks for it (in a
child process: the holding lasts as long as the process)."""

import subprocess
import sys

CHILD = """
import gc, weakref
from graphrewrite.core import lifetime

class Big:
    pass

def held():
    value = Big()
    alive = weakref.ref(value)
    lifetime.hold(value)
    del value
    gc.collect()
    return alive() is not None

print(held(), end=" ")
lifetime.hold_until_exit()
print(held())
"""


def test_values_are_held_only_after_hold_until_exit():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                         check=True).stdout
    assert out.split() == ["False", "True"]  # a library caller's object is freed as usual
