"""Forward/backward split: exact sets on fixtures whose gradient ops carry their scope's name."""

import networkx as nx
import tensorflow as tf

from graphrewrite.analysis.split import split
from graphrewrite.core import io
from graphrewrite.core.graph import Graph

from conftest import fixture_path
from tfgraphs import build, const, placeholder


def named_backward(graph, prefix):
    return {n for n in graph.nodes() if n.startswith(prefix)}


def test_tf1_gradients_scope_is_found_by_reachability():
    graph = io.load(fixture_path("mlp")).graph
    result = split(graph)
    assert result.seeds == ("gradients/grad_ys_0",)
    expected = named_backward(graph, "gradients/") | named_backward(graph, "outputs/grad_")
    # The cross-entropy's unused Shape node is dead code: nothing forward needs it.
    assert result.backward == expected | {"SparseSoftmaxCrossEntropyWithLogits/Shape"}
    assert result.forward == set(graph.nodes()) - result.backward
    assert "outputs/loss" in result.forward and "outputs/loss" in result.losses


def test_tf2_gradient_tape_with_a_seed_outside_its_scope():
    graph = io.load(fixture_path("tape_tf2")).graph
    result = split(graph)
    assert result.seeds == ("ones",)  # GradientTape's seed has no gradient_tape/ prefix
    tape_outputs = {"Identity_1", "Identity_2", "Identity_3", "Identity_4"}  # the gradients
    assert result.backward == (named_backward(graph, "gradient_tape/") | {"ones"} | tape_outputs
                               | named_backward(graph, "outputs/grad_"))
    assert "Identity" in result.forward  # the loss


def test_early_backward_nodes_read_only_forward_values():
    graph = io.load(fixture_path("transformer_dropout")).graph
    result = split(graph)
    early = result.early_backward
    assert early and early <= named_backward(graph, "gradients/")
    # e.g. the shape computations of broadcasting gradients
    assert any(n.endswith("Shape") or "/Shape_" in n for n in early)
    assert not early & result.gradient_flow


def test_functional_while_gradient_is_found_inside_the_library():
    graph = io.load(fixture_path("rnn_while_v2")).graph
    result = split(graph)
    assert result.seeds == ("gradients/grad_ys_0",)
    grad_loop = next(n for n in graph.nodes() if graph.op(n) == "StatelessWhile"
                     and n.startswith("gradients/"))
    assert grad_loop in result.gradient_flow


def test_forward_constant_of_ones_is_not_a_seed():
    # A layer-norm-like scale of ones right before the loss must not be taken for the seed.
    def graph():
        x = placeholder()
        w = const("w", (256,), 0.3)
        h = tf.nn.relu(x * w, name="h")
        out = tf.multiply(h, const("gamma", (256,), 1.0), name="scaled")
        loss = tf.reduce_sum(out * out, name="loss")
        tf.compat.v1.gradients(loss, [w])
    result = split(build(graph))
    assert result.seeds == ("gradients/grad_ys_0",)
    assert "gamma" in result.forward


def test_graph_without_gradients_is_all_forward():
    graph = io.load(fixture_path("tiny_savedmodel")).graph
    result = split(graph)
    assert result.seeds == () and not result.gradient_flow


def test_backward_scope_override():
    graph = io.load(fixture_path("mlp")).graph
    result = split(graph, backward_scope="gradients/dense_5")
    assert all(n.startswith("gradients/dense_5") for n in result.seeds)
    assert "gradients/dense_4/Relu_grad/ReluGrad" in result.gradient_flow
    assert "gradients/logits/MatMul_grad/MatMul" not in result.gradient_flow


def tf2_step(model, opt, x_shape) -> Graph:
    """A TF2 training step over `model` with `opt`, exported with its shapes."""
    @tf.function(input_signature=[tf.TensorSpec(x_shape, tf.float32, name="x"),
                                  tf.TensorSpec(x_shape[:1], tf.int32, name="y")])
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
                y, model(x, training=True), from_logits=True))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables))
        return loss

    return Graph.from_graph_def(step.get_concrete_function().graph.as_graph_def(add_shapes=True))


