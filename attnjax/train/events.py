"""TensorBoard event files of scalars, written without TensorFlow, PyTorch or tensorboardX.

A run logs scalars alone, and the writers that can do more cost their imports at every start:
tensorboardX imports PyTorch whenever it is installed, about half of ``train.py``'s import time
(tests/train/test_events.py keeps PyTorch out). The format is small enough to write directly:

- the file is a sequence of TFRecords: ``uint64 length``, ``uint32 masked_crc32c(length)``,
  ``payload``, ``uint32 masked_crc32c(payload)``, little-endian;
- each payload is a serialized ``tensorboard.Event``: ``wall_time = 1`` (double),
  ``step = 2`` (int64), ``file_version = 3`` (string), ``summary = 5``, ``session_log = 7``;
  ``Summary.value = 1`` holds ``Value {tag = 1 (string), simple_value = 2 (float)}``;
  ``SessionLog.status = 1`` (``START = 1``).

A restarted run passes ``purge_step``: the file then opens, as tensorboardX's do, with a
``file_version`` event and a ``SessionLog.START`` event at that step, which tell TensorBoard to
hide the events of that step and later written by the run that stopped.
"""

from __future__ import annotations

import itertools
import os
import socket
import struct
import time

from attnjax import storage

_FILE_VERSION = "brain.Event:2"
_SESSION_START = 1
_files = itertools.count()  # two writers of one process in one second get two files


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1  # Castagnoli, reflected
        table.append(crc)
    return table


_CRC32C_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli) of ``data``, as TFRecord frames use it."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC32C_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC: a CRC stored inside CRC-checked data must not checksum itself."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def tfrecord(payload: bytes) -> bytes:
    length = struct.pack("<Q", len(payload))
    return (
        length
        + struct.pack("<I", masked_crc32c(length))
        + payload
        + struct.pack("<I", masked_crc32c(payload))
    )


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative int64s as their two's complement, as protobuf does
    out = bytearray()
    while True:
        bits, value = value & 0x7F, value >> 7
        out.append(bits | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, wire_type: int, body: bytes) -> bytes:
    return _varint(number << 3 | wire_type) + body


def _message(number: int, body: bytes) -> bytes:
    return _field(number, 2, _varint(len(body)) + body)


def event(
    step: int,
    *,
    wall_time: float | None = None,
    scalars: dict[str, float] | None = None,
    file_version: str | None = None,
    session_start: bool = False,
) -> bytes:
    """One serialized ``Event``: scalars (tag -> value), a file version or a session start."""
    body = _field(1, 1, struct.pack("<d", time.time() if wall_time is None else wall_time))
    body += _field(2, 0, _varint(int(step)))
    if file_version is not None:
        body += _message(3, file_version.encode())
    if scalars:
        values = b"".join(
            _message(1, _message(1, tag.encode()) + _field(2, 5, struct.pack("<f", value)))
            for tag, value in scalars.items()
        )
        body += _message(5, values)
    if session_start:
        body += _message(7, _field(1, 0, _varint(_SESSION_START)))
    return body


class EventFileWriter:
    """Appends scalar events to a new ``events.out.tfevents.*`` file in ``logdir``. Each
    ``write`` reaches the file before it returns, so a run killed later keeps what it logged."""

    def __init__(self, logdir: str, purge_step: int | None = None):
        storage.makedirs(logdir)
        name = (
            f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}"
            f".{os.getpid()}.{next(_files)}"
        )
        self.path = storage.join(logdir, name)
        self._file = storage.AppendFile(self.path)
        records = [event(0, file_version=_FILE_VERSION)]
        if purge_step is not None:
            records.append(event(purge_step, file_version=_FILE_VERSION))
            records.append(event(purge_step, session_start=True))
        self._append(records)

    def write(self, step: int, scalars: dict[str, float]) -> None:
        self._append([event(step, scalars={k: float(v) for k, v in scalars.items()})])

    def _append(self, payloads: list[bytes]) -> None:
        self._file.write(b"".join(tfrecord(p) for p in payloads))
        self._file.flush()

    def close(self) -> None:
        self._file.close()
