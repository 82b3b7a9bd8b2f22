#!/usr/bin/env bash
# Outboard's main job on its embedded default: an emulated virtio-blk disk in its own process,
# driven over vfio-user by Outboard's virtio-blk driver in another process.
set -euo pipefail
cd "$(dirname "$0")"
cargo build --release --quiet --bin outboard
B=target/release/outboard
DIR=$(mktemp -d)
SOCK="$DIR/blk.sock"
cleanup() {
    [ -n "${DEV:-}" ] && kill "$DEV" 2>/dev/null && wait "$DEV" 2>/dev/null || true
    rm -rf "$DIR"
}
trap cleanup EXIT INT TERM
"$B" device virtio-blk --socket "$SOCK" --backing mem:64M &
DEV=$!
for _ in $(seq 100); do [ -S "$SOCK" ] && break; sleep 0.05; done
[ -S "$SOCK" ] || { echo "device model did not start" >&2; exit 1; }
echo; echo "== outboard hw probe"
"$B" hw probe --vfio-user "$SOCK"
echo; echo "== outboard hw selftest --write"
"$B" hw selftest --vfio-user "$SOCK" --write
echo; echo "== outboard hw latency"
"$B" hw latency --vfio-user "$SOCK" --iterations 5000
