"""Facts about op types: the sets several layers ask about, and what TensorFlow's op registry
says of an op (TensorFlow is imported on first use)."""

from __future__ import annotations

import functools
import os

__all__ = ["PLACEHOLDER_OPS", "V1_LOOP_OPS", "FUNCTIONAL_CONTROL_OPS", "XENT_OPS", "op_def",
           "is_known",
           "is_stateful", "takes_seed", "unseeded"]

# Required feeds only: a PlaceholderWithDefault (a Saver's filename) need not be fed.
PLACEHOLDER_OPS = frozenset({"Placeholder", "PlaceholderV2"})
V1_LOOP_OPS = frozenset({"Enter", "RefEnter", "Exit", "RefExit", "Merge", "RefMerge", "Switch",
                         "RefSwitch", "NextIteration", "RefNextIteration", "LoopCond"})
FUNCTIONAL_CONTROL_OPS = frozenset({"While", "StatelessWhile", "If", "StatelessIf", "Case",
                                    "StatelessCase"})
# Softmax cross entropies of logits: their second output is the logits' gradient.
XENT_OPS = frozenset({"SparseSoftmaxCrossEntropyWithLogits", "SoftmaxCrossEntropyWithLogits"})


@functools.lru_cache(maxsize=None)
def _registry():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow  # noqa: F401  (registers every op of the build)
    from tensorflow.python.framework import op_def_registry

    return op_def_registry


@functools.lru_cache(maxsize=None)
def op_def(op: str):
    """The registered OpDef of `op`, or None for ops this TensorFlow build does not know."""
    return _registry().get(op)


def is_known(op: str, function_names=frozenset()) -> bool:
    """True for registered ops and for functions of the graph's library (callable as ops)."""
    return op in function_names or op_def(op) is not None


def is_stateful(op: str) -> bool:
    """Registry's `is_stateful`; unknown ops count as stateful (never safe to duplicate)."""
    definition = op_def(op)
    return definition is None or definition.is_stateful


@functools.lru_cache(maxsize=None)
def takes_seed(op: str) -> bool:
    """A random op seeded by `seed`/`seed2` attributes (RandomUniform, TruncatedNormal, ...)."""
    definition = op_def(op)
    return definition is not None and {"seed", "seed2"} <= {a.name for a in definition.attr}


def unseeded(node) -> bool:
    """A random op whose `seed` and `seed2` are both 0, so TensorFlow draws one per session.
    An absent attribute is 0: a SavedModel's functions are saved with default values stripped
    (an EfficientNet's dropouts there had none, and its step differed from itself)."""
    return takes_seed(node.op) and all(name not in node.attr or node.attr[name].i == 0
                                       for name in ("seed", "seed2"))
