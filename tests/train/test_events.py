"""attnjax.train.events against tensorboardX: the same CRCs, the same Event bytes, files its
protobuf reads back; and train.py's modules import without PyTorch although it is installed."""

import os
import struct
import subprocess
import sys
import textwrap

import numpy as np
from helpers import ROOT
from tensorboardX.crc32c import crc32c as reference_crc32c
from tensorboardX.proto.event_pb2 import Event, SessionLog
from tensorboardX.proto.summary_pb2 import Summary
from tensorboardX.record_writer import masked_crc32c as reference_masked_crc32c

from attnjax.train import events, report


def test_crc32c_is_castagnolis_and_masked_as_tfrecord_does():
    assert events.crc32c(b"123456789") == 0xE3069283  # the published CRC-32C check value
    rng = np.random.default_rng(0)
    for size in (0, 1, 7, 8, 100, 1000):
        data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        assert events.crc32c(data) == reference_crc32c(data), size
        assert events.masked_crc32c(data) == reference_masked_crc32c(data), size


def test_events_serialize_as_tensorboards_protobuf_does():
    scalars = {"train/loss": 0.25, "eval/accuracy": 0.9375, "train/learning_rate": -1e-3}
    expected = Event(
        wall_time=1234.5,
        step=300,
        summary=Summary(value=[Summary.Value(tag=k, simple_value=v) for k, v in scalars.items()]),
    )
    assert events.event(300, wall_time=1234.5, scalars=scalars) == expected.SerializeToString()
    version = Event(wall_time=1.0, step=7, file_version="brain.Event:2")
    assert events.event(7, wall_time=1.0, file_version="brain.Event:2") == (
        version.SerializeToString()
    )
    start = Event(wall_time=2.0, step=7, session_log=SessionLog(status=SessionLog.START))
    assert events.event(7, wall_time=2.0, session_start=True) == start.SerializeToString()


def read_records(path):
    """The payloads of a TFRecord file, each frame's two CRCs checked by tensorboardX's."""
    data, offset, payloads = open(path, "rb").read(), 0, []
    while offset < len(data):
        header = data[offset : offset + 8]
        (length,) = struct.unpack("<Q", header)
        (header_crc,) = struct.unpack("<I", data[offset + 8 : offset + 12])
        payload = data[offset + 12 : offset + 12 + length]
        (payload_crc,) = struct.unpack("<I", data[offset + 12 + length : offset + 16 + length])
        assert header_crc == reference_masked_crc32c(header)
        assert payload_crc == reference_masked_crc32c(payload)
        payloads.append(payload)
        offset += 16 + length
    return payloads


def test_metric_writer_files_read_back_with_the_purge_of_a_restart(tmp_path):
    writer = report.MetricWriter(str(tmp_path), resume_step=40)
    writer.write(50, {"train/loss": 1.5, "train/accuracy": 0.5})
    writer.write(60, {"eval/loss": 2.0})
    # Before close: each write is on disk already (a killed run keeps what it logged).
    (name,) = os.listdir(tmp_path / "tensorboard")
    assert name.startswith("events.out.tfevents.")
    parsed = [Event.FromString(p) for p in read_records(tmp_path / "tensorboard" / name)]
    writer.close()
    assert [e.file_version for e in parsed[:2]] == ["brain.Event:2"] * 2
    assert [e.step for e in parsed[:3]] == [0, 41, 41]  # the purge: steps from 41 hidden
    assert parsed[2].session_log.status == SessionLog.START
    scalars = [(e.step, {v.tag: v.simple_value for v in e.summary.value}) for e in parsed[3:]]
    assert scalars == [(50, {"train/loss": 1.5, "train/accuracy": 0.5}), (60, {"eval/loss": 2.0})]


def test_the_training_modules_do_not_import_pytorch(tmp_path):
    """train.py's imports and its metric writer leave PyTorch (installed here) unimported: it
    costs every run's start-up a second and a half."""
    script = textwrap.dedent("""
        import sys
        import attnjax.compile, attnjax.tasks
        from attnjax.train import report
        writer = report.MetricWriter(sys.argv[1])
        writer.write(1, {"train/loss": 1.0})
        writer.close()
        print(sorted({m.split(".")[0] for m in sys.modules} & {"torch", "tensorboardX"}))
    """)
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