def test_a_tf2_gelu_step_is_split_at_the_tapes_seed():
    """GELU's `1 + erf` constant is a ones tensor that reaches every gradient too; and every
    node reaches the step's returned Identity by its control edges. By data edges the tape's
    seed is the only candidate reaching no more sinks than another."""
    model = tf.keras.Sequential([tf.keras.layers.Dense(32, activation="gelu")
                                 for _ in range(3)] + [tf.keras.layers.Dense(4)])
    model.build((None, 16))
    opt = tf.keras.optimizers.SGD(0.1, momentum=0.9)
    opt.build(model.trainable_variables)

    graph = tf2_step(model, opt, [8, 16])
    found = split(graph)
    assert [graph.op(s) for s in found.seeds] in (["Const"], ["Fill"], ["OnesLike"])
    assert not any("Gelu" in s for s in found.seeds)
    matmuls = [n for n in graph.nodes() if graph.op(n) == "MatMul" and "gradient" not in n]
    assert len(matmuls) == 4 and all(n in found.forward for n in matmuls)


def test_a_static_scalar_loss_is_found_although_its_seed_copies_no_shape():
    """`tf.gradients` of a scalar of static shape seeds `Fill(Const([]), 1)`: no edge leads
    from the seed to the loss. The loss is the sink that depends on the most activations the
    gradient flow reads; a metric on the logits, a side branch and an initialiser do not."""
    def graph():
        x = placeholder(shape=(8, 64))
        w = tf.Variable(tf.ones([64, 10]), name="w")
        logits = tf.nn.relu(tf.matmul(x, w), name="logits")
        tf.reduce_max(logits, name="metric")
        tf.reduce_mean(x, name="side")
        loss = tf.reduce_mean(tf.square(logits - 1.0), name="loss")
        tf.compat.v1.gradients(loss, [w])
        tf.compat.v1.global_variables_initializer()
    graph = build(graph)
    assert graph.op("gradients/Shape") == "Const"  # the seed copies no shape from the loss
    assert split(graph).differentiated == ("loss",)


def test_a_train_op_collection_alone_fetches_the_loss_too(tmp_path):
    """Minimize puts its op in `train_op`; the loss, in no collection, is fetched beside it
    (found from the graph) so that `verify` compares it."""
    from graphrewrite.analysis.step import default_fetches

    with tf.Graph().as_default() as g:
        x = placeholder(shape=(8, 64))
        w = tf.compat.v1.get_variable("w", [64, 10])
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w)), name="loss")
        tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
        meta = tf.compat.v1.train.export_meta_graph(graph=g)
    assert "losses" not in meta.collection_def
    path = tmp_path / "train.meta"
    path.write_bytes(meta.SerializeToString())
    assert default_fetches(io.load(path)) == ["train", "loss"]


def test_a_custom_gradients_constants_of_ones_are_not_seeds():
    """Keras swish's gradient `1 + x * (1 - sigmoid(x))` holds constants of ones that reach the
    gradient ops below it, as the tape's seed reaches them all; the seed was dropped for them
    (an EfficientNet step planned on a backward pass starting midway: 0.93x instead of 0.45x)."""
    model = tf.keras.Sequential([tf.keras.layers.Conv2D(8, 3, activation="swish"),
                                 tf.keras.layers.BatchNormalization(),
                                 tf.keras.layers.Conv2D(8, 3, activation="swish"),
                                 tf.keras.layers.GlobalAveragePooling2D(),
                                 tf.keras.layers.Dense(4)])
    model.build((None, 16, 16, 3))
    opt = tf.keras.optimizers.SGD(0.1)

    graph = tf2_step(model, opt, [4, 16, 16, 3])
    found = split(graph)
    assert len(found.seeds) == 1 and graph.op(found.seeds[0]) in ("Const", "Fill", "OnesLike")
    convolutions = [n for n in graph.nodes() if graph.op(n) == "Conv2D"]
    assert len(convolutions) == 2 and all(n in found.forward for n in convolutions)


def test_a_regularized_total_loss_keeps_one_seed_and_is_the_loss():
    """An estimator's loss: `tf.compat.v1.losses`' cross-entropy plus the L2 regularization
    loss. The cross-entropy's constants of ones reach every update (through the backward pass's
    reads of the mean's divisor) and the total loss; the seed reaches the regularization
    term's dead gradients instead: over all sinks neither reached strictly fewer, and the
    constants were kept as seeds (the moving averages' updates then taken for the loss)."""
    def model():
        x = placeholder("x", (8, 16))
        labels = tf.compat.v1.placeholder(tf.int32, (8,), name="labels")
        l2 = tf.keras.regularizers.l2(1e-4)
        h = tf.compat.v1.layers.dense(x, 32, tf.nn.relu, kernel_regularizer=l2)
        logits = tf.compat.v1.layers.dense(h, 4, kernel_regularizer=l2)
        loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
        total = tf.add(loss, tf.compat.v1.losses.get_regularization_loss(), name="total")
        tf.compat.v1.train.AdamOptimizer(0.1).minimize(total)

    graph = build(model)
    found = split(graph)
    assert found.seeds == ("gradients/grad_ys_0",) and found.differentiated == ("total",)
    assert {"total", "sparse_softmax_cross_entropy_loss/value"} <= found.forward


