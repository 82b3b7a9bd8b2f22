#!/usr/bin/env bash
# Runs Outboard's whole test suite on a fresh Debian 12 machine. Installs what the tests need.
set -euo pipefail
cd "$(dirname "$0")"

need_apt=()
command -v cc >/dev/null || need_apt+=(build-essential)
command -v pkg-config >/dev/null || need_apt+=(pkg-config)
# The NBD export's TLS-PSK (OpenSSL; rustls has no external pre-shared keys).
dpkg -s libssl-dev >/dev/null 2>&1 || need_apt+=(libssl-dev)
# The evaluation suite's kernel baselines and charts.
command -v fio >/dev/null || need_apt+=(fio)
command -v losetup >/dev/null || need_apt+=(mount)
[ -f /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ] || need_apt+=(fonts-dejavu-core)
# The QEMU guest tests (real VFIO behind an emulated IOMMU, against QEMU's own devices).
command -v qemu-system-x86_64 >/dev/null || need_apt+=(qemu-system-x86)
# The guest's initramfs needs a static busybox (Debian's plain busybox is dynamic).
ldd /bin/busybox 2>&1 | grep -q "not a dynamic executable" || need_apt+=(busybox-static)
command -v cpio >/dev/null || need_apt+=(cpio)
command -v xz >/dev/null || need_apt+=(xz-utils)
command -v strip >/dev/null || need_apt+=(binutils)
# A C driver built outside the tree against the installed headers (tests/driver_lib.rs).
command -v pkg-config >/dev/null || need_apt+=(pkg-config)
command -v cc >/dev/null || need_apt+=(gcc)
# The NBD export's peers: libnbd's nbdinfo and nbdcopy, QEMU's qemu-img and qemu-io (fio's
# nbd engine comes with Debian's fio).
command -v nbdcopy >/dev/null || need_apt+=(libnbd-bin)
command -v qemu-io >/dev/null || need_apt+=(qemu-utils)
# The exports benchmark's peer (qemu-storage-daemon comes with qemu-system-x86).
command -v nbdkit >/dev/null || need_apt+=(nbdkit)
# The remote-disk test joins two network namespaces with a veth pair.
command -v ip >/dev/null || need_apt+=(iproute2)
# The TAP export's test: ping and iperf3 between two network namespaces over Outboard NICs.
command -v ping >/dev/null || need_apt+=(iputils-ping)
command -v iperf3 >/dev/null || need_apt+=(iperf3)
# The echo benchmark's kernel baseline and TAP configuration: sockperf between two namespaces.
command -v sockperf >/dev/null || need_apt+=(sockperf)
# The metrics endpoint's test reads it with a scraper's own parser (prometheus_client's
# OpenMetrics parser).
/usr/bin/python3 -c "import prometheus_client.openmetrics.parser" 2>/dev/null \
    || need_apt+=(python3-prometheus-client)
if [ ${#need_apt[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ]; then
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq "${need_apt[@]}"
    else
        echo "test.sh: please install: ${need_apt[*]}" >&2
        exit 1
    fi
fi
if ! command -v cargo >/dev/null; then
    [ -x "$HOME/.cargo/bin/cargo" ] && export PATH="$HOME/.cargo/bin:$PATH"
fi
command -v cargo >/dev/null || { echo "test.sh: Rust (cargo) is required: https://rustup.rs" >&2; exit 1; }

# No incremental caches: this is a one-shot build, and they would double the disk it takes.
export CARGO_INCREMENTAL=0

# Formatting and lints first: cheap, and they fail fast.
rustup component list --installed 2>/dev/null | grep -q rustfmt || rustup component add rustfmt
rustup component list --installed 2>/dev/null | grep -q clippy || rustup component add clippy
cargo fmt --all --check
cargo clippy --workspace --all-targets --locked -- -D warnings

# Miri and the fuzzers need a nightly toolchain; where there is none, say so and carry on.
if rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
    rustup component add --toolchain nightly miri rust-src >/dev/null 2>&1 || true
fi
# Miri: undefined behaviour in the unsafe accessors of shm and in the session ring.
if cargo +nightly miri --version >/dev/null 2>&1; then
    MIRIFLAGS=-Zmiri-disable-isolation PROPTEST_CASES=4 \
        cargo +nightly miri test --locked -p outboard-shm -p outboard-session --lib
    # Miri's and the fuzzers' builds are used once here; the disk they hold goes to the tests.
    rm -rf target/miri
else
    echo "test.sh: no nightly toolchain with Miri here: the Miri run is skipped"
fi
# Fuzzing: a short run of every target from the kept corpus (scripts/fuzz.sh 600 is the long
# run). The corpus also replays on stable in the ordinary tests below.
if cargo +nightly --version >/dev/null 2>&1 &&
    { command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked; }; then
    scripts/fuzz.sh "${OUTBOARD_FUZZ_SECONDS:-20}"
    rm -rf fuzz/target
else
    echo "test.sh: no nightly toolchain or cargo-fuzz here: the fuzz run is skipped"
fi

# The tests last, so that their results close the output.
cargo test --workspace --locked
# The ring protocol and doorbell rule, model-checked over all interleavings.
RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test --locked --release -p outboard-session --test loom
