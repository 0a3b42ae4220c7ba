"""Plans (`optimize --plan-out`, `--plan`): a written plan replays to the same bytes without
searching, and an edited plan that would break the graph is refused with one line, exit 2."""

import json

import pytest

from conftest import fixture_path, run_cli

MODEL = fixture_path("keras_step_tf2")  # a TF2 step with dropout: random ops to refuse


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan")
    result = run_cli("optimize", MODEL, "-o", out / "searched.pb", "--plan-out",
                     out / "plan.json")
    assert result.exit_code == 0, result.stderr
    return out, json.loads((out / "plan.json").read_text())


def replay(out, plan, name="replayed.pb"):
    (out / "edited.json").write_text(json.dumps(plan))
    return run_cli("optimize", MODEL, "-o", out / name, "--plan", out / "edited.json")


def test_plan_holds_the_searched_decision(planned):
    _, plan = planned
    assert plan["pipeline"] == ("inline ungate loop_recompute rerun defer "
                                "accumulate(min_share=0.1) micro_batches recompute(policy=memory) "
                                "serialize tails_first apply_early")
    assert plan["recompute"]["checkpoints"] and plan["recompute"]["recomputed"]
    assert not set(plan["recompute"]["checkpoints"]) & set(plan["recompute"]["recomputed"])


def test_replaying_a_plan_gives_the_same_bytes(planned):
    out, plan = planned
    result = replay(out, plan)
    assert result.exit_code == 0, result.stderr
    assert "policy=collection" in result.stdout  # no search ran
    assert (out / "replayed.pb").read_bytes() == (out / "searched.pb").read_bytes()


def test_an_edited_checkpoint_list_rewrites_differently(planned):
    out, plan = planned
    edited = {**plan, "recompute": {"checkpoints": plan["recompute"]["checkpoints"][:1]}}
    result = replay(out, edited, "edited.pb")
    assert result.exit_code == 0, result.stderr
    assert (out / "edited.pb").read_bytes() != (out / "searched.pb").read_bytes()


@pytest.mark.parametrize("edit, message", [
    (lambda p: p["recompute"]["recomputed"].append("mlp/dropout/dropout/random_uniform/"
                                                   "RandomUniform"),
     "cannot be: random"),
    (lambda p: p["recompute"]["checkpoints"].append("no/such/node"), "not in the graph"),
    (lambda p: p["recompute"]["checkpoints"].pop(), "does not follow from the checkpoints"),
    (lambda p: p.update(nodes=p["nodes"] + 1), "made for a graph of"),
    (lambda p: p.pop("recompute"), "needs its decision 'recompute'"),
    (lambda p: p.update(graphrewrite_plan=7), "not a graphrewrite plan"),
])
def test_a_plan_that_would_break_the_graph_is_refused(planned, edit, message):
    out, plan = planned
    plan = json.loads(json.dumps(plan))
    edit(plan)
    result = replay(out, plan, "refused.pb")
    assert result.exit_code == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (out / "refused.pb").exists()


def test_plan_excludes_search_options(planned, tmp_path):
    out, _ = planned
    result = run_cli("optimize", MODEL, "-o", tmp_path / "x.pb", "--plan", out / "plan.json",
                     "--mode", "speed")
    assert result.exit_code == 2 and "--mode cannot be given" in result.stderr


def test_a_swap_plan_replays_to_the_same_bytes(tmp_path):
    model = fixture_path("resnet_cnn")
    searched = run_cli("optimize", model, "-o", tmp_path / "searched.pb", "--mode", "swap",
                       "--plan-out", tmp_path / "plan.json")
    assert searched.exit_code == 0, searched.stderr
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["swap"]["tensors"]
    replayed = run_cli("optimize", model, "-o", tmp_path / "replayed.pb", "--plan",
                       tmp_path / "plan.json")
    assert replayed.exit_code == 0, replayed.stderr
    assert (tmp_path / "replayed.pb").read_bytes() == (tmp_path / "searched.pb").read_bytes()


def test_the_tradeoff_curve_falls_and_its_points_replay(tmp_path):
    """`--tradeoff`: peaks fall as the extra compute grows, the exact planner recomputes no more
    than the default at a budget both meet, and a point's plan replays to its stated peak."""
    curve = tmp_path / "curve.json"
    done = run_cli("optimize", fixture_path("mlp"), "-o", tmp_path / "out.pbtxt",
                   "--tradeoff", curve, "--no-as-run")
    assert done.exit_code == 0, done.stderr
    found = json.loads(curve.read_text())
    points = found["estimate"]
    assert len(points) >= 3 and points[-1]["budget"] is None  # the lowest, last
    peaks = [p["peak_bytes"] for p in points]
    assert peaks[0] < found["original_peak_bytes"] and peaks[-1] == min(peaks)
    assert all(p["peak_bytes"] <= p["budget"] for p in points[:-1] if p["modified"])
    assert all(p["budget_met"] == (p["peak_bytes"] <= p["budget"]) for p in points[:-1])
    assert points[-1]["budget_met"] is None and {p["modelled"] for p in points} == {"as written"}
    by_budget = {p["budget"]: p for p in points}
    for exact in found.get("exact", []):
        default = by_budget[exact["budget"]]
        if default["peak_bytes"] <= exact["budget"]:
            assert exact["extra_flops"] <= default["extra_flops"]
    chosen = points[len(points) // 2]
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(chosen["plan"]))
    replayed = run_cli("optimize", fixture_path("mlp"), "-o", tmp_path / "again.pbtxt",
                       "--plan", plan_file, "--json", "--no-as-run")
    assert replayed.exit_code == 0, replayed.stderr
    assert json.loads(replayed.stdout)["peak_bytes"]["after"] == chosen["peak_bytes"]
    refused = run_cli("optimize", fixture_path("mlp"), "-o", tmp_path / "x.pbtxt",
                      "--tradeoff", tmp_path / "curve.gif")
    assert refused.exit_code == 2 and "--tradeoff" in refused.stderr
    on_h200 = run_cli("optimize", fixture_path("mlp"), "-o", tmp_path / "h.pbtxt", "--no-as-run",
                      "--tradeoff", tmp_path / "h200.json", "--device-profile", "h200")
    assert on_h200.exit_code == 0, on_h200.stderr  # the profile times the curve, no swap pass
    faster = json.loads((tmp_path / "h200.json").read_text())
    assert faster["profile"] == "h200"
    assert faster["estimate"][-1]["extra_seconds"] < points[-1]["extra_seconds"]


