"""The stage-0 dataset on disk: Parquet shards, per-shard records and a manifest.

Layout of an output directory::

    config.json           the run's settings (a resumed run must match them)
    shard-00000.parquet   the rows of prompts [0, shard_size), one row per rollout
    shard-00000.json      the shard's record: counts and costs; written after its Parquet
    ...
    manifest.json         every completed shard's record, in order, and whether all are done
    stats.json            the run's summary

Every file is written to a temporary name and renamed into place, and a shard counts as
done only once its record exists, so a run killed at any point leaves complete shards and
nothing else that a rerun would trust. Records, not the manifest, are the source of truth:
each process writes its own shards' records, and the manifest is rebuilt from them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from datasets import Dataset, Features, List, Value

from cospec.errors import CoSpecError

CONFIG_FILE = "config.json"
MANIFEST_FILE = "manifest.json"
STATS_FILE = "stats.json"

MISMATCH_FEATURES = {
    "round_index": Value("int32"),
    "context_length": Value("int32"),
    "draft_tokens": List(Value("int32")),
    "target_tokens": List(Value("int32")),
    "position": Value("int32"),
    "draft_prob": Value("float64"),
    "target_prob": Value("float64"),
    "label": Value("int8"),
    "weight": Value("float32"),
    "outcome": Value("string"),
    "draft_branch_correct": Value("bool"),
}
FEATURES = Features({
    "rollout_id": Value("string"),
    "prompt_index": Value("int64"),
    "family": Value("string"),
    "kind": Value("string"),
    "sequence_ids": List(Value("int32")),
    "prompt_length": Value("int32"),
    "completion": Value("string"),
    "target_branch_correct": Value("bool"),
    "mismatches": List(MISMATCH_FEATURES),
})


def shard_stem(index: int) -> str:
    return f"shard-{index:05d}"


def write_atomic(path: Path, data: bytes) -> None:
    """Write to a temporary sibling and rename it over ``path`` (atomic on POSIX)."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json(path: Path, data: Any) -> None:
    write_atomic(path, (json.dumps(data, indent=2, sort_keys=True) + "\n").encode())


def write_shard(output_dir: Path, index: int, rows: list[dict[str, Any]],
                record: dict[str, Any]) -> None:
    """The shard's Parquet file, then its record (which marks the shard done)."""
    table = pa.Table.from_pylist(rows, schema=FEATURES.arrow_schema)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    write_atomic(output_dir / f"{shard_stem(index)}.parquet", sink.getvalue().to_pybytes())
    write_json(output_dir / f"{shard_stem(index)}.json", record)


def remove_temporaries(output_dir: Path) -> None:
    """Temporary files of a killed run; no process may be writing when this runs."""
    for path in output_dir.glob("*.tmp-*"):
        path.unlink(missing_ok=True)


def completed_shards(output_dir: Path, num_shards: int, fingerprint: str) -> dict[int, dict]:
    """Records of the shards that are done (record and Parquet file present) for this run."""
    done = {}
    for index in range(num_shards):
        record_path = output_dir / f"{shard_stem(index)}.json"
        if not record_path.is_file() or not (output_dir / f"{shard_stem(index)}.parquet").is_file():
            continue
        record = json.loads(record_path.read_text())
        if record.get("fingerprint") == fingerprint:
            done[index] = record
    return done


def write_manifest(output_dir: Path, config: dict[str, Any], fingerprint: str,
                   num_shards: int, records: dict[int, dict]) -> dict[str, Any]:
    manifest = {
        "fingerprint": fingerprint,
        "num_shards": num_shards,
        "complete": len(records) == num_shards,
        "shards": [records[i] for i in sorted(records)],
        "config": config,
    }
    write_json(output_dir / MANIFEST_FILE, manifest)
    return manifest


def read_manifest(output_dir: str | Path) -> dict[str, Any]:
    path = Path(output_dir) / MANIFEST_FILE
    if not path.is_file():
        raise CoSpecError(f"{str(output_dir)!r} has no {MANIFEST_FILE}; is it a data-gen output "
                          "directory?")
    return json.loads(path.read_text())


def load_data_gen(output_dir: str | Path, allow_partial: bool = False) -> Dataset:
    """The dataset of a data-gen run: its shards concatenated in order (prompt order).

    A run that has not finished is refused unless ``allow_partial`` (then the completed
    shards are returned, in order).
    """
    output_dir = Path(output_dir)
    manifest = read_manifest(output_dir)
    if not manifest["complete"] and not allow_partial:
        raise CoSpecError(
            f"{str(output_dir)!r} holds {len(manifest['shards'])} of {manifest['num_shards']} "
            "shards; rerun the same command to finish it (or pass allow_partial=True)"
        )
    tables = [pq.read_table(output_dir / record["file"]) for record in manifest["shards"]]
    if not tables:
        return Dataset(FEATURES.arrow_schema.empty_table())
    return Dataset(pa.concat_tables(tables))


def merge_counts(records: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Sum nested count dictionaries (the ``counts`` of shard records)."""
    total: dict[str, Any] = {}
    for record in records:
        _add(total, record)
    return total


def _add(total: dict[str, Any], part: dict[str, Any]) -> None:
    for key, value in part.items():
        if isinstance(value, dict):
            _add(total.setdefault(key, {}), value)
        else:
            total[key] = total.get(key, 0) + value
