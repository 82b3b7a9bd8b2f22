#!/usr/bin/env bash
# Fuzzes every parser of outside input (see crates/fuzz-targets): a long run is
#   scripts/fuzz.sh            # 10 minutes per target
#   scripts/fuzz.sh 60 session_ring control_message   # 60 s, two targets
# New corpus entries land in fuzz/corpus/<target>/ (commit them after `cargo fuzz cmin`);
# crashes land in fuzz/artifacts/<target>/ and make this script fail.
# Needs a nightly toolchain and cargo-fuzz (installed here if missing).
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
secs="${1:-600}"
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(vfio_user_server vfio_user_client session_ring control_message machine_description nbd_stream packet_filter net_stream driver_library_messages)
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
cargo +nightly fuzz build -O
for t in "${targets[@]}"; do
    echo "== $t: ${secs}s"
    # -rss_limit_mb: the server target maps DMA memory; -timeout: no input may take a second.
    set +e
    cargo +nightly fuzz run -O "$t" "corpus/$t" -- \
        -max_total_time="$secs" -rss_limit_mb=4096 -timeout=5 -print_final_stats=1 \
        2>&1 | tee "/tmp/outboard-fuzz-$t.log" | grep -E "^#[0-9]+[[:space:]]+(INITED|DONE)|stat::number_of_executed_units|ERROR|panicked"
    status=${PIPESTATUS[0]}
    set -e
    # A target that dies without an artifact (a signal libFuzzer does not catch) fails too.
    if [ "$status" -ne 0 ]; then
        echo "$t: the fuzzer stopped with status $status: see /tmp/outboard-fuzz-$t.log" >&2
        exit 1
    fi
    if [ -n "$(find "artifacts/$t" \( -name 'crash-*' -o -name 'timeout-*' -o -name 'leak-*' -o -name 'oom-*' \) 2>/dev/null)" ]; then
        echo "$t: the fuzzer found a failure: see fuzz/artifacts/$t and /tmp/outboard-fuzz-$t.log" >&2
        exit 1
    fi
done