@pytest.mark.tf
def test_the_lossy_curve_goes_below_the_lossless_floor_and_its_points_replay(tmp_path):
    """`--tradeoff --lossy`: every lever `--budget --lossy` may take, down to the lowest any
    reaches; on the shipped Keras MetaGraphDef (Adam) that is below recomputation's floor, with
    diet, and a diet point's plan replays to its stated peak."""
    model, curve = fixture_path("keras_train"), tmp_path / "curve.json"
    done = run_cli("optimize", model, "-o", tmp_path / "out.meta", "--tradeoff", curve,
                   "--lossy", "--no-as-run")
    assert done.exit_code == 0, done.stderr
    found = json.loads(curve.read_text())
    points = found["levers"]
    assert points[-1]["budget"] is None and points[-1]["budget_met"] is None
    budgets = [p["budget"] for p in points[:-1]]
    assert budgets == sorted(budgets, reverse=True) and len(budgets) >= 3
    assert all(p["peak_bytes"] <= p["budget"] for p in points[:-1] if p["budget_met"])
    assert points[-1]["peak_bytes"] < min(p["peak_bytes"] for p in found["estimate"])
    assert "diet" in points[-1]["levers"]
    assert points[0]["levers"] == "recompute"  # lossless where recomputation reaches it
    dieted = next(p for p in points[:-1] if "diet" in p["levers"])
    assert dieted["step_time"] > points[0]["step_time"]  # dequantization costs time
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(dieted["plan"]))
    replayed = run_cli("optimize", model, "-o", tmp_path / "again.meta", "--plan", plan_file,
                       "--json", "--no-as-run")
    assert replayed.exit_code == 0, replayed.stderr
    assert json.loads(replayed.stdout)["peak_bytes_predicted"]["after"] == dieted["peak_bytes"]


def test_pins_hold_what_they_keep_and_say_what_they_cost(tmp_path):
    """`--pin keep=` nodes are checkpoints of the plan, `--pin recompute=` ones are not, and
    the note prices the pins against the plan found without them."""
    done = run_cli("optimize", fixture_path("mlp"), "-o", tmp_path / "o.pbtxt", "--json",
                   "--no-as-run", "--pin", "keep=dense_1/Relu", "--pin", "recompute=dense_4/Relu")
    assert done.exit_code == 0, done.stderr
    facts = json.loads(done.stdout)
    assert "dense_1/Relu" in facts["checkpoints"] and "dense_4/Relu" not in facts["checkpoints"]
    assert facts["pinned"] == {"keep": ["dense_1/Relu"], "recompute": ["dense_4/Relu"]}
    assert "pin_keep=dense_1/Relu" in facts["pipeline"] and "without them" in facts["note"]
    free = json.loads(run_cli("optimize", fixture_path("mlp"), "-o", tmp_path / "f.pbtxt",
                              "--json", "--no-as-run").stdout)
    assert "dense_4/Relu" in free["checkpoints"]  # so the pin changed the plan
    never = json.loads(run_cli("optimize", fixture_path("mlp"), "-o", tmp_path / "n.pbtxt",
                               "--json", "--no-as-run", "--pin", "never=op:Relu").stdout)
    assert not {r for r in never["recomputed"] if r.endswith("Relu")}
    bad = run_cli("optimize", fixture_path("mlp"), "-o", tmp_path / "b.pbtxt", "--pin", "hold=x")
    assert bad.exit_code == 2 and "keep=, recompute= or never=" in bad.stderr
    speed = run_cli("optimize", fixture_path("mlp"), "-o", tmp_path / "s.pbtxt", "--mode",
                    "speed", "--pin", "keep=dense_1/Relu")
    assert speed.exit_code == 2 and "pins need policy memory" in speed.stderr


@pytest.mark.tf
def test_a_plan_replays_the_products_the_rewrite_refused_to_copy(tmp_path):
    """The GAN cell's rewrite would make Grappler fuse its one-column logit otherwise: it is
    planned again with that product never copied. The pipeline says so, and the plan replays
    to the same bytes (it was refused: 'does not follow from the checkpoints')."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "fixtures"))
    import recipes

    model = recipes.ensure("v1_gan_adam_grouped")["path"]
    searched = run_cli("optimize", model, "-o", tmp_path / "searched.meta", "--json",
                       "--plan-out", tmp_path / "plan.json")
    assert searched.exit_code == 0, searched.stderr
    assert "pin_never=" in json.loads(searched.stdout)["pipeline"]
    replayed = run_cli("optimize", model, "-o", tmp_path / "replayed.meta", "--plan",
                       tmp_path / "plan.json")
    assert replayed.exit_code == 0, replayed.stderr
    assert (tmp_path / "replayed.meta").read_bytes() == (tmp_path / "searched.meta").read_bytes()