def test_a_keras_loss_objects_sample_weight_is_not_a_seed():
    """A TF2 step whose loss is a Keras loss object's (its sample weight a constant 1.0 that
    the forward product and its gradient read) plus a second term on another model output (a
    recurrent state, in the graph found outside the repo): the second term's dead gradients
    reach sinks the weight does not, so it was kept as a seed and the forward pass was empty."""
    inputs = tf.keras.Input((16,))
    hidden = tf.keras.layers.Dense(32, activation="tanh")(inputs)
    model = tf.keras.Model(inputs, [tf.keras.layers.Dense(4)(hidden), hidden])
    opt = tf.keras.optimizers.RMSprop(1e-3)
    opt.build(model.trainable_variables)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function(input_signature=[tf.TensorSpec([8, 16], tf.float32, name="x"),
                                  tf.TensorSpec([8], tf.int32, name="y")])
    def step(x, y):
        with tf.GradientTape() as tape:
            logits, state = model(x, training=True)
            loss = loss_fn(y, logits) + 1e-3 * tf.reduce_mean(tf.square(state))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables))
        return loss

    graph = Graph.from_graph_def(step.get_concrete_function().graph.as_graph_def())
    found = split(graph)
    assert len(found.seeds) == 1 and "weighted_loss" not in found.seeds[0], found.seeds
    matmuls = [n for n in graph.nodes() if graph.op(n) == "MatMul" and "gradient" not in n]
    assert len(matmuls) == 2 and all(n in found.forward for n in matmuls)


def test_a_collected_loss_that_is_not_minimised_is_fetched_with_the_minimised_one(tmp_path):
    """An estimator collects the cross-entropy in `losses` but minimises it plus the
    regularization: `verify` must compare the loss the optimizer minimises too; a minimised loss
    that only renames a collected one (an `Identity`) is not fetched twice."""
    from graphrewrite.analysis.step import default_fetches

    def export(name, regularized):
        with tf.Graph().as_default() as g:
            x = placeholder("x", (8, 16))
            labels = tf.compat.v1.placeholder(tf.int32, (8,), name="labels")
            l2 = tf.keras.regularizers.l2(1e-4) if regularized else None
            logits = tf.compat.v1.layers.dense(x, 4, kernel_regularizer=l2)
            loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
            extra = tf.compat.v1.losses.get_regularization_loss() if regularized else 0.0
            total = (tf.add(loss, extra, name="total") if regularized
                     else tf.identity(loss, name="total"))
            train = tf.compat.v1.train.AdamOptimizer(0.1).minimize(total)
            tf.compat.v1.add_to_collection("train_op", train)
            meta = tf.compat.v1.train.export_meta_graph(graph=g)
        path = tmp_path / name
        path.write_bytes(meta.SerializeToString())
        return default_fetches(io.load(path))

    assert export("estimator.meta", True)[1:] == ["sparse_softmax_cross_entropy_loss/value",
                                                  "total"]
    assert export("renamed.meta", False)[1:] == ["sparse_softmax_cross_entropy_loss/value"]


def test_values_the_backward_pass_computes_and_nothing_reads_are_not_fetched(tmp_path):
    """A TF1 graph with no collections whose updates no op groups (a Keras optimizer's
    `apply_gradients` in graph mode): the sinks are the updates, the loss and the gradient of
    the GELU's constant divisor, which nothing reads and no session runs (a ConvNeXt's verify
    compared it, and Grappler's regrouping made it differ by 6e-14)."""
    from graphrewrite.analysis.step import default_fetches, sinks

    with tf.Graph().as_default() as g:
        x = placeholder(shape=(8, 16))
        w = tf.compat.v1.get_variable("w", [16, 4], use_resource=True)
        h = tf.matmul(x, w)
        loss = tf.reduce_mean(0.5 * h * (1.0 + tf.math.erf(h / tf.sqrt(2.0))), name="loss")
        grad, = tf.gradients(loss, [w])
        w.assign_sub(0.1 * grad, name="update")
        meta = tf.compat.v1.train.export_meta_graph(graph=g)
    path = tmp_path / "dropped.meta"
    path.write_bytes(meta.SerializeToString())
    model = io.load(path)
    dead = [n for n in sinks(model.graph) if n.startswith("gradients/") and
            model.graph.op(n) != "NoOp"]
    assert dead  # the divisor's gradient: computed, read by nothing
    fetched = default_fetches(model)
    assert "loss" in fetched and not set(dead) & set(fetched), fetched
    update = next(n for n in model.graph.nodes() if model.graph.op(n) == "AssignSubVariableOp")
    assert any(nx.has_path(model.graph.nx, update, n) for n in fetched), fetched  # its read


