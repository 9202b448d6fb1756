"""The prepared-prompts file: a dataset's prompts, cached as JSONL or Parquet.

One record per Prompt, the fields a dataset fills (token ids come later). Parquet stores the
free-form ones as JSON text, since labels may change type from row to row.
"""

from __future__ import annotations

import json
from pathlib import Path

from palaestra.types import Prompt

OUTPUT_FORMATS = ("jsonl", "parquet")
_JSON_FIELDS = ("messages", "label", "metadata")


def encode_prompts(prompts: list[Prompt], fmt: str) -> bytes:
    records = [
        {"index": p.index, "text": p.text, **{k: getattr(p, k) for k in _JSON_FIELDS}}
        for p in prompts
    ]
    if fmt == "jsonl":
        lines = (json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in records)
        return "".join(lines).encode("utf-8")
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "index": [r["index"] for r in records],
            "text": [r["text"] for r in records],
            **{
                k: [json.dumps(r[k], ensure_ascii=False, default=str) for r in records]
                for k in _JSON_FIELDS
            },
        }
    )
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()


def read_prompts(path: Path) -> list[Prompt]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
        return [Prompt(**{**r, **{k: json.loads(r[k]) for k in _JSON_FIELDS}}) for r in rows]
    lines = path.read_text(encoding="utf-8").splitlines()
    return [Prompt(**json.loads(line)) for line in lines if line]
