"""A measured step as files the usual tools open: a Chrome trace (Perfetto, chrome://tracing;
per-node times, memory counters included) and a TensorBoard run (the graph, with the step's
per-node memory and time as run metadata)."""

from __future__ import annotations

import time
from pathlib import Path

from ..core import io

__all__ = ["TAG", "write"]

TAG = "step"


def write(directory, label: str, run_metadata: bytes, graph_def) -> list[Path]:
    """`<directory>/<label>.trace.json` and the TensorBoard run `<directory>/<label>/`."""
    from tensorboard.compat.proto import event_pb2
    from tensorboard.summary.writer.event_file_writer import EventFileWriter
    from tensorflow.core.protobuf import config_pb2
    from tensorflow.python.client import timeline

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    metadata = config_pb2.RunMetadata.FromString(run_metadata)
    chrome = directory / f"{label}.trace.json"
    io.write_atomic(chrome, timeline.Timeline(metadata.step_stats).generate_chrome_trace_format(
        show_memory=True).encode())
    run = directory / label
    writer = EventFileWriter(str(run))
    now = time.time()
    writer.add_event(event_pb2.Event(wall_time=now, graph_def=graph_def.SerializeToString()))
    writer.add_event(event_pb2.Event(wall_time=now, step=1, tagged_run_metadata=(
        event_pb2.TaggedRunMetadata(tag=TAG, run_metadata=run_metadata))))
    writer.close()
    return [chrome, run]