def test_a_gradient_tuples_unread_identities_are_not_fetched(tmp_path):
    """`minimize` (GATE_OP) passes each op's gradients through a `tuple`: an identity of each,
    waiting on a group of both. A session's `graph_def` written out has no collections, and
    the identities of the gradients no update reads (a fed input's, a dropout mask's) are
    sinks; they wait for gradients, not for a write, and are not fetched (a deep MLP's listed
    34 beside its train op and loss)."""
    from graphrewrite.analysis.step import default_fetches, sinks

    with tf.Graph().as_default() as g:
        x = placeholder(shape=(8, 16))
        w = tf.compat.v1.get_variable("w", [16, 4], use_resource=True)
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w)), name="loss")
        tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    path = tmp_path / "step.pb"
    path.write_bytes(g.as_graph_def().SerializeToString())
    model = io.load(path)
    unread = [n for n in sinks(model.graph) if n.endswith("tuple/control_dependency")]
    assert unread  # x's gradient, through the MatMul's tuple
    assert default_fetches(model) == ["loss", "train"]


def test_a_loss_grouped_with_the_updates_is_the_loss_and_fetched(tmp_path):
    """Keras's TF1 train function runs `group_deps`, a NoOp waiting by control edges on the
    loss (the weighted sum of two heads' losses) and the updates: the loss is no sink, and a
    metric's sum of one head's loss, written to its total, was taken for it (and verify's
    `--steps` compared a gradient)."""
    from graphrewrite.analysis.step import default_fetches

    with tf.Graph().as_default() as g:
        x = placeholder(shape=(8, 16))
        w = tf.compat.v1.get_variable("w", [16, 2], use_resource=True)
        h = tf.matmul(x, w)
        first, second = tf.reduce_mean(tf.square(h[:, 0])), tf.reduce_mean(tf.abs(h[:, 1]))
        total = tf.compat.v1.get_variable("total", [], trainable=False, use_resource=True)
        metric = total.assign_add(tf.reduce_sum(second), read_value=False)
        loss = tf.add_n([first, 0.5 * second], name="loss")
        train = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
        tf.group(loss, train, metric, name="group_deps")
        meta = tf.compat.v1.train.export_meta_graph(graph=g)
    path = tmp_path / "grouped.meta"
    path.write_bytes(meta.SerializeToString())
    model = io.load(path)
    assert split(model.graph).differentiated == ("loss",)
    assert default_fetches(model) == ["group_deps", "loss"]


class _Recomputed(tf.keras.layers.Layer):
    """Two dense layers called under `tf.recompute_grad` (gradient checkpointing by hand)."""

    def __init__(self):
        super().__init__()
        self.inner = [tf.keras.layers.Dense(16, activation="relu") for _ in range(2)]

    def call(self, x):
        def f(h):
            for layer in self.inner:
                h = layer(h)
            return h
        return tf.recompute_grad(f)(x)


def test_a_backward_pass_that_recomputes_its_forward_values_starts_at_the_tapes_seed():
    """`tf.recompute_grad` runs the block again in the backward pass, after the incoming
    gradient (its input plus a SelectV2 of that gradient): the seed is upstream of forward
    values the gradient ops read, which ruled out every candidate ("no backward pass")."""
    model = tf.keras.Sequential([tf.keras.layers.Dense(16), _Recomputed(), _Recomputed(),
                                 tf.keras.layers.Dense(4)])
    model.build((None, 8))
    opt = tf.keras.optimizers.SGD(0.1)

    graph = tf2_step(model, opt, [4, 8])
    found = split(graph)
    assert len(found.seeds) == 1 and graph.op(found.seeds[0]) in ("Const", "Fill", "OnesLike")
    matmuls = {n for n in graph.nodes() if graph.op(n) == "MatMul"}
    from_seed = nx.descendants(graph.nx, found.seeds[0])
    recomputed = {n for n in matmuls & from_seed
                  if any(graph.op(a) == "SelectV2" for a in nx.ancestors(graph.nx, n))}
    assert len(recomputed) >= 4  # each block's two layers again, besides their gradients
    assert matmuls & found.forward == matmuls - from_seed and len(matmuls - from_seed) == 6


