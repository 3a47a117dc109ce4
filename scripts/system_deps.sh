#!/usr/bin/env bash
# System packages the tests use that pip cannot install: Debian's prometheus (prometheus, promtool)
# for the observability tests (tests/deploy). Installs them when missing and apt-get can run (root
# or passwordless sudo); otherwise says what to install and leaves those tests to skip.
set -euo pipefail
command -v promtool >/dev/null 2>&1 && exit 0
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if sudo -n true 2>/dev/null; then SUDO="sudo -n"; else
    echo "system_deps: promtool missing and no root: apt-get install prometheus (tests/deploy skip without it)" >&2
    exit 0
  fi
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "system_deps: promtool missing and no apt-get: install Prometheus 2.x (tests/deploy skip without it)" >&2
  exit 0
fi
echo "system_deps: installing Debian's prometheus (promtool) ..." >&2
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
