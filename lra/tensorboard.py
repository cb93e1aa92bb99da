"""TensorBoard scalar summaries without TensorFlow: `SummaryWriter` and `read_scalars`.

An event file is a sequence of TFRecords, each framed as

  uint64 length (little-endian) | uint32 masked CRC32C of the 8 length bytes |
  data | uint32 masked CRC32C of the data

with mask(crc) = ((crc >> 15) | (crc << 17)) + 0xa282ead8 (mod 2**32). Each record's data is
an `Event` protobuf, encoded here by hand (only the fields used):

  Event:          wall_time = 1 (double), step = 2 (int64), file_version = 3 (string),
                  summary = 5 (Summary)
  Summary:        value = 1 (repeated Summary.Value)
  Summary.Value:  tag = 1 (string), simple_value = 2 (float)

The first record is `Event(wall_time, file_version="brain.Event:2")`, then one event per
scalar. The file is named `events.out.tfevents.<time>.<hostname>`, the name TensorBoard looks
for; `tensorboard --logdir DIR` shows it (TensorBoard is installed separately, it is not a
dependency). Records are tiny, so CRC32C is a table-driven loop in plain Python.

The writer writes whatever it is given: in a multi-process run only process 0 should create
one (`lra.metrics.MetricWriter` does that).
"""

from __future__ import annotations

import os
import socket
import struct
import time
import weakref
from typing import BinaryIO

FILE_VERSION = "brain.Event:2"
_MASK_DELTA = 0xA282EAD8


def _make_table() -> tuple[int, ...]:
  table = []
  for byte in range(256):
    crc = byte
    for _ in range(8):
      crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1  # reversed Castagnoli polynomial
    table.append(crc)
  return tuple(table)


_TABLE = _make_table()


def crc32c(data: bytes) -> int:
  """CRC-32C (Castagnoli), as in iSCSI and TFRecord: crc32c(b"123456789") == 0xE3069283."""
  crc = 0xFFFFFFFF
  table = _TABLE
  for b in data:
    crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
  return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
  crc = crc32c(data)
  return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + _MASK_DELTA) & 0xFFFFFFFF


def frame_record(data: bytes) -> bytes:
  """One TFRecord: length, its masked CRC, the data, its masked CRC."""
  length = struct.pack("<Q", len(data))
  return (length + struct.pack("<I", masked_crc32c(length)) + data
          + struct.pack("<I", masked_crc32c(data)))


# Protobuf encoding (wire types: 0 varint, 1 fixed64, 2 length-delimited, 5 fixed32).

def _varint(value: int) -> bytes:
  value &= (1 << 64) - 1  # negative int64 -> ten-byte two's complement, as protobuf does
  out = bytearray()
  while True:
    bits = value & 0x7F
    value >>= 7
    if value:
      out.append(bits | 0x80)
    else:
      out.append(bits)
      return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
  return _varint((field << 3) | wire_type)


def _length_delimited(field: int, payload: bytes) -> bytes:
  return _key(field, 2) + _varint(len(payload)) + payload


def encode_event(*, wall_time: float, step: int | None = None, file_version: str | None = None,
                 summary_values: list[tuple[str, float]] = ()) -> bytes:
  """An `Event` message with `wall_time`, optional `step`, `file_version` and scalar values."""
  out = _key(1, 1) + struct.pack("<d", wall_time)
  if step is not None:
    out += _key(2, 0) + _varint(int(step))
  if file_version is not None:
    out += _length_delimited(3, file_version.encode("utf-8"))
  if summary_values:
    summary = b"".join(
        _length_delimited(1, _length_delimited(1, tag.encode("utf-8"))
                          + _key(2, 5) + struct.pack("<f", float(value)))
        for tag, value in summary_values)
    out += _length_delimited(5, summary)
  return out


class SummaryWriter:
  """Writes scalar summaries to `<logdir>/events.out.tfevents.<time>.<hostname>`.

  `scalar(tag, value, step)` appends one event; `flush()` pushes buffered records to the file;
  `close()` flushes and closes it (also done when the writer is garbage collected or the
  interpreter exits). A new writer on the same logdir starts a new file, which TensorBoard
  reads after the older ones (so a resumed run continues its curves).
  """

  def __init__(self, logdir: str):
    os.makedirs(logdir, exist_ok=True)
    self.logdir = logdir
    base = os.path.join(logdir, f"events.out.tfevents.{int(time.time()):010d}."
                                f"{socket.gethostname()}")
    self.path, suffix = base, 0
    while True:
      try:
        self._file: BinaryIO | None = open(self.path, "xb")
        break
      except FileExistsError:  # another writer in the same second
        suffix += 1
        self.path = f"{base}.{suffix}"
    self._finalizer = weakref.finalize(self, self._file.close)
    self._write(encode_event(wall_time=time.time(), file_version=FILE_VERSION))
    self.flush()

  def _write(self, event: bytes) -> None:
    if self._file is None:
      raise ValueError(f"the summary writer for {self.path} is closed.")
    self._file.write(frame_record(event))

  def scalar(self, tag: str, value: float, step: int) -> None:
    self._write(encode_event(wall_time=time.time(), step=int(step),
                             summary_values=[(str(tag), float(value))]))

  def flush(self) -> None:
    if self._file is not None:
      self._file.flush()

  def close(self) -> None:
    if self._file is not None:
      self._file.flush()
      self._finalizer()
      self._file = None

  def __enter__(self) -> "SummaryWriter":
    return self

  def __exit__(self, *exc) -> bool:
    self.close()
    return False


