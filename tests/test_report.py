"""The optimize report: one headline peak, the one `verify` should measure (the step as run,
after Grappler, when it was modelled), and notes that agree with what the passes did (issue 32)."""

import json

import pytest

from graphrewrite.analysis.memory import MemoryReport
from graphrewrite.core import io
from graphrewrite.passes import PASSES
from graphrewrite.passes.accumulate import AccumulateResult
from graphrewrite.passes.defer import DeferResult
from graphrewrite.passes.recompute import RecomputeResult
from graphrewrite.pipeline import run as pipeline
from graphrewrite.reporting import report

from conftest import fixture_path, run_cli

MIB = 2**20


class Step:
    """A memory report of a step as run: its allocator peak, and where it is reached (at the
    last node, `scratch` bytes of which are that kernel's, `padding` bytes the allocator's)."""

    def __init__(self, peak, scratch=0, padding=0, accelerator=False):
        self.peak, self.order, self.scratch = peak, ["a", "conv_grad"], {1: scratch}
        self.accelerator = accelerator
        self.timeline = [peak // 2, peak - scratch - padding]  # live tensors
        self.persistent_bytes, self.widest = {"device": peak // 4}, (1, peak // 4)

    def allocated_peak(self):
        return self.peak

    def allocated_timeline(self):
        return [self.peak // 2, self.peak]

    allocated_peak_at, floor = MemoryReport.allocated_peak_at, MemoryReport.floor


def result(as_run=(None, None), modified=True, written=(3 * MIB, 2 * MIB)):
    """An OptimizeResult whose defer pass changed the graph (or not) and whose recompute pass
    found nothing worth recomputing."""
    recompute = RecomputeResult(note="no checkpoint choice lowers the modelled peak by 1% or "
                                     "more: nothing recomputed")
    return pipeline.OptimizeResult(
        graph=None, mode="memory", pipeline="defer recompute(policy=memory)", nodes_before=10,
        nodes_after=10, peak_before=written[0], peak_after=written[1], seconds=1.0,
        results={"defer": DeferResult(modified=modified, deferred=["m"] if modified else []),
                 "recompute": recompute},
        run_reports=tuple(None if p is None else Step(p) for p in as_run))


def human(optimized) -> str:
    from graphrewrite.cli.tables import format_optimize

    return format_optimize(report.optimize_report("in.pb", "out.pb", "graphdef", optimized))


def test_the_headline_is_the_step_as_run_when_it_was_modelled():
    """The resnet_cnn fixture's report read "modelled peak 0.64x" and "as run 0.97x"; verify
    measured 0.97x. The headline is now the as-run model, the as-written one below it."""
    facts = report.optimize_report("in.pb", "out.pb", "graphdef",
                                   result(as_run=(36 * MIB, 35 * MIB)))
    assert facts["peak_bytes_predicted"] == {"before": 36 * MIB, "after": 35 * MIB,
                                             "model": "as_run", "device": "cpu"}
    lines = human(result(as_run=(36 * MIB, 35 * MIB))).splitlines()
    headline = [line for line in lines if line.startswith("modelled peak")]
    assert headline == ["modelled peak   36.0 MiB -> 35.0 MiB (0.97x, as run, after Grappler)"]
    assert "as written      3.0 MiB -> 2.0 MiB (0.67x, live tensors, the step the passes plan on)" in lines
    assert not any(line.startswith("as run") for line in lines)  # no second headline


@pytest.mark.parametrize("as_run", [(None, None), (36 * MIB, None), (0, 0)])
def test_without_the_step_as_run_the_headline_is_as_written(as_run):
    """--no-as-run, or Grappler failed on a graph: the peaks as written, said so."""
    optimized = result(as_run=as_run)
    assert optimized.predicted_peaks == (3 * MIB, 2 * MIB, "as_written")
    lines = human(optimized).splitlines()
    assert "modelled peak   3.0 MiB -> 2.0 MiB (0.67x, live tensors as written)" in lines
    assert not any(line.startswith(("as written", "as run")) for line in lines)


def test_a_rewrite_kept_although_the_step_as_run_rises_says_so():
    rises = report.optimize_report("in.pb", "out.pb", "graphdef",
                                   result(as_run=(30 * MIB, 31 * MIB)))["note"]
    assert ("the rewrite is kept although its modelled peak as run rises (30.0 MiB -> "
            "31.0 MiB, after Grappler): the passes plan on the step as written (3.0 MiB -> "
            "2.0 MiB)") in rises
    slightly = report.optimize_report("in.pb", "out.pb", "graphdef",  # h71: 3.5 KiB
                                      result(as_run=(30 * MIB, 30 * MIB + 3584)))["note"]
    assert "as run rises by 3.5 KiB (30.0 MiB -> 30.0 MiB" in slightly
    falls = report.optimize_report("in.pb", "out.pb", "graphdef",
                                   result(as_run=(30 * MIB, 29 * MIB)))["note"]
    unchanged = report.optimize_report("in.pb", "out.pb", "graphdef",
                                       result(as_run=(30 * MIB, 31 * MIB), modified=False))
    assert "kept although" not in falls and "kept although" not in unchanged["note"]


def test_a_rewrite_kept_although_the_step_as_run_rises_says_what_holds_that_peak():
    """A TF1 CNN fed by an in-graph tf.data iterator (built outside the repo): 0.85x as
    written, 1.00x as run, measured 1.05x, and the note did not say why: its peak as run is a
    filter gradient's column buffers (22.5 of 62 MiB)."""
    optimized = result(as_run=(30 * MIB, 31 * MIB))
    optimized.run_reports = (Step(30 * MIB), Step(31 * MIB, scratch=20 * MIB))
    note = report.optimize_report("in.pb", "out.pb", "graphdef", optimized)["note"]
    assert ("(3.0 MiB -> 2.0 MiB); the peak as run is at conv_grad (31.0 MiB); 20.0 MiB of it "
            "is that kernel's scratch") in note


def test_a_rewrite_that_saves_little_as_run_says_what_holds_that_peak():
    """A small CNN on the CPU: the rewrite lowers the live tensors by a third, the step as run
    by 3%: its peak is a convolution gradient whose column buffers no rewrite moves."""
    optimized = result(as_run=(36 * MIB, 35 * MIB))
    optimized.run_reports = (Step(36 * MIB), Step(35 * MIB, scratch=29 * MIB))
    note = report.optimize_report("in.pb", "out.pb", "graphdef", optimized)["note"]
    assert ("as written it saves 33%, as run (after Grappler) 3%: the peak as run is at "
            "conv_grad (35.0 MiB); 29.0 MiB of it is that kernel's scratch") in note
    lower = report.optimize_report("in.pb", "out.pb", "graphdef",
                                   result(as_run=(36 * MIB, 28 * MIB)))["note"]
    assert "as run (after Grappler)" not in lower  # 22% as run, over half of 33%: nothing to say


def test_a_rewrite_that_saves_half_as_much_as_run_says_what_else_holds_the_peak():
    """A Keras U-Net on the CPU saved 50% as written and 19% as run, and the report said
    nothing: at its peak, a 36 MiB column buffer took a 67 MiB free chunk whole."""
    optimized = result(as_run=(142 * MIB, 115 * MIB), written=(100 * MIB, 50 * MIB))
    optimized.run_reports = (Step(142 * MIB), Step(115 * MIB, scratch=36 * MIB,
                                                   padding=31 * MIB))
    note = report.optimize_report("in.pb", "out.pb", "graphdef", optimized)["note"]
    assert ("as written it saves 50%, as run (after Grappler) 19%: the peak as run is at "
            "conv_grad (115.0 MiB); 36.0 MiB of it is that kernel's scratch") in note
    assert "; 31.0 MiB of it is allocator padding" in note
    optimized.run_reports = (Step(142 * MIB), Step(115 * MIB, scratch=36 * MIB))
    note = report.optimize_report("in.pb", "out.pb", "graphdef", optimized)["note"]
    assert "36.0 MiB of it is that kernel's scratch" in note and "padding" not in note


def adds_a_node(graph, analysis, options, model=None):
    graph = graph.copy()
    graph.add_node("an_added_noop", "NoOp")
    return AccumulateResult(graph, True, accumulated=["an_added_noop"])


def test_no_note_says_the_graph_was_left_unchanged_when_a_pass_changed_it(monkeypatch):
    """Mode memory's defer changed nodes, then recompute found no checkpoint choice worth it
    and said "graph left unchanged". A pass that changes the graph before a recompute that
    finds nothing: the report says nothing was recomputed, not that nothing changed."""
    monkeypatch.setitem(PASSES, "accumulate", PASSES["accumulate"]._replace(run=adds_a_node))
    optimized = pipeline.optimize(io.load(fixture_path("adam_train")), "none",
                                  passes="accumulate recompute(policy=memory)", as_run=False)
    assert optimized.changed and not optimized.of(RecomputeResult).modified
    note = report.optimize_report("in", "out", "metagraph", optimized)["note"]
    assert "nothing recomputed" in note and "unchanged" not in note


def test_a_step_modelled_on_a_gpu_says_so():
    """h19's swap read "modelled peak 141.1 MiB -> ..." while inspect said 150.3 MiB: a swap's
    steps are modelled on a GPU (no CPU convolution scratch), and the headline now says so."""
    optimized = result(as_run=(36 * MIB, 35 * MIB))
    optimized.run_reports = tuple(Step(p, accelerator=True) for p in (36 * MIB, 35 * MIB))
    facts = report.optimize_report("in.pb", "out.pb", "graphdef", optimized)
    assert facts["peak_bytes_predicted"]["device"] == "gpu"
    headline = [line for line in human(optimized).splitlines()
                if line.startswith("modelled peak")]
    assert headline == ["modelled peak   36.0 MiB -> 35.0 MiB (0.97x, as run on a GPU, "
                        "after Grappler)"]
    assert report.optimize_report("in.pb", "out.pb", "graphdef", result())[
        "peak_bytes_predicted"]["device"] is None  # modelled as written only


@pytest.mark.tf
def test_the_headline_of_a_cnn_is_its_step_as_run(tmp_path):
    """resnet_cnn: 0.64x as written, 0.97x as run (verify measured 0.97x); the headline is
    the as-run model."""
    shown = run_cli("optimize", fixture_path("resnet_cnn"), "-o", tmp_path / "o.pb", "--json")
    assert shown.exit_code == 0, shown.stderr
    facts = json.loads(shown.stdout)
    as_run, predicted = facts["peak_bytes_as_run"], facts["peak_bytes_predicted"]
    assert predicted == {**as_run, "model": "as_run", "device": "cpu"}
    text = run_cli("optimize", fixture_path("resnet_cnn"), "-o", tmp_path / "p.pb").stdout
    ratio = as_run["after"] / as_run["before"]
    assert f"({ratio:.2f}x, as run, after Grappler)" in text.splitlines()[2]
    # what no rewrite goes below: under the rewrite's peak, over the variables it counts
    floor = facts["lossless_floor"]
    assert floor["state_bytes"] < floor["bytes"] <= as_run["after"]
    assert floor["at"] in text and "no lossless rewrite (recomputation, swapping, running sums) goes below it" in text


def _marked(kind, index):
    """A `kind` result whose own fields hold values no other field holds."""
    import dataclasses
    import typing

    from graphrewrite.passes.base import COMMON_FIELDS

    values = {}
    for number, f in enumerate(dataclasses.fields(kind)):
        if f.name in COMMON_FIELDS:
            continue
        hint = str(typing.get_type_hints(kind)[f.name])
        marker = f"{kind.__name__}.{f.name}"
        values[f.name] = (True if "bool" in hint else
                          7_000_000 + 100 * index + number if "int" in hint and "list" not in hint
                          else 0.5 + index + number / 100 if "float" in hint else
                          {marker: [marker]} if "dict" in hint else
                          [marker] if "list" in hint else marker)
    return kind(**values), values


def test_every_result_field_reaches_the_json_report():
    """Each pass's result type owns its report section: every field it holds reaches `--json`
    (diet's too, which the report once left out), for each pass alone and all together."""
    marked = {name: _marked(entry.result, i) for i, (name, entry) in enumerate(PASSES.items())}
    keys = [key for result, _ in marked.values() for key in result.section()]
    shared = {key for key in keys if keys.count(key) > 1}  # added up together: checked alone
    for names in [[name] for name in marked] + [list(marked)]:
        optimized = pipeline.OptimizeResult(
            graph=None, mode="memory", pipeline=" ".join(names), nodes_before=1, nodes_after=1,
            peak_before=1, peak_after=1, seconds=0.0,
            results={name: marked[name][0] for name in names})
        text = json.dumps(report.optimize_report("in.pb", "out.pb", "graphdef", optimized))
        for name in names:
            for field, value in marked[name][1].items():
                if len(names) > 1 and field in shared:
                    continue
                shown = next(iter(value)) if isinstance(value, (dict, list)) else value
                assert json.dumps(shown) in text, (name, field)


def test_the_report_keys_are_the_same_in_every_mode_and_documented():
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    documented = readme.split("**`optimize --json` / `--report` keys**")[1].split("\n\n")[0]
    keys = [set(report.optimize_report("in.pb", "out.pb", "graphdef", pipeline.OptimizeResult(
        graph=None, mode="memory", pipeline=name, nodes_before=1, nodes_after=1, peak_before=1,
        peak_after=1, seconds=0.0, results={name: entry.result()})))
        for name, entry in PASSES.items()]
    assert all(k == keys[0] for k in keys)
    assert not [k for k in keys[0] if f"`{k}`" not in documented]


def test_the_diet_report_says_what_diet_did():
    from graphrewrite.passes.diet import DietResult

    diet = DietResult(modified=True, dieted=["w1", "w2"], slots_removed=["m1"],
                      slots_added=["r1", "c1"], bytes_saved=3 * MIB, forward_reads="gated",
                      kept_float={"fewer than 1024 elements": ["b1"]})
    lines = human(pipeline.OptimizeResult(
        graph=None, mode="diet", pipeline="diet", nodes_before=10, nodes_after=20,
        peak_before=4 * MIB, peak_after=3 * MIB, seconds=1.0, results={"diet": diet}))
    assert ("diet            2 variables now 16-bit; optimizer slots -1 +2; 3.0 MiB of "
            "persistent memory saved; forward reads gated") in lines.splitlines()
    assert "kept float32    1 variables: fewer than 1024 elements (e.g. b1)" in lines


@pytest.mark.tf
@pytest.mark.parametrize("optimizer, loss, named", [
    ("adadelta", "mse", ()), ("adadelta", "xent", ()),
    ("adam", "xent", ("--lossy", "--mode diet"))])
def test_levers_that_go_lower_are_named_only_where_they_apply(tmp_path, optimizer, loss, named):
    """A chunked loss needs a cross entropy of a projection's logits of at least its min_bytes
    (10 classes were named), diet an update it reads (a SimCLR step, similarity logits and
    Adadelta, was told to try both)."""
    import tensorflow as tf

    with tf.Graph().as_default() as g:
        x = tf.compat.v1.placeholder(tf.float32, (32, 64), name="x")
        h = tf.compat.v1.layers.dense(x, 256, tf.nn.relu)
        out = tf.compat.v1.layers.dense(h, 10)
        if loss == "mse":
            target = tf.compat.v1.placeholder(tf.float32, (32, 10), name="y")
            value = tf.reduce_mean(tf.square(out - target), name="loss")
        else:
            labels = tf.compat.v1.placeholder(tf.int32, (32,), name="y")
            value = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=labels, logits=out), name="loss")
        make = {"adadelta": tf.compat.v1.train.AdadeltaOptimizer,
                "adam": tf.compat.v1.train.AdamOptimizer}[optimizer]
        make(1e-3).minimize(value, name="train")
        meta = tf.compat.v1.train.export_meta_graph(graph=g)
    (tmp_path / "step.meta").write_bytes(meta.SerializeToString())
    facts = json.loads(run_cli("optimize", tmp_path / "step.meta", "-o", tmp_path / "b.meta",
                               "--budget", "1%", "--no-as-run", "--json").stdout)
    levers = facts["note"].split("levers not used here that go lower: ")[1]
    assert "--swap-checkpoints" in levers
    assert [flag for flag in ("--lossy", "--mode diet") if flag in levers] == list(named)


def test_a_lever_the_budget_tried_is_not_named_as_one_that_goes_lower():
    """A DenseNet step with --budget 25% --lossy: diet was tried (as `diet(momentum=keep)`),
    went higher and was not chosen; the note still said to use --lossy."""
    optimized = result(written=(300 * MIB, 200 * MIB))
    optimized.budget = 100 * MIB
    optimized.levers = [{"levers": ["diet(momentum=keep)"], "recompute": True}]
    note = report.optimize_report("in.pb", "out.pb", "graphdef", optimized)["note"]
    assert "budget 100.0 MiB not met (200.0 MiB modelled)" in note
    assert "--swap-checkpoints" in note and "diet" not in note


@pytest.mark.parametrize("budget, below", [(10, True), (20, False)])
def test_a_budget_under_the_lossless_floor_is_named_so(budget, below):
    """U-Net h24's floor was 0.52x of its peak: the variables and Adam's slots (89 MiB) beside
    a weights' gradient's operands and column buffer. A budget under it is missed by any
    recomputation; the note says so and what the floor is made of."""
    optimized = result(as_run=(36 * MIB, 35 * MIB))  # floor: 9 MiB of state + 9 of operands
    optimized.budget, optimized.budget_of = budget * MIB, "predicted"
    optimized.levers = [{"levers": ["diet"], "recompute": True}]  # diet tried
    facts = report.optimize_report("in.pb", "out.pb", "graphdef", optimized)
    assert facts["lossless_floor"] == {"bytes": 18 * MIB, "state_bytes": 9 * MIB,
                                       "at": "conv_grad"}
    assert ("the budget is under the lossless floor of 18.0 MiB: the variables and "
            "constants, 9.0 MiB, and the fed inputs beside conv_grad's operands"
            in facts["note"]) is below
    assert f"budget {budget}.0 MiB not met (35.0 MiB modelled)" in facts["note"]


@pytest.mark.parametrize("lever, said", [("diet", True), ("diet(min_size=1048576)", True),
                                         ("diet(momentum=drop)", True),
                                         ("diet(momentum=bfloat16)", False)])
def test_a_budget_met_by_dropping_the_first_moment_says_to_check_training(lever, said):
    """The zoo's ResNet-50 at --budget 25% --lossy: diet's lean Adam met it (0.25x measured)
    and its loss after 20 steps was 3x its original's (5.33 against 1.80; after 50 it fell
    below it); the report said only that the budget was met."""
    optimized = result(written=(300 * MIB, 70 * MIB))
    optimized.budget = 75 * MIB
    optimized.levers = [{"levers": ["diet(momentum=bfloat16)"], "recompute": True,
                         "chosen": False},
                        {"levers": [lever], "recompute": True, "chosen": True}]
    note = report.optimize_report("in.pb", "out.pb", "graphdef", optimized)["note"]
    assert ("dropping the optimizer's first moment" in note) is said
    assert ("verify --steps" in note) is said


@pytest.mark.parametrize("budget, met", [("90%", True), ("1%", False)])
def test_the_report_says_whether_the_budget_was_met_and_what_would_go_lower(tmp_path, budget,
                                                                            met):
    facts = json.loads(run_cli("optimize", fixture_path("mlp"), "-o", tmp_path / "b.pbtxt",
                               "--budget", budget, "--no-as-run", "--json").stdout)
    before = facts["peak_bytes"]["before"]
    assert abs(facts["budget_bytes"] - before * int(budget[:-1]) / 100) <= 1
    assert facts["budget_met"] is met
    assert (facts["peak_bytes"]["after"] <= facts["budget_bytes"]) is met
    assert ("levers not used here that go lower" in facts["note"]) is not met
    assert ("--swap-checkpoints" in facts["note"]) is not met
    plain = json.loads(run_cli("optimize", fixture_path("mlp"), "-o", tmp_path / "p.pbtxt",
                               "--no-as-run", "--json").stdout)
    assert plain["budget_bytes"] is None and plain["budget_met"] is None
