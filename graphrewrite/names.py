"""Name prefixes of the nodes graphrewrite adds, so every module recognises them the same way."""

COPY_PREFIX = "graphrewrite/recompute/"             # a recomputed copy of a forward node
TRIGGER_PREFIX = "graphrewrite/recompute_trigger/"  # a NoOp gating a recomputed segment
PAD_PREFIX = "graphrewrite/recompute_pad/"          # an IdentityN keeping Grappler's reader counts