# Reading.

def read_records(path: str) -> list[bytes]:
  """The data of every TFRecord in `path`; raises ValueError on a CRC mismatch or truncation."""
  with open(path, "rb") as f:
    buf = f.read()
  records, pos = [], 0
  while pos < len(buf):
    if pos + 12 > len(buf):
      raise ValueError(f"{path}: truncated record header at byte {pos}.")
    length_bytes = buf[pos:pos + 8]
    (length,), (length_crc,) = struct.unpack("<Q", length_bytes), struct.unpack(
        "<I", buf[pos + 8:pos + 12])
    if masked_crc32c(length_bytes) != length_crc:
      raise ValueError(f"{path}: length CRC mismatch in the record at byte {pos}.")
    start, end = pos + 12, pos + 12 + length
    if end + 4 > len(buf):
      raise ValueError(f"{path}: truncated record at byte {pos}.")
    data = buf[start:end]
    if masked_crc32c(data) != struct.unpack("<I", buf[end:end + 4])[0]:
      raise ValueError(f"{path}: data CRC mismatch in the record at byte {pos}.")
    records.append(data)
    pos = end + 4
  return records


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
  value, shift = 0, 0
  while True:
    if pos >= len(buf):
      raise ValueError("truncated varint in an event.")
    b = buf[pos]
    pos += 1
    value |= (b & 0x7F) << shift
    if not b & 0x80:
      return value, pos
    shift += 7


def _fields(buf: bytes):
  """(field number, wire type, value) of a protobuf message; value is int or bytes."""
  pos = 0
  while pos < len(buf):
    key, pos = _read_varint(buf, pos)
    field, wire_type = key >> 3, key & 7
    if wire_type == 0:
      value, pos = _read_varint(buf, pos)
    elif wire_type == 1:
      value, pos = buf[pos:pos + 8], pos + 8
    elif wire_type == 2:
      n, pos = _read_varint(buf, pos)
      value, pos = buf[pos:pos + n], pos + n
    elif wire_type == 5:
      value, pos = buf[pos:pos + 4], pos + 4
    else:
      raise ValueError(f"unsupported protobuf wire type {wire_type} in an event.")
    if pos > len(buf):
      raise ValueError("truncated field in an event.")
    yield field, wire_type, value


def decode_event(data: bytes) -> dict:
  """{"wall_time", "step", "file_version"?, "values": [(tag, simple_value), ...]}."""
  event = {"wall_time": 0.0, "step": 0, "values": []}
  for field, wire_type, value in _fields(data):
    if field == 1 and wire_type == 1:
      event["wall_time"] = struct.unpack("<d", value)[0]
    elif field == 2 and wire_type == 0:
      event["step"] = value - (1 << 64) if value >= 1 << 63 else value
    elif field == 3 and wire_type == 2:
      event["file_version"] = value.decode("utf-8")
    elif field == 5 and wire_type == 2:
      for f, w, v in _fields(value):
        if f != 1 or w != 2:
          continue
        tag, simple = None, None
        for vf, vw, vv in _fields(v):
          if vf == 1 and vw == 2:
            tag = vv.decode("utf-8")
          elif vf == 2 and vw == 5:
            simple = struct.unpack("<f", vv)[0]
        if tag is not None and simple is not None:
          event["values"].append((tag, simple))
  return event


def read_scalars(path: str) -> list[tuple[int, str, float]]:
  """(step, tag, value) of every scalar (`simple_value`) in the event file `path`, in order.

  Both CRCs of every record are checked; a damaged or truncated file raises ValueError.
  """
  out = []
  for data in read_records(path):
    event = decode_event(data)
    out.extend((event["step"], tag, value) for tag, value in event["values"])
  return out


def event_files(logdir: str) -> list[str]:
  """The event files in `logdir`, oldest first."""
  if not os.path.isdir(logdir):
    return []
  return [os.path.join(logdir, name) for name in sorted(os.listdir(logdir))
          if name.startswith("events.out.tfevents.")]
