"""Batch jobs over model zoos: find every model under some paths, rewrite each, report each.

One model is one job, run in its own worker (a local process pool, or a Dask cluster for zoos that
outgrow one machine). A failing or corrupt model yields a `failed` line and never stops the
others. An output newer than its input is `skipped` unless forced. Results come back in a stable
order (by path), one JSON-serialisable dict per model.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import traceback
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

__all__ = ["MODEL_SUFFIXES", "SAVEDMODEL_FILES", "Job", "discover", "plan", "run_job", "run"]

log = logging.getLogger(__name__)

MODEL_SUFFIXES = (".pb", ".pbtxt", ".meta", ".meta.txt", ".meta.pbtxt")
SAVEDMODEL_FILES = ("saved_model.pb", "saved_model.pbtxt")


@dataclass(frozen=True)
class Job:
    source: str
    output: str
    mode: str = "memory"
    verify: bool = False
    force: bool = False
    budget: str | None = None  # `--budget` of modes memory and swap, e.g. 50% of each model's peak


def discover(paths: Iterable[str | os.PathLike]) -> list[tuple[Path, Path]]:
    """(root, model) pairs: model files by suffix and SavedModel directories, sorted, each once.

    A path given directly is its own root; under a directory, models keep their relative layout.
    The inside of a SavedModel (variables/, assets/) is not searched.
    """
    found: dict[Path, Path] = {}
    for given in map(Path, paths):
        if _is_saved_model(given):
            found.setdefault(given, given.parent)
        elif given.is_file() or not given.exists():
            found.setdefault(given, given.parent)  # a missing path fails as its own job
        else:
            for directory, subdirs, files in os.walk(given):
                here = Path(directory)
                if _is_saved_model(here):
                    found.setdefault(here, given)
                    subdirs[:] = []
                    continue
                subdirs.sort()
                for name in sorted(files):
                    if name.lower().endswith(MODEL_SUFFIXES):
                        found.setdefault(here / name, given)
    return sorted(((root, model) for model, root in found.items()), key=lambda p: str(p[1]))


def plan(paths, out_dir, mode: str = "memory", verify: bool = False,
         force: bool = False, budget: str | None = None) -> list[Job]:
    """One job per model, writing to `out_dir` under the model's path relative to its root."""
    out_dir = Path(out_dir)
    jobs = []
    for root, model in discover(paths):
        relative = model.relative_to(root) if model != root else Path(model.name)
        jobs.append(Job(str(model), str(out_dir / relative), mode, verify, force, budget))
    return jobs


def run_job(job: Job) -> dict:
    """Rewrite (and optionally verify) one model; never raises: errors become the line."""
    from .core import io
    from .core.errors import InputError
    from .execution import measure
    from .pipeline import run as pipeline

    measure.measurement_environment()
    start = time.perf_counter()
    line = {"path": job.source, "output": job.output, "status": "ok", "error": None,
            "peak_before": None, "peak_after": None, "nodes_added": None, "seconds": None,
            "warnings": []}
    capture = _Collect(line["warnings"])
    logger = logging.getLogger("graphrewrite")
    logger.addHandler(capture)
    try:
        if not job.force and _up_to_date(Path(job.source), Path(job.output)):
            line["status"] = "skipped"
            line["error"] = "output is newer than the input (--force to redo)"
            return line
        model = io.load(job.source)
        result = pipeline.optimize(model, job.mode, budget=job.budget, as_run=False)
        io.save(model, result.graph, job.output)
        line.update(peak_before=result.peak_before, peak_after=result.peak_after,
                    nodes_added=result.nodes_after - result.nodes_before)
        if job.verify:
            _verified(model, job.output, line)
    except Exception as err:  # noqa: BLE001  (one bad model must not stop the zoo)
        line["status"] = "failed"
        text = err.message if isinstance(err, InputError) else str(err)
        line["error"] = text.splitlines()[0] if text else type(err).__name__
        log.debug("%s failed:\n%s", job.source, traceback.format_exc())
    finally:
        logger.removeHandler(capture)
    line["seconds"] = round(time.perf_counter() - start, 3)
    return line


def _verified(model, output: str, line: dict) -> None:
    """Verify a written output; one that differs or cannot be verified is removed, so it fails
    again on the next run instead of being skipped as up to date."""
    from .core import io
    from .execution import verify

    try:
        checked = verify.verify(model, io.load(output), verify.VerifyOptions(runs=1),
                                isolated=False)
        line["match"] = checked.match
        if checked.within_spread:  # an original that differs from itself: see verify
            line["within_spread"] = True
        elif not checked.match:
            raise _Mismatch(f"outputs differ (max |diff| {checked.max_abs_diff:.3g})")
    except BaseException:
        _remove(Path(output))
        raise


class _Mismatch(Exception):
    """The rewritten model runs but its outputs or variables differ from the original's."""


def _remove(path: Path) -> None:
    log.info("removing %s: it did not pass verification", path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


class _Collect(logging.Handler):
    """Keeps a job's warnings for its report line instead of a worker's stderr."""

    def __init__(self, into: list):
        super().__init__(logging.WARNING)
        self.into = into

    def emit(self, record):
        self.into.append(record.getMessage())


def run(jobs: list[Job], workers: int = 1, scheduler: str | None = None,
        on_result: Callable[[dict], None] | None = None) -> list[dict]:
    """Run every job (a local process pool, or the Dask scheduler at `scheduler`); results in
    job order. `on_result` sees each result as it arrives (for progress)."""
    results: dict[str, dict] = {}
    if scheduler:
        completed = _on_dask(jobs, scheduler)
    else:
        completed = _locally(jobs, workers)
    for line in completed:
        results[line["path"]] = line
        if on_result:
            on_result(line)
    return [results[job.source] for job in jobs]


def _locally(jobs: list[Job], workers: int):
    if workers <= 1:
        yield from map(run_job, jobs)
        return
    import multiprocessing

    context = multiprocessing.get_context("spawn")  # TensorFlow does not survive fork
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        for future in as_completed([pool.submit(run_job, job) for job in jobs]):
            yield future.result()


def _on_dask(jobs: list[Job], scheduler):
    try:
        from dask.distributed import Client
        from dask.distributed import as_completed as dask_completed
    except ImportError:
        from .core.errors import GraphRewriteError

        raise GraphRewriteError("${executor} dask needs the dask extra: "
                                "pip install 'graphrewrite[dask]'") from None
    client = scheduler if hasattr(scheduler, "submit") else Client(scheduler)
    try:
        futures = client.map(run_job, jobs, pure=False)
        for future in dask_completed(futures):
            yield future.result()
    finally:
        if client is not scheduler:
            client.close()


def _is_saved_model(path: Path) -> bool:
    return path.is_dir() and any((path / name).is_file() for name in SAVEDMODEL_FILES)


def _up_to_date(source: Path, output: Path) -> bool:
    if not output.exists() or not source.exists():
        return False
    newest_input = max((p.stat().st_mtime for p in [source, *source.rglob("*")]),
                       default=0) if source.is_dir() else source.stat().st_mtime
    return output.stat().st_mtime >= newest_input
