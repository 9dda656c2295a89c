"""Read the records of a W&B `.wandb` run file (a LevelDB-style log of protobuf Records) to check what it holds."""

from __future__ import annotations

import struct
from pathlib import Path

from wandb.proto import wandb_internal_pb2

_FILE_HEADER = 7  # ":W&B", magic (2 bytes), version (1 byte)
_BLOCK = 32 * 1024
_RECORD_HEADER = 7  # crc32 (4), length (2), type (1)
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def records(path: Path):
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", "not a W&B run file"
    offset, pending = _FILE_HEADER, b""
    while offset + _RECORD_HEADER <= len(data):
        left_in_block = _BLOCK - offset % _BLOCK
        if left_in_block < _RECORD_HEADER:  # the block's tail is padding
            offset += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[offset:offset + _RECORD_HEADER])
        offset += _RECORD_HEADER
        chunk, offset = data[offset:offset + length], offset + length
        if kind == 0 and length == 0:
            break
        pending = chunk if kind in (_FULL, _FIRST) else pending + chunk
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def run_config(path: Path) -> tuple[str, dict]:
    """(run id, config as {key: json text}) from the run record and any later config updates."""
    run_id, config = None, {}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
            config.update({item.key: item.value_json for item in record.run.config.update})
        elif kind == "config":
            config.update({item.key: item.value_json for item in record.config.update})
    return run_id, config
