"""Name prefixes of the nodes graphrewrite adds, so every module recognises them the same way."""

COPY_PREFIX = "graphrewrite/recompute/"             # a recomputed copy of a forward node
TRIGGER_PREFIX = "graphrewrite/recompute_trigger/"  # a NoOp gating a recomputed segment
AHEAD_PREFIX = "graphrewrite/recompute_ahead/"      # a copy computing a checkpoint again
PAD_PREFIX = "graphrewrite/pad/"                    # an IdentityN keeping Grappler's reader counts
# Swap copies are named after their tensor plus a suffix starting with "-", the lowest character
# a node name may hold: readers sort them where they sorted the original, and Grappler, which
# orders the inputs of commutative ops by name, sums in the same order as before.
SWAP_OUT_SUFFIX = "-graphrewrite_swap_out"           # a copy of an activation in host memory
SWAP_IN_SUFFIX = "-graphrewrite_swap_in"             # the copy back, just before backward reads it
ACCUMULATE_SUFFIX = "-graphrewrite_accumulate"      # a link of a running sum replacing an AddN
ACCUMULATE_GUARD_SUFFIX = "-graphrewrite_accumulate_guard"  # keeps Grappler from refolding it
