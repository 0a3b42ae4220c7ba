"""The diet pass's options and result, and the formats and op types it knows."""

from __future__ import annotations

from dataclasses import dataclass, field

from tensorflow.core.framework import types_pb2

from ...analysis import bind, optimizers
from ...core.errors import GraphRewriteError
from ..base import PassOptions, PassResult, counted

__all__ = ["DEFAULT_SCALE", "FORMATS", "SMALL", "APPLY_OPS", "RESOURCE_VARIABLE", "REF_VARIABLES",
           "RESOURCE_READS", "RESOURCE_QUERIES", "REF_READERS", "VIEW_OPS", "SLOT_USERS",
           "STEP_WRITES", "DietOptions", "DietResult"]

DEFAULT_SCALE = 10.0 / bind.INT16_MAX  # the seed's: values in [-10, 10], quantum 3.05e-4
FORMATS = {"int16": types_pb2.DT_INT16, "bfloat16": types_pb2.DT_BFLOAT16}
SMALL = "fewer than"  # the reason small variables stay float32
APPLY_OPS = tuple(optimizers.APPLY_OPS)  # the fused updates (`optimizers` reads them)
RESOURCE_VARIABLE, REF_VARIABLES = "VarHandleOp", ("VariableV2", "Variable")
# What may touch a dieted variable besides its update: reads (rewritten to dequantize), writes
# of whole values (initializers, restores: rewritten to quantize) and harmless queries.
RESOURCE_READS = ("ReadVariableOp", "ResourceGather")
RESOURCE_QUERIES = ("VarIsInitializedOp", "VariableShape")
REF_READERS = ("Identity", "SaveV2", "IsVariableInitialized")
# How an update of a form diet does not read may write a resource variable (`store_written`).
STEP_WRITES = ("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp")
# Ops that pass a read value, or a part of it, on unchanged (a view): a backward reader behind
# one gets a copy of the view on its own late read, and a forward read waits for the inputs of
# the ops reading its views. A slice of stacked weights (a mixture of experts' `w[e]`) shares
# the buffer of a whole dequantized read in TensorFlow: held for its backward reader, each kept
# the whole float32 copy alive.
VIEW_OPS = ("Identity", "Reshape", "ExpandDims", "Squeeze", "Transpose", "Snapshot",
            "StridedSlice", "Slice")
# What may touch a removed slot: its reads, initializer and restore, and queries.
SLOT_USERS = ("ReadVariableOp", "Identity", "AssignVariableOp", "Assign", "VarIsInitializedOp",
              "IsVariableInitialized", "SaveV2")


@dataclass(frozen=True)
class DietOptions(PassOptions):
    """format: int16 (fixed point, x scale) or bfloat16; scale: the int16 quantum; momentum:
    drop (beta1 = 0), keep the first moment, or keep it stored as bfloat16 (a new slot,
    rounded to nearest); auto, Adam's dropped and any other kept as bfloat16
    (`variables.momentum_for`); factored: a row and a column second-moment accumulator for 2-D
    weights; rounding: stochastic or nearest when the update is written;
    min_size: variables (and frozen constants) with fewer elements stay float32; read_only:
    also the variables the step reads and never writes (a LoRA base, a teacher), rounded to
    nearest once, where they are initialised or restored; generic: also the variables an update
    of a form diet does not read writes from the gradient (Nadam, Adamax, a hand-written LAMB):
    stored in 16 bits, the optimizer's own arithmetic in float32 where each is written, its
    state as bfloat16 rounded stochastically."""

    format: str = "int16"
    scale: float = DEFAULT_SCALE
    momentum: str = "auto"
    factored: bool = True
    rounding: str = "stochastic"
    min_size: int = 1024
    reads: str = "priced"
    read_only: bool = True
    generic: bool = True

    def __post_init__(self):
        for key, allowed in (("format", tuple(FORMATS)),
                             ("momentum", ("auto", "drop", "keep", "bfloat16")),
                             ("rounding", ("stochastic", "nearest")),
                             ("reads", ("priced", "gated", "ungated"))):
            if getattr(self, key) not in allowed:
                raise GraphRewriteError(f"pass 'diet': option '{key}' expects "
                                        f"{' or '.join(allowed)}, not '{getattr(self, key)}'")
        if not self.scale > 0:
            raise GraphRewriteError(f"pass 'diet': option 'scale' expects a positive number, "
                                    f"not '{self.scale}'")
        if self.min_size < 0:
            raise GraphRewriteError("pass 'diet': option 'min_size' expects a count >= 0")


@dataclass
class DietResult(PassResult):
    dieted: list[str] = field(default_factory=list)          # variables now 16-bit
    read_only: list[str] = field(default_factory=list)  # variables the step only reads, 16-bit
    constants: list[str] = field(default_factory=list)       # frozen constants now 16-bit
    slots_removed: list[str] = field(default_factory=list)
    slots_added: list[str] = field(default_factory=list)
    kept_float: dict[str, list[str]] = field(default_factory=dict)  # reason -> variables
    bytes_saved: int = 0  # modelled persistent bytes, values and slots
    forward_reads: str = ""  # "gated" or "ungated": the order kept (`choose_reads`)
    read_peaks: list[int] = field(default_factory=list)  # as run: [gated, ungated] bytes
    updates_inlined: list[str] = field(default_factory=list)  # calls writing variables, spliced

    def section(self) -> dict:
        return {**super().section(), "kept_float": counted(self.kept_float)}
