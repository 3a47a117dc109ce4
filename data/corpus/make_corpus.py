"""Rebuild ``agent_messages.jsonl`` from the agentic request trace (see README.md).

Usage: ``python data/corpus/make_corpus.py /path/to/agent_sessions.jsonl``. Writes every distinct
message content of the trace once, in first-seen order, as ``{"source", "role", "content"}`` lines,
stopping before the file would pass ``MAX_BYTES``. The output is deterministic for a given input.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

MAX_BYTES = 2_000_000


def _distinct_messages(trace: str) -> Iterator[str]:
    seen: set[str] = set()
    with open(trace, encoding="utf-8") as f:
        for raw in f:
            call = json.loads(raw)
            source = call["session_id"].split("/", 1)[0]
            for msg in call["messages"]:
                content = msg["content"]
                if content and content not in seen:
                    seen.add(content)
                    row = {"source": source, "role": msg["role"], "content": content}
                    yield json.dumps(row, ensure_ascii=False) + "\n"


def main(trace: str) -> None:
    out = Path(__file__).with_name("agent_messages.jsonl")
    lines: list[str] = []
    size = 0
    for line in _distinct_messages(trace):
        n = len(line.encode("utf-8"))
        if size + n > MAX_BYTES:
            break
        lines.append(line)
        size += n
    out.write_text("".join(lines), encoding="utf-8")
    print(f"{out}: {len(lines)} messages, {size} bytes")


if __name__ == "__main__":
    main(sys.argv[1])
