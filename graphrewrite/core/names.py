"""Name prefixes and suffixes of the nodes graphrewrite adds, and the attributes it marks nodes
with, so every module recognises them the same way."""

__all__ = ["TRIGGER_PREFIX", "GATE_PREFIX", "PAD_PREFIX", "MICRO_BATCH_GATE_PREFIX", "LOOP_PREFIX",
           "LOOP_GATE", "LOOP_SUFFIX", "COPY_SUFFIX",
           "AHEAD_SUFFIX", "SWAP_OUT_SUFFIX", "SWAP_IN_SUFFIX", "ACCUMULATE_SUFFIX",
           "ACCUMULATE_GUARD_SUFFIX", "DIET_ATTR", "SLOT_OF_ATTR", "copied_from",
           "made_here"]

TRIGGER_PREFIX = "graphrewrite/recompute_trigger/"  # a NoOp gating a recomputed segment
# An Identity a copied convolution, product or batch norm reads its input through, waiting on the
# trigger in its place (Grappler fuses them only without control edges: `triggers.keep_fusable`)
GATE_PREFIX = "graphrewrite/recompute_gate/"
PAD_PREFIX = "graphrewrite/pad/"                    # an IdentityN keeping Grappler's reader counts
# A NoOp that waits for one micro-batch's backward pass, the next forward pass's first nodes for it
MICRO_BATCH_GATE_PREFIX = "graphrewrite/micro_batch_done/"
LOOP_PREFIX = "graphrewrite/loop_recompute/"  # a forward node copied into a gradient loop's body
# What a gradient loop's copies wait on: its iterations then keep pace with the sums it carries.
LOOP_GATE = LOOP_PREFIX + "gradient_ready"
# Nodes that stand in for an original as an operand (recomputed and swapped copies) are named
# after it plus a suffix starting with "-", the lowest character a node name may hold after the
# first: the copy sorts against every other name as its original does (unless that name extends
# the original's with "-", or an input names a later output port: "x:1" sorts after "x/y", while
# "x-...:1" sorts before it). Grappler sorts the inputs of commutative ops by name (its
# canonicalizer) and MinimizeBroadcasts pairs operands in that order, so a copy that sorted
# elsewhere would regroup a Mul chain and round differently (issue 14).
COPY_SUFFIX = "-graphrewrite_recompute"              # a recomputed copy of a forward node
AHEAD_SUFFIX = "-graphrewrite_recompute_ahead"       # a copy computing a checkpoint again
SWAP_OUT_SUFFIX = "-graphrewrite_swap_out"           # a copy of an activation in host memory
SWAP_IN_SUFFIX = "-graphrewrite_swap_in"             # the copy back, just before backward reads it
ACCUMULATE_SUFFIX = "-graphrewrite_accumulate"      # a link of a running sum replacing an AddN
ACCUMULATE_GUARD_SUFFIX = "-graphrewrite_accumulate_guard"  # keeps Grappler from refolding it
LOOP_SUFFIX = "-graphrewrite_loop"  # a copy in a gradient loop standing for the pop it replaces

# Attributes the diet pass sets on what it rewrote (read back by `analysis.state`, `verify`, the
# TF2 API's binding).
DIET_ATTR = "_graphrewrite_diet"  # on a variable: "int16 <scale>" or "bfloat16"
SLOT_OF_ATTR = "_graphrewrite_slot_of"  # on an optimizer slot: the variable it serves


def copied_from(name: str) -> str | None:
    """The original node a recomputed copy stands in for; None for any other node (a pad of a
    copy, whose name ends the same way, included)."""
    if name.endswith(COPY_SUFFIX) and not name.startswith(PAD_PREFIX):
        return name[:-len(COPY_SUFFIX)]
    return None


def made_here(name: str) -> bool:
    """Whether `name` may be of a node a graphrewrite pass adds: every such name holds
    "graphrewrite" (a plan's recompute decision names diet's dequantized reads, made by the
    pass before it)."""
    return "graphrewrite" in name