def _gan(losses, optimizer):
    """A generator and a critic on placeholders; `losses(critic, real, fake)` gives the
    discriminator's and the generator's loss; the generator's step is built under a control
    dependency on the discriminator's, and both are grouped as `train_op`."""
    v1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        z = v1.placeholder(tf.float32, [16, 8], name="z")
        real = v1.placeholder(tf.float32, [16, 8], name="real")
        fake = v1.layers.dense(z, 8, name="gen")
        critic = v1.layers.Dense(1, name="disc")
        d_loss, g_loss = losses(critic, real, fake)
        d_train = optimizer().minimize(d_loss, var_list=critic.trainable_variables)
        with tf.control_dependencies([d_train]):
            g_train = optimizer().minimize(g_loss, var_list=v1.trainable_variables("gen"))
        tf.group(d_train, g_train, name="train_op")
    return graph, d_loss.op.name, g_loss.op.name


def _logistic(critic, real, fake):
    """DCGAN's losses (`_gan`'s `losses`): sigmoid cross entropies against `ones_like` and
    `zeros_like` labels, the discriminator's and the generator's."""
    xent = tf.nn.sigmoid_cross_entropy_with_logits
    real_logit, fake_logit = critic(real), critic(fake)
    return (tf.reduce_mean(xent(labels=tf.ones_like(real_logit), logits=real_logit))
            + tf.reduce_mean(xent(labels=tf.zeros_like(fake_logit), logits=fake_logit)),
            tf.reduce_mean(xent(labels=tf.ones_like(fake_logit), logits=fake_logit)))


def test_a_second_optimizer_under_the_first_ones_control_dependencies():
    """A GAN's habit: the generator's step built under `control_dependencies([d_train])`, so
    its seed and every gradient op wait on the discriminator's update. That control edge does
    not make the first seed the second's ancestor: both seeds are found, both flows backward."""
    def squares(critic, real, fake):
        return (tf.reduce_mean(tf.square(critic(real) - 1.0) + tf.square(critic(fake))),
                tf.reduce_mean(tf.square(critic(fake) - 1.0)))

    graph, d_loss, g_loss = _gan(squares, lambda: tf.compat.v1.train.GradientDescentOptimizer(0.1))
    imported = Graph.from_graph_def(graph.as_graph_def())
    result = split(imported)
    assert result.seeds == ("gradients/grad_ys_0", "gradients_1/grad_ys_0")
    assert result.differentiated == tuple(sorted((d_loss, g_loss)))
    assert named_backward(imported, "gradients/") <= result.backward
    assert named_backward(imported, "gradients_1/") <= result.backward


def test_a_logistic_loss_on_a_tape_keeps_the_tapes_seed():
    """A VAE's reconstruction term on a GradientTape: the logistic loss's gradient adds a
    constant one to `exp(-|x|)` and reaches every update as the seed does, but fewer dead
    gradients (with respect to the labels): it was taken for the seed."""
    model = tf.keras.Sequential([tf.keras.layers.Dense(32, activation="relu"),
                                 tf.keras.layers.Dense(16)])
    model.build((None, 16))
    opt = tf.keras.optimizers.Adam(1e-3)
    opt.build(model.trainable_variables)

    @tf.function(input_signature=[tf.TensorSpec([8, 16], tf.float32, name="x")])
    def step(x):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(
                labels=tf.sigmoid(x), logits=logits)) + 1e-3 * tf.reduce_mean(tf.square(logits))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables))
        return loss

    graph = Graph.from_graph_def(step.get_concrete_function().graph.as_graph_def())
    found = split(graph)
    assert found.seeds == ("ones",), found.seeds
    matmuls = [n for n in graph.nodes() if graph.op(n) == "MatMul" and "gradient" not in n]
    assert len(matmuls) == 2 and all(n in found.forward for n in matmuls)


