"""Optimizer updates in a training graph, whatever form the optimizer gave them.

`tf.compat.v1.train` optimizers write each variable with one fused op (`ResourceApplyAdam`,
`ApplyMomentum`, ...) whose inputs name the slots and hyperparameters by position. Keras
optimizers in a TF2 step decompose the same update into reads, arithmetic and
`AssignAddVariableOp`/`AssignSubVariableOp`/`AssignVariableOp` on resource placeholders:

- Adam: `m += (g - m) * (1 - beta1)`, `v += (g^2 - v) * (1 - beta2)`, then
  `var -= (m' * alpha) / (sqrt(v') + epsilon)` with `alpha = lr sqrt(1 - beta2^t) / (1 - beta1^t)`
  (m', v': reads after the slot writes);
- SGD with momentum: `m = -g lr + m momentum`, then `var += m'`, or with Nesterov's
  `var += -g lr + m' momentum`;
- RMSprop: `v = rho v + (1 - rho) g^2`, then `var += -(lr g) rsqrt(v' + epsilon)`; with
  momentum, `mom = momentum mom + (lr g) rsqrt(v' + epsilon)`, then `var += -mom'`;
- Adagrad: `acc += g * g`, then `var -= (lr g) / sqrt(acc' + epsilon)`;
- SGD: `var += -g lr`;
- Lion: `var -= lr sign(m beta1 + g (1 - beta1))`, then `m = m beta2 + g (1 - beta2)`.

Adam with a sparse gradient (an embedding's) decays its slots whole, adds the gradient's
rows with `ResourceScatterAdd`, and then takes the same dense step, in both.

Keras's decoupled weight decay (AdamW, or any Keras optimizer given `weight_decay`) writes the
weight once more before its update: `var -= var * wd * lr`. That write is read as part of the
update (`Update.decay_write`, its factors `Update.decay`), so the weight is not refused as
written twice.

All forms are read here into one `Update`: the op writing the variable, its slots by role and
the tensors a rewrite of the update needs. Shapes of the arithmetic are not checked: a variable
whose update does not match exactly is not an `Update`, and stays as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..core.graph import Graph
from ..core.tensor_ref import TensorRef
from .loops import constant_value

__all__ = ["ADAM", "MOMENTUM", "RMSPROP", "ADAGRAD", "ADAGRAD_V2", "SGD", "APPLY_OPS",
           "SLOT_ROLES", "DECOMPOSED_WRITES", "Update", "tf1_update", "keras_update",
           "weight_decay", "takes_sgd_momentum", "slots_of", "updates", "MOVING_AVERAGE",
           "moving_average"]

# Fused update ops, with the input position of each operand.
ADAM = {"var": 0, "m": 1, "v": 2, "beta1_power": 3, "beta2_power": 4, "lr": 5, "beta1": 6,
        "beta2": 7, "epsilon": 8, "grad": 9}
MOMENTUM = {"var": 0, "accum": 1, "lr": 2, "grad": 3, "momentum": 4}
RMSPROP = {"var": 0, "ms": 1, "mom": 2, "lr": 3, "rho": 4, "momentum": 5, "epsilon": 6, "grad": 7}
ADAGRAD = {"var": 0, "accum": 1, "lr": 2, "grad": 3}
ADAGRAD_V2 = {"var": 0, "accum": 1, "lr": 2, "epsilon": 3, "grad": 4}
SGD = {"var": 0, "lr": 1, "grad": 2}
APPLY_OPS = {"ResourceApplyAdam": ADAM, "ApplyAdam": ADAM,
             "ResourceApplyMomentum": MOMENTUM, "ApplyMomentum": MOMENTUM,
             "ResourceApplyKerasMomentum": MOMENTUM,  # Keras's legacy SGD in graph mode
             "ResourceApplyRMSProp": RMSPROP, "ApplyRMSProp": RMSPROP,
             "ResourceApplyAdagrad": ADAGRAD, "ApplyAdagrad": ADAGRAD,
             "ResourceApplyAdagradV2": ADAGRAD_V2, "ApplyAdagradV2": ADAGRAD_V2,
             "ResourceApplyGradientDescent": SGD, "ApplyGradientDescent": SGD}
SLOT_ROLES = ("m", "v", "accum", "ms", "mom")
DECOMPOSED_WRITES = ("AssignAddVariableOp", "AssignSubVariableOp")


@dataclass
class Update:
    """One variable's optimizer update. `node` writes the variable; `kind` is adam, momentum,
    rmsprop, adagrad, lion or sgd; `form` tf1 (a fused op), keras (decomposed) or
    sparse (decomposed, a sparse gradient: `grad_values` and `grad_indices` are its rows,
    `grad` too); `slots` maps m, v, accum, ms or mom to the slot variable; `terms` maps
    operand names to tensors: for tf1 the fused op's inputs, for keras grad, lr, momentum,
    decay1 (1 - beta1), decay2, epsilon, rate_keep (alpha), rate_drop (alpha without the first
    moment's bias correction), m_new / v_new, the slots read after Keras's own writes of
    them, and `increment`, what Keras adds to the variable; `slot_writes` are those writes.
    `decay_write` is a decoupled weight decay's write before the update,
    `var -= var * decay[0] * decay[1] ...`. Adagrad keeps its sum of squares in `accum`.
    `nesterov`: momentum's Nesterov form; `negated`: a fused op keeping momentum as Keras
    does, `accum = momentum accum - lr g; var += accum`."""

    node: str
    var: str
    kind: str
    form: str
    slots: dict = field(default_factory=dict)
    terms: dict = field(default_factory=dict)
    slot_writes: dict = field(default_factory=dict)
    decay_write: str | None = None
    decay: list = field(default_factory=list)
    nesterov: bool = False
    negated: bool = False


def tf1_update(graph: Graph, apply: str) -> Update | None:
    positions = APPLY_OPS.get(graph.op(apply))
    inputs = graph.data_inputs(apply)
    if positions is None or len(inputs) != len(positions):
        return None
    terms = {k: inputs[i] for k, i in positions.items()}
    kind = next(k for k, table in (("adam", ADAM), ("momentum", MOMENTUM),
                                   ("rmsprop", RMSPROP), ("adagrad", ADAGRAD),
                                   ("adagrad", ADAGRAD_V2), ("sgd", SGD)) if positions is table)
    attr = graph.node_def(apply).attr
    if "update_slots" in attr and not attr["update_slots"].b:  # an Adagrad that keeps its sum
        return None
    return Update(apply, terms["var"].node, kind, "tf1",
                  {k: terms[k].node for k in SLOT_ROLES if k in terms}, terms,
                  nesterov="use_nesterov" in attr and attr["use_nesterov"].b,
                  negated=graph.op(apply) == "ResourceApplyKerasMomentum")


def _inputs(graph: Graph, ref: TensorRef, *ops) -> list[TensorRef] | None:
    """The data inputs of the node behind `ref` when its op is one of `ops`."""
    if ref is None or ref.port < 0 or graph.op(ref.node) not in ops:
        return None
    return graph.data_inputs(ref.node)


def _split(graph: Graph, ref: TensorRef, ops, wanted) -> tuple | None:
    """For a commutative binary op (one of `ops`) at `ref`: (its input whose op is in `wanted`,
    the other input)."""
    inputs = _inputs(graph, ref, *ops)
    if not inputs or len(inputs) != 2:
        return None
    a, b = inputs
    if graph.op(a.node) in wanted:
        return a, b
    if graph.op(b.node) in wanted:
        return b, a
    return None


def _read_variable(graph: Graph, ref: TensorRef) -> str | None:
    """The variable (handle) a ReadVariableOp at `ref` reads."""
    inputs = _inputs(graph, ref, "ReadVariableOp")
    return inputs[0].node if inputs else None


def _writer(graph: Graph, var: str, *ops) -> str | None:
    """The one op among `ops` that writes `var` (handle input 0); None if none or several."""
    found = [u for u, slot in graph.consumers(TensorRef(var))
             if slot == 0 and graph.op(u) in ops]
    return found[0] if len(found) == 1 else None


def _slot_update(graph: Graph, slot: str) -> tuple | None:
    """Keras's `slot += (value - slot) * decay`: (write, value, decay) when `slot` is written
    that way."""
    write = _writer(graph, slot, "AssignAddVariableOp")
    if write is None:
        return None
    found = _split(graph, graph.data_inputs(write)[1], ("Mul",), ("Sub",))
    if found is None:
        return None
    difference, decay = found
    operands = graph.data_inputs(difference.node)
    if len(operands) != 2 or _read_variable(graph, operands[1]) != slot:
        return None
    return write, operands[0], decay


def keras_update(graph: Graph, write: str) -> Update | str:
    """The Keras update that `write` (an Assign{Add,Sub}VariableOp of a variable) ends, with
    its weight decay if it has one, or why it is not one this module reads."""
    update = _keras_update(graph, write)
    if isinstance(update, Update):
        found = weight_decay(graph, update.var, write)
        if found is not None:
            update.decay_write, update.decay = found
    return update


def weight_decay(graph: Graph, var: str, update: str) -> tuple[str, list[TensorRef]] | None:
    """Keras's decoupled weight decay of `var` before its `update`: the write
    `var -= read(var) * f1 * f2 ...` that `update` waits for, as (the write, [f1, f2, ...])."""
    writes = [u for u, slot in graph.consumers(TensorRef(var))
              if slot == 0 and u != update and graph.op(u) in (*DECOMPOSED_WRITES, *APPLY_OPS)]
    if len(writes) != 1 or graph.op(writes[0]) != "AssignSubVariableOp":
        return None
    decay = writes[0]
    value = (graph.data_inputs(decay) + [None])[1]
    factors, todo, reads = [], [value], 0
    while todo:
        ref = todo.pop()
        if ref is not None and graph.op(ref.node) == "Mul" and ref.port == 0:
            todo.extend(reversed(graph.data_inputs(ref.node)))
        elif _read_variable(graph, ref) == var:
            reads += 1
        else:
            factors.append(ref)
    if reads != 1 or not factors or None in factors or decay not in graph.control_inputs(update):
        return None
    return decay, factors


def _keras_update(graph: Graph, write: str) -> Update | str:
    op = graph.op(write)
    var, delta = (graph.data_inputs(write) + [None, None])[:2]
    if delta is None:
        return f"{op} without a value"
    var = var.node
    if op == "AssignSubVariableOp" and _moving_average(graph, var, delta):
        return MOVING_AVERAGE
    if op == "AssignSubVariableOp":
        return (_keras_adagrad(graph, write, var, delta) or _keras_lion(graph, write, var, delta)
                or _keras_adam(graph, write, var, delta))
    if op == "AssignAddVariableOp":
        found = _keras_rmsprop(graph, write, var, delta)
        if found is not None:
            return found
        found = _keras_momentum(graph, write, var, delta)
        if found is not None:
            return found
        found = _split(graph, delta, ("Mul",), ("Neg",))
        if found is not None:
            grad = graph.data_inputs(found[0].node)[0]
            if _read_variable(graph, grad) is None:  # not `m += -m (1 - beta1)` (sparse Adam)
                return Update(write, var, "sgd", "keras", terms={"grad": grad, "lr": found[1]})
    return f"{op} of a form not read as a Keras optimizer's update (centered RMSprop, Nadam, ...)"


MOVING_AVERAGE = ("a moving average `x -= (x - value) (1 - decay)`, as of the weights' EMA or "
                  "batch-norm statistics: not an optimizer's update")


def moving_average(graph: Graph, write: str) -> bool:
    """`write` is `assign_moving_average`'s: `x -= (x - value) (1 - decay)`."""
    inputs = graph.data_inputs(write)
    return graph.op(write) == "AssignSubVariableOp" and len(inputs) == 2 \
        and _moving_average(graph, inputs[0].node, inputs[1])


def _moving_average(graph: Graph, var: str, delta: TensorRef) -> bool:
    """`(read(var) - value) * factor` at `delta`: `assign_moving_average`'s step."""
    difference = _split(graph, delta, ("Mul",), ("Sub",))
    operands = difference and graph.data_inputs(difference[0].node)
    return bool(operands) and len(operands) == 2 and _read_variable(graph, operands[0]) == var


def _keras_adam(graph: Graph, write: str, var: str, delta: TensorRef) -> Update | str:
    why = ("AssignSubVariableOp of a form not read as Keras's Adam, Adagrad or Lion update "
           "(diet reads those, SGD's and RMSprop's; not Adamax's, Nadam's or a hand-written "
           "one)")
    quotient = _inputs(graph, delta, "RealDiv")
    if not quotient:
        return why
    numerator = _split(graph, quotient[0], ("Mul",), ("ReadVariableOp",))
    denominator = _split(graph, quotient[1], ("AddV2", "Add"), ("Sqrt",))
    if numerator is None or denominator is None:
        return why
    m_new, alpha = numerator
    sqrt, epsilon = denominator
    v_new = graph.data_inputs(sqrt.node)[0]
    m, v = _read_variable(graph, m_new), _read_variable(graph, v_new)
    corrected = _inputs(graph, alpha, "RealDiv")
    if m is None or v is None or m == v or not corrected:
        return why
    terms = {"epsilon": epsilon, "rate_keep": alpha, "rate_drop": corrected[0],
             "m_new": m_new, "v_new": v_new}
    rate = _keras_rate(graph, corrected[0])
    if rate is not None:
        terms["lr"] = rate
    first, second = _slot_update(graph, m), _slot_update(graph, v)
    if first is None or second is None:
        return _sparse_adam(graph, write, var, m, v, terms) or why + " (its slots' updates)"
    if _squared(graph, second[1]) != first[1]:
        return why + " (the second moment of another gradient)"
    return Update(write, var, "adam", "keras", {"m": m, "v": v}, {
        **terms, "grad": first[1], "decay1": first[2], "decay2": second[2]},
        {"m": first[0], "v": second[0]})


def _keras_rate(graph: Graph, numerator: TensorRef) -> TensorRef | None:
    """The learning rate in Keras Adam's `lr * sqrt(1 - beta_2_power)`, or None."""
    if graph.op(numerator.node) != "Mul":
        return None
    rates = [f for f in graph.data_inputs(numerator.node) if graph.op(f.node) != "Sqrt"]
    return rates[0] if len(rates) == 1 else None


def _keras_adagrad(graph: Graph, write: str, var: str, delta: TensorRef) -> Update | None:
    """Keras's Adagrad: `var -= (lr g) / sqrt(acc' + epsilon)` after `acc += g * g`."""
    quotient = _inputs(graph, delta, "RealDiv")
    root = quotient and _inputs(graph, quotient[1], "Sqrt")
    shifted = root and _split(graph, root[0], ("AddV2", "Add"), ("ReadVariableOp",))
    factors = shifted and _inputs(graph, quotient[0], "Mul")
    if not factors or len(factors) != 2:
        return None
    acc_new, epsilon = shifted
    acc = _read_variable(graph, acc_new)
    acc_write = acc and _writer(graph, acc, "AssignAddVariableOp")
    grad = acc_write and _squared(graph, graph.data_inputs(acc_write)[1])
    if grad is None or grad not in factors:
        return None
    lr = factors[1] if factors[0] == grad else factors[0]
    return Update(write, var, "adagrad", "keras", {"accum": acc}, {
        "grad": grad, "lr": lr, "epsilon": epsilon, "v_new": acc_new}, {"accum": acc_write})


def _keras_rmsprop(graph: Graph, write: str, var: str, delta: TensorRef) -> Update | None:
    """Keras's RMSprop: `var += -increment`, or with momentum `var += -mom'` after
    `mom = momentum mom + increment` (written whole, `AssignVariableOp`)."""
    negated = _inputs(graph, delta, "Neg")
    if not negated:
        return None
    mom = _read_variable(graph, negated[0])
    if mom is None:
        return _rms_increment(graph, write, var, negated[0])
    mom_write = _writer(graph, mom, "AssignVariableOp")
    total = mom_write and _inputs(graph, graph.data_inputs(mom_write)[1], "AddV2", "Add")
    if not total or len(total) != 2:
        return None
    for kept, increment in (total, total[::-1]):
        found = _split(graph, kept, ("Mul",), ("ReadVariableOp",))
        if found and _read_variable(graph, found[0]) == mom:
            update = _rms_increment(graph, write, var, increment)
            if update is not None:
                update.slots["mom"], update.slot_writes["mom"] = mom, mom_write
                update.terms["momentum"] = found[1]
            return update
    return None


def _rms_increment(graph: Graph, write: str, var: str, increment: TensorRef) -> Update | None:
    """RMSprop's `increment = (lr g) rsqrt(v' + epsilon)` after `v = rho v + (1 - rho) g^2`
    (Keras writes the slot whole, `AssignVariableOp`), as the update `write` ends."""
    product = _split(graph, increment, ("Mul",), ("Rsqrt",))
    if not product:
        return None
    root, scaled = product
    shifted = _split(graph, graph.data_inputs(root.node)[0], ("AddV2", "Add"),
                     ("ReadVariableOp",))
    factors = _inputs(graph, scaled, "Mul")
    if shifted is None or not factors or len(factors) != 2:
        return None
    v_new, epsilon = shifted
    v = _read_variable(graph, v_new)
    # its update among its writes (in a TF1 graph its initializer writes it too)
    found = [(u, *found) for u, slot in (graph.consumers(TensorRef(v)) if v else [])
             if slot == 0 and graph.op(u) == "AssignVariableOp"
             and (found := _rms_average(graph, v, graph.data_inputs(u)[1]))]
    if len(found) != 1:
        return None
    v_write, grad, rho, decay = found[0]
    if grad not in factors:
        return None
    lr = factors[1] if factors[0] == grad else factors[0]
    return Update(write, var, "rmsprop", "keras", {"ms": v}, {
        "grad": grad, "lr": lr, "rho": rho, "decay": decay, "epsilon": epsilon,
        "v_new": v_new}, {"ms": v_write})


def _rms_average(graph: Graph, v: str, value: TensorRef) -> tuple | None:
    """`rho read(v) + decay g^2` at `value`: (g, rho, decay)."""
    total = _inputs(graph, value, "AddV2", "Add")
    if not total or len(total) != 2:
        return None
    kept = next((k for ref in total if (k := _split(graph, ref, ("Mul",), ("ReadVariableOp",)))),
                None)
    taken = next((t for ref in total if (t := _split(graph, ref, ("Mul",), ("Square",)))), None)
    if kept is None or taken is None or _read_variable(graph, kept[0]) != v:
        return None
    return graph.data_inputs(taken[0].node)[0], kept[1], taken[1]


def _squared(graph: Graph, ref: TensorRef) -> TensorRef | None:
    """x for Square(x) or x * x at `ref`."""
    inputs = _inputs(graph, ref, "Square", "Mul")
    if inputs and (graph.op(ref.node) == "Square" or (len(inputs) == 2
                                                      and inputs[0] == inputs[1])):
        return inputs[0]
    return None


def _scatter(graph: Graph, slot: str) -> tuple | None:
    """A sparse update's `slot[indices] += x * decay`: (indices, x, decay)."""
    scatter = _writer(graph, slot, "ResourceScatterAdd")
    if scatter is None:
        return None
    _, indices, scaled = graph.data_inputs(scatter)[:3]
    found = _inputs(graph, scaled, "Mul")
    if not found or len(found) != 2:
        return None
    for x, decay in (found, found[::-1]):
        if _constant(graph, decay):
            return indices, x, decay
    return None


def _constant(graph: Graph, ref: TensorRef) -> bool:
    """A Const, or arithmetic on Consts (tf.compat.v1's `1 - beta2`)."""
    if graph.op(ref.node) == "Const":
        return True
    inputs = _inputs(graph, ref, "Sub", "Mul", "AddV2", "Add", "Cast")
    return bool(inputs) and all(graph.op(r.node) == "Const" for r in inputs)


def _sparse_adam(graph: Graph, write: str, var: str, m: str, v: str,
                 terms: dict) -> Update | None:
    """Adam's update of a variable with a sparse gradient (an embedding): the slots decay
    whole and take the gradient's rows by `ResourceScatterAdd`, then the variable takes the
    dense Adam step (tf.compat.v1's and Keras's alike). `grad_values` and `grad_indices` are
    the gradient's rows and their indices, summed per index where they repeat."""
    first, second = _scatter(graph, m), _scatter(graph, v)
    if first is None or second is None or first[0] != second[0]:
        return None
    if _squared(graph, second[1]) != first[1]:
        return None
    return Update(write, var, "adam", "sparse", {"m": m, "v": v}, {
        **terms, "grad": first[1], "grad_values": first[1], "grad_indices": first[0],
        "decay1": first[2], "decay2": second[2]})


def _momentum_terms(graph: Graph, value: TensorRef) -> tuple | None:
    """`-g lr + read(m) momentum` at `value`: (g, lr, m, momentum)."""
    total = _inputs(graph, value, "AddV2", "Add")
    if not total or len(total) != 2:
        return None
    step = kept = None
    for ref in total:
        step = _split(graph, ref, ("Mul",), ("Neg",)) or step
        found = _split(graph, ref, ("Mul",), ("ReadVariableOp",))
        if found is not None and _read_variable(graph, found[0]) is not None:
            kept = found
    if step is None or kept is None:
        return None
    return graph.data_inputs(step[0].node)[0], step[1], _read_variable(graph, kept[0]), kept[1]


def _interpolation(graph: Graph, value: TensorRef) -> tuple | None:
    """`read(slot) keep + x take` at `value`: (slot, keep, x, take)."""
    total = _inputs(graph, value, "AddV2", "Add")
    if not total or len(total) != 2:
        return None
    for kept, taken in (total, total[::-1]):
        old = _split(graph, kept, ("Mul",), ("ReadVariableOp",))
        new = _inputs(graph, taken, "Mul")
        if old is None or not new or len(new) != 2 or _read_variable(graph, old[0]) is None:
            continue
        x, take = new if _constant(graph, new[1]) else new[::-1]
        if _constant(graph, take) and not _constant(graph, x):
            return _read_variable(graph, old[0]), old[1], x, take
    return None


def _keras_lion(graph: Graph, write: str, var: str, delta: TensorRef) -> Update | None:
    """Keras's Lion: `var -= lr sign(m beta1 + g (1 - beta1))`, then `m = m beta2 + g (1 -
    beta2)`, written whole (in a TF1 graph its initializer writes m too)."""
    signed = _split(graph, delta, ("Mul",), ("Sign",))
    mixed = signed and _interpolation(graph, graph.data_inputs(signed[0].node)[0])
    if not mixed:
        return None
    m, beta1, grad, decay1 = mixed
    own = [(u, *terms) for u, slot in graph.consumers(TensorRef(m))
           if slot == 0 and graph.op(u) == "AssignVariableOp"
           and (terms := _interpolation(graph, graph.data_inputs(u)[1]))
           and terms[0] == m and terms[2] == grad]
    if len(own) != 1:
        return None
    m_write, _, beta2, _, decay2 = own[0]
    return Update(write, var, "lion", "keras", {"m": m}, {
        "grad": grad, "lr": signed[1], "beta1": beta1, "decay1": decay1, "beta2": beta2,
        "decay2": decay2, "increment": delta}, {"m": m_write})


def _same(graph: Graph, a: TensorRef, b: TensorRef) -> bool:
    """The same tensor, or reads of the same variable (Keras reads the rate once per use)."""
    return a == b or (_read_variable(graph, a) or a) == (_read_variable(graph, b) or b)


def _keras_momentum(graph: Graph, write: str, var: str, delta: TensorRef) -> Update | None:
    """Keras's SGD with momentum: `m = -g lr + m momentum` (written whole), then `var += m'`,
    or with Nesterov's `var += -g lr + m' momentum`."""
    slot, nesterov = _read_variable(graph, delta), None
    if slot is None:
        nesterov = _momentum_terms(graph, delta)
        slot = nesterov and nesterov[2]
    slot_write = slot and _writer(graph, slot, "AssignVariableOp")
    own = slot_write and _momentum_terms(graph, graph.data_inputs(slot_write)[1])
    if not own or own[2] != slot or (nesterov and not all(
            _same(graph, a, b) for a, b in zip(nesterov, own))):
        return None
    grad, lr, _, momentum = own
    return Update(write, var, "momentum", "keras", {"accum": slot}, {
        "grad": grad, "lr": lr, "momentum": momentum, "increment": delta},
        {"accum": slot_write}, nesterov=nesterov is not None)


def takes_sgd_momentum(graph: Graph, update: Update) -> bool:
    """Whether `update` keeps an SGD momentum: Momentum's or RMSProp's, other than a constant
    0 (whose slot stays 0: Keras's SGD without momentum keeps one)."""
    if update.kind not in ("momentum", "rmsprop") or (update.kind == "rmsprop"
                                                      and "mom" not in update.slots):
        return False
    value = constant_value(graph, None, update.terms["momentum"])
    return value is None or float(value) != 0.0


def slots_of(found: list[Update]) -> set[str]:
    """The optimizer slots `found` updates keep (a Keras slot's own write, read as an update of
    its own, is one of them: not a weight)."""
    return {slot for update in found for slot in update.slots.values()}


def updates(graph: Graph) -> list[Update]:
    """Every update this module reads, of either form."""
    found = []
    for name in graph.nodes():
        op = graph.op(name)
        if op in APPLY_OPS:
            update = tf1_update(graph, name)
        elif op in DECOMPOSED_WRITES:
            update = keras_update(graph, name)
        else:
            continue
        if isinstance(update, Update):
            found.append(update)
    return found
