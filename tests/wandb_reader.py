"""Read an offline W&B run back from its ``.wandb`` transaction log (test helper).

wandb 0.31 no longer ships a Python reader for this file (its service is written in Go), so this
reads the LevelDB-style log framing (``:W&B`` header, 32 KiB blocks, records with a CRC32 and a
FULL/FIRST/MIDDLE/LAST type) and decodes each record with wandb's own protobuf ``Record`` message.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from typing import Any, Dict, List

BLOCK = 32768
HEADER = 7


def records(path: Path) -> List[Any]:
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", "not a W&B transaction log"
    out, buf, pos = [], b"", HEADER
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:
            pos += left
            continue
        crc, length, typ = struct.unpack("<IHB", data[pos:pos + HEADER])
        if typ == 0 and length == 0:
            pos += left
            continue
        if pos + HEADER + length > len(data):
            break  # a record still being written
        chunk = data[pos + HEADER:pos + HEADER + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([typ]))) & 0xFFFFFFFF == crc, f"bad checksum at byte {pos}"
        pos += HEADER + length
        if typ == 1:
            full = chunk
        elif typ == 2:
            buf = chunk
            continue
        elif typ == 3:
            buf += chunk
            continue
        else:
            full, buf = buf + chunk, b""
        rec = pb.Record()
        rec.ParseFromString(full)
        out.append(rec)
    return out


def _key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)


def read_run(run_dir: Path, wait: float = 60.0) -> Dict[str, Any]:
    """history rows, final summary, config, alerts, files, the run record (id, project, name, notes, tags)
    and whether the exit record is there.

    wandb's service writes the log asynchronously: wait (up to ``wait`` seconds) for the exit record.
    """
    import time

    deadline = time.monotonic() + wait
    while True:
        out = _read(run_dir)
        if out["exited"] or time.monotonic() > deadline:
            return out
        time.sleep(0.2)


def _read(run_dir: Path) -> Dict[str, Any]:
    path = next(Path(run_dir).glob("run-*.wandb"))
    history, summary, config, alerts, files, exited = [], {}, {}, [], [], False
    run: Dict[str, Any] = {}
    for rec in records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            history.append({_key(i): json.loads(i.value_json) for i in rec.history.item})
        elif kind == "summary":
            for i in rec.summary.update:
                summary[_key(i)] = json.loads(i.value_json)
        elif kind == "config":
            for i in rec.config.update:
                config[_key(i)] = json.loads(i.value_json)
        elif kind == "alert":
            alerts.append({"title": rec.alert.title, "text": rec.alert.text, "level": rec.alert.level})
        elif kind == "files":
            files += [f.path for f in rec.files.files]
        elif kind == "run":
            # The run record is re-sent when notes or tags change: the last one wins.
            run = {"id": rec.run.run_id, "project": rec.run.project, "name": rec.run.display_name,
                   "notes": rec.run.notes, "tags": list(rec.run.tags)}
        elif kind == "exit":
            exited = True
    return {"history": history, "summary": summary, "config": config, "alerts": alerts, "files": files,
            "exited": exited, "run": run}
