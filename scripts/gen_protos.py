"""Regenerate the Python code of protos/swaserve/v1/*.proto into swaserve/v1/ (committed).

Usage: ``python scripts/gen_protos.py [OUT_DIR]`` (default: the repository root). Run it after
editing a .proto; ``tests/test_protos.py`` fails when the committed code and the protos drift.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"


def generate(out: Path) -> list[Path]:
    """Run protoc (grpcio-tools) on every proto; returns the files written under ``out``."""
    from grpc_tools import protoc

    files = sorted(PROTOS.rglob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTOS}",
        f"-I{include}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *(str(f.relative_to(PROTOS)) for f in files),
    ]
    cwd = Path.cwd()
    try:
        import os

        os.chdir(PROTOS)
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed")
    finally:
        os.chdir(cwd)
    written = sorted((out / "swaserve" / "v1").glob("*_pb2*.py*"))
    init = out / "swaserve" / "v1" / "__init__.py"
    init.write_text('"""Generated gRPC/protobuf code of protos/swaserve/v1 (scripts/gen_protos.py)."""\n')
    return [*written, init]


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    for p in generate(target):
        print(p)
