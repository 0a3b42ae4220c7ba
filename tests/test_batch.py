"""Batch jobs over a folder of models: every model gets a line, a corrupt one never stops them."""

import json
import shutil

import pytest

from graphrewrite import batch

from conftest import fixture_path, run_cli

MODELS = ["mlp", "resnet_cnn", "tape_tf2", "tiny_savedmodel"]


@pytest.fixture
def zoo(tmp_path):
    root = tmp_path / "zoo"
    (root / "nested").mkdir(parents=True)
    for name in MODELS:
        source = fixture_path(name)
        target = root / ("nested" if name == "tape_tf2" else "") / source.name
        if source.is_dir():
            shutil.copytree(source, target)
        else:
            shutil.copy(source, target)
    (root / "corrupt.pb").write_bytes(b"\x08\x96\x01 not a graph")
    (root / "notes.txt").write_text("not a model")
    return root


def test_discover_finds_files_and_saved_models_in_a_stable_order(zoo):
    found = [str(model.relative_to(zoo)) for _, model in batch.discover([zoo])]
    assert found == ["corrupt.pb", "mlp.pbtxt", "nested/tape_tf2.pb", "resnet_cnn.pb",
                     "tiny_savedmodel"]


def test_batch_rewrites_every_model_and_reports_the_corrupt_one(zoo, tmp_path):
    out, report = tmp_path / "out", tmp_path / "report.jsonl"
    result = run_cli("batch", zoo, "--out-dir", out, "--report", report)
    assert result.exit_code == 1
    lines = [json.loads(line) for line in report.read_text().splitlines()]
    assert len(lines) == 5
    status = {line["path"].split("zoo/")[1]: line["status"] for line in lines}
    assert status == {"corrupt.pb": "failed", "mlp.pbtxt": "ok", "nested/tape_tf2.pb": "ok",
                      "resnet_cnn.pb": "ok", "tiny_savedmodel": "ok"}
    assert (out / "mlp.pbtxt").is_file() and (out / "nested" / "tape_tf2.pb").is_file()
    assert (out / "tiny_savedmodel" / "saved_model.pb").is_file()
    assert not (out / "corrupt.pb").exists()
    failed = next(line for line in lines if line["status"] == "failed")
    assert "not a TensorFlow GraphDef" in failed["error"]
    ok = next(line for line in lines if line["path"].endswith("resnet_cnn.pb"))
    assert ok["peak_after"] < ok["peak_before"] and ok["nodes_added"] > 0
    assert "5 models: 4 ok, 0 skipped, 1 failed" in result.stdout
    # Re-running skips what is up to date; --force redoes it.
    again = run_cli("batch", zoo, "--out-dir", out, "--report", report)
    statuses = [json.loads(line)["status"] for line in report.read_text().splitlines()]
    assert statuses.count("skipped") == 4 and again.exit_code == 1
    forced = run_cli("batch", zoo / "mlp.pbtxt", "--out-dir", out, "--force", "--report", report)
    assert forced.exit_code == 0 and json.loads(report.read_text())["status"] == "ok"


def test_batch_refuses_an_empty_search(tmp_path):
    result = run_cli("batch", tmp_path, "--out-dir", tmp_path / "out")
    assert result.exit_code == 2 and "no models" in result.stderr


def test_batch_budget_is_each_models_share_and_checked_up_front(zoo, tmp_path):
    source = zoo / "resnet_cnn.pb"
    default, budgeted = (batch.run_job(job) for job in [
        *batch.plan([source], tmp_path / "a"), *batch.plan([source], tmp_path / "b", budget="90%")])
    assert default["peak_after"] < budgeted["peak_after"] <= 0.9 * budgeted["peak_before"]
    bad = run_cli("batch", zoo, "--out-dir", tmp_path / "c", "--budget", "lots")
    assert bad.exit_code == 2 and "budget 'lots'" in bad.stderr and not (tmp_path / "c").exists()
    speed = run_cli("batch", zoo, "--out-dir", tmp_path / "c", "--mode", "speed", "--budget", "9%")
    assert speed.exit_code == 2 and "needs mode memory or swap" in speed.stderr


@pytest.mark.tf
def test_batch_in_a_process_pool_with_verify(zoo, tmp_path):
    jobs = batch.plan([zoo / "mlp.pbtxt", zoo / "resnet_cnn.pb"], tmp_path / "out", verify=True)
    lines = batch.run(jobs, workers=2)
    assert [line["status"] for line in lines] == ["ok", "ok"]
    assert all(line["match"] for line in lines)


@pytest.mark.tf
def test_batch_on_a_dask_local_cluster(zoo, tmp_path):
    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                                  dashboard_address=None) as cluster:
        jobs = batch.plan([zoo], tmp_path / "out")
        lines = batch.run(jobs, scheduler=cluster.scheduler_address)
    assert [line["status"] for line in lines] == ["failed", "ok", "ok", "ok", "ok"]


def test_batch_verify_a_model_that_differs_fails_every_time_and_leaves_no_output(
        zoo, tmp_path, monkeypatch):
    """A model whose rewrite does not verify is failed, its output removed: the next run tries
    it again (and fails again) rather than skipping it as up to date."""
    from graphrewrite.execution import verify

    class Differs:
        match, max_abs_diff, within_spread = False, 0.5, False

    monkeypatch.setattr(verify, "verify", lambda *args, **kwargs: Differs())
    out, report = tmp_path / "out", tmp_path / "report.jsonl"
    for _ in range(2):
        result = run_cli("batch", zoo / "mlp.pbtxt", "--out-dir", out, "--verify", "--report",
                         report)
        assert result.exit_code == 1, result.output
        line = json.loads(report.read_text())
        assert line["status"] == "failed" and "outputs differ (max |diff| 0.5)" in line["error"]
        assert "1 models: 0 ok, 0 skipped, 1 failed" in result.stdout
        assert not (out / "mlp.pbtxt").exists()


def test_batch_verify_that_cannot_run_removes_a_saved_model_output(zoo, tmp_path, monkeypatch):
    from graphrewrite.execution import verify

    def fails(*args, **kwargs):
        raise RuntimeError("the step failed")

    monkeypatch.setattr(verify, "verify", fails)
    [job] = batch.plan([zoo / "tiny_savedmodel"], tmp_path / "out", verify=True)
    line = batch.run_job(job)
    assert line["status"] == "failed" and line["error"] == "the step failed"
    assert not (tmp_path / "out" / "tiny_savedmodel").exists()