def test_a_gans_logistic_losses_leave_its_labels_and_log1p_constants_out_of_the_seeds():
    """DCGAN's losses: sigmoid cross entropies against `ones_like`/`zeros_like` labels. The
    generator's labels are constant ones that reach its loss and, as a factor of its gradient
    (`grad * z`), every generator update; `Log1p`'s gradient adds a constant one to
    `exp(-|x|)`. The second seed was that constant."""
    graph, d_loss, g_loss = _gan(_logistic, lambda: tf.compat.v1.train.AdamOptimizer(1e-3))
    result = split(Graph.from_graph_def(graph.as_graph_def()))
    assert result.seeds == ("gradients/grad_ys_0", "gradients_1/grad_ys_0")
    assert result.differentiated == tuple(sorted((d_loss, g_loss)))


def test_a_sampled_softmaxs_label_constants_are_not_seeds():
    """A language model trained through `tf.nn.sampled_softmax_loss` (built outside the repo,
    TF1, no collections): its true labels' weights are constants of ones that meet the batch in
    the cross entropy, which the seed's flow reads the backprop of. They were the seeds, so the
    loss was not found and a dead gradient was fetched in its place."""
    def step():
        v1 = tf.compat.v1
        ids = v1.placeholder(tf.int32, [16, 4], name="ids")
        target = v1.placeholder(tf.int64, [16, 1], name="target")
        table = v1.get_variable("table", [500, 16])
        hidden = v1.layers.dense(tf.reshape(tf.nn.embedding_lookup(table, ids), [16, 64]), 32,
                                 activation=tf.nn.relu)
        weights = v1.get_variable("out_w", [500, 32])
        bias = v1.get_variable("out_b", [500])
        loss = tf.reduce_mean(tf.nn.sampled_softmax_loss(
            weights, bias, target, hidden, num_sampled=8, num_classes=500, seed=1), name="loss")
        v1.train.AdagradOptimizer(0.1).minimize(loss, name="train")

    found = split(build(step))
    assert found.seeds == ("gradients/grad_ys_0",), found.seeds
    assert found.differentiated == ("loss",)


def test_each_of_two_gradients_finds_its_own_loss(tmp_path):
    """A GAN's losses in no collection: the discriminator's depends on every activation the
    generator's does (through the fake images), so over both flows at once it alone covered
    the most and the generator's loss was neither modelled nor compared. Each seed's flow
    names its own."""
    from graphrewrite.analysis.step import default_fetches

    graph, d_loss, g_loss = _gan(_logistic, lambda: tf.compat.v1.train.AdamOptimizer(0.1))
    result = split(Graph.from_graph_def(graph.as_graph_def()))
    assert len(result.seeds) == 2
    assert result.differentiated == tuple(sorted((d_loss, g_loss)))
    with graph.as_default():
        (tmp_path / "gan.meta").write_bytes(
            tf.compat.v1.train.export_meta_graph().SerializeToString())
    assert sorted(default_fetches(io.load(tmp_path / "gan.meta"))) == sorted(
        ["train_op", d_loss, g_loss])


def test_what_waits_on_the_collected_train_op_is_the_step(tmp_path):
    """`minimize` collects its own op; a user who runs an ExponentialMovingAverage made under
    a control dependency on it runs the averages' group, which the step's fetches must hold
    (else neither the model nor `verify` sees the averages' update). A second optimizer built
    under that control dependency leaves dead gradient values waiting on it: not fetched."""
    from graphrewrite.analysis.step import default_fetches

    with tf.Graph().as_default() as g:
        x = placeholder(shape=(8, 64))
        w = tf.compat.v1.get_variable("w", [64, 10])
        v = tf.compat.v1.get_variable("v", [10, 10])
        h = tf.matmul(x, w)
        loss = tf.reduce_mean(tf.square(h), name="loss")
        other = tf.reduce_mean(tf.square(tf.matmul(h, v)), name="other")
        train = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(
            loss, var_list=[w], name="train")
        with tf.control_dependencies([train]):
            tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(
                other, var_list=[v], name="train_v")  # also collected; its w gradient: dead
            tf.compat.v1.train.ExponentialMovingAverage(0.9).apply([w, v])
        meta = tf.compat.v1.train.export_meta_graph(graph=g)
    path = tmp_path / "ema.meta"
    path.write_bytes(meta.SerializeToString())
    assert list(meta.collection_def["train_op"].node_list.value) == ["train", "train_v"]
    assert default_fetches(io.load(path))[:2] == ["ExponentialMovingAverage", "train_v"]
