"""Tests for lra/tensorboard.py: CRC32C test vectors, the TFRecord framing, a write/read round
trip, damaged files refused, and the event file a tiny training run writes next to
metrics.jsonl."""

import os
import struct

import numpy as np
import pytest

from lra import metrics, tensorboard


@pytest.mark.parametrize("data, expected", [
    (b"", 0x00000000),
    (b"a", 0xC1D04330),
    (b"123456789", 0xE3069283),
    (bytes(32), 0x8A9136AA),  # RFC 3720 B.4: 32 bytes of zeros
    (b"\xff" * 32, 0x62A8AB43),  # 32 bytes of ones
    (bytes(range(32)), 0x46DD794E),  # 32 incrementing bytes
    (bytes(range(31, -1, -1)), 0x113FDB5C),  # 32 decrementing bytes
])
def test_crc32c_vectors(data, expected):
  assert tensorboard.crc32c(data) == expected


def test_record_framing():
  data = b"hello"
  record = tensorboard.frame_record(data)
  assert len(record) == 8 + 4 + len(data) + 4
  assert struct.unpack("<Q", record[:8])[0] == len(data)
  crc = tensorboard.crc32c(record[:8])
  masked = ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF
  assert struct.unpack("<I", record[8:12])[0] == masked
  assert record[12:17] == data
  assert struct.unpack("<I", record[17:])[0] == tensorboard.masked_crc32c(data)


def test_event_encoding_matches_protobuf_bytes():
  # Event(wall_time=1.5, step=3, summary=Summary(value=[Value(tag="a", simple_value=2.0)])).
  expected = (b"\x09" + struct.pack("<d", 1.5) + b"\x10\x03"
              + b"\x2a\x0a" + b"\x0a\x08" + b"\x0a\x01a" + b"\x15" + struct.pack("<f", 2.0))
  assert tensorboard.encode_event(wall_time=1.5, step=3, summary_values=[("a", 2.0)]) == expected
  event = tensorboard.decode_event(expected)
  assert event["step"] == 3 and event["wall_time"] == 1.5 and event["values"] == [("a", 2.0)]
  big = tensorboard.decode_event(tensorboard.encode_event(wall_time=0.0, step=2**40))
  assert big["step"] == 2**40
  assert tensorboard.decode_event(tensorboard.encode_event(wall_time=0.0, step=-1))["step"] == -1


def _write_example(logdir):
  expected = []
  with tensorboard.SummaryWriter(logdir) as writer:
    for step in (0, 1, 10, 1000, 123456789):
      for tag, value in (("train/loss", 2.5 / (step + 1)), ("train/accuracy", 0.1 * (step % 7)),
                         ("validation/accuracy", -3.25)):
        writer.scalar(tag, value, step)
        expected.append((step, tag, value))
    writer.flush()
  return writer.path, expected


def test_round_trip(tmp_path):
  path, expected = _write_example(str(tmp_path))
  name = os.path.basename(path)
  assert name.startswith("events.out.tfevents.") and os.path.dirname(path) == str(tmp_path)
  assert tensorboard.event_files(str(tmp_path)) == [path]
  records = tensorboard.read_records(path)
  first = tensorboard.decode_event(records[0])
  assert first["file_version"] == "brain.Event:2" and not first["values"]
  got = tensorboard.read_scalars(path)
  assert [(s, t) for s, t, _ in got] == [(s, t) for s, t, _ in expected]
  np.testing.assert_allclose([v for *_, v in got],
                             np.float32([v for *_, v in expected]), rtol=0, atol=0)


def test_second_writer_in_the_same_second_gets_its_own_file(tmp_path):
  a = tensorboard.SummaryWriter(str(tmp_path))
  b = tensorboard.SummaryWriter(str(tmp_path))
  a.scalar("x", 1.0, 1)
  b.scalar("x", 2.0, 2)
  a.close()
  b.close()
  a.close()  # closing twice is fine
  assert a.path != b.path and len(tensorboard.event_files(str(tmp_path))) == 2
  assert tensorboard.read_scalars(b.path) == [(2, "x", 2.0)]
  with pytest.raises(ValueError, match="closed"):
    a.scalar("x", 3.0, 3)


@pytest.mark.parametrize("where", ["length", "length_crc", "data", "data_crc"])
def test_a_corrupted_byte_is_refused(tmp_path, where):
  path, _ = _write_example(str(tmp_path))
  with open(path, "rb") as f:
    buf = bytearray(f.read())
  first_length = struct.unpack("<Q", buf[:8])[0]
  second = 12 + first_length + 4  # flip a byte of the second record (the first scalar)
  length = struct.unpack("<Q", buf[second:second + 8])[0]
  offset = {"length": 0, "length_crc": 9, "data": 12 + length // 2,
            "data_crc": 12 + length + 1}[where]
  buf[second + offset] ^= 0x01
  with open(path, "wb") as f:
    f.write(bytes(buf))
  with pytest.raises(ValueError, match="CRC mismatch|truncated"):
    tensorboard.read_scalars(path)


def test_a_truncated_file_is_refused(tmp_path):
  path, _ = _write_example(str(tmp_path))
  with open(path, "rb") as f:
    buf = f.read()
  with open(path, "wb") as f:
    f.write(buf[:-3])
  with pytest.raises(ValueError, match="truncated"):
    tensorboard.read_scalars(path)


def test_metric_writer_writes_the_jsonl_records_as_scalars(tmp_path):
  writer = metrics.MetricWriter(str(tmp_path))
  assert not os.path.exists(writer.tensorboard_dir)  # nothing until the first write
  writer.write(1, "train", {"loss": 1.5, "accuracy": 0.25, "examples": 16.0})
  writer.write(2, "validation", {"loss": 1.25, "accuracy": 0.5, "examples": 8.0})
  # On disk after every write, before close, like metrics.jsonl.
  (path,) = tensorboard.event_files(writer.tensorboard_dir)
  assert tensorboard.read_scalars(path) == [
      (1, "train/loss", 1.5), (1, "train/accuracy", 0.25), (1, "train/examples", 16.0),
      (2, "validation/loss", 1.25), (2, "validation/accuracy", 0.5),
      (2, "validation/examples", 8.0)]
  writer.close()
  writer.close()
  assert len(metrics.read_metrics(str(tmp_path))) == 2


def test_training_run_writes_the_event_file(tmp_path_factory, tmp_path):
  from lra import train
  from train_test import tiny_config
  data_dir = str(tmp_path_factory.mktemp("listops_data_tb"))
  workdir = str(tmp_path / "run")
  train.train_and_evaluate(tiny_config(data_dir), workdir)
  files = tensorboard.event_files(os.path.join(workdir, "tensorboard"))
  assert len(files) == 1 and os.path.basename(files[0]).startswith("events.out.tfevents.")
  scalars = tensorboard.read_scalars(files[0])
  tags = {tag for _, tag, _ in scalars}
  assert {"train/loss", "train/accuracy", "train/learning_rate", "train/steps_per_second",
          "validation/loss", "validation/accuracy", "test/loss", "test/accuracy"} <= tags
  # Every metrics.jsonl number is there, at float32 precision.
  by_key = {(step, tag): value for step, tag, value in scalars}
  records = metrics.read_metrics(workdir)
  assert [r["step"] for r in records if r["split"] == "train"] == [1, 2]
  for r in records:
    for name, value in r.items():
      if name not in ("step", "split", "time"):
        np.testing.assert_allclose(by_key[(r["step"], f"{r['split']}/{name}")], value, rtol=1e-6)
  assert len(scalars) == sum(len(r) - 3 for r in records)
