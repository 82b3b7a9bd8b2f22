//! Builds the C test program against `include/outboard/block.h` and the static library, and
//! runs it against a driver server.

use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use outboard_devices::backing::Backing;
use outboard_drivers::virtio_blk::{BlkDriverOptions, VirtioBlk};
use outboard_drivers::virtio_block::VirtioBlock;
use outboard_hw::backend::in_process::InProcess;
use outboard_hw::PciFunction;
use outboard_server::DriverHost;

/// Builds the static library. `cargo test` refreshes only the rlib its tests link with, so a
/// C program linked against `liboutboard_capi.a` as left by an earlier build would test old
/// code.
fn static_lib() -> PathBuf {
    // target/<profile>/deps/c_header-… → target/<profile>/
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().and_then(|d| d.parent()).unwrap();
    let target_dir = profile_dir.parent().unwrap();
    let mut cmd = Command::new(env!("CARGO"));
    cmd.args([
        "build",
        "--quiet",
        "--lib",
        "-p",
        "outboard-capi",
        "--target-dir",
    ])
    .arg(target_dir);
    if profile_dir.file_name().is_some_and(|n| n == "release") {
        cmd.arg("--release");
    }
    let out = cmd.output().expect("run cargo");
    assert!(
        out.status.success(),
        "building the static library failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lib = profile_dir.join("liboutboard_capi.a");
    assert!(lib.exists(), "{} not built", lib.display());
    lib
}

#[test]
fn the_c_program_passes_against_a_driver_server() {
    let dir = tempfile::tempdir().unwrap();
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let bin = dir.path().join("block_test");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let out = Command::new(&cc)
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-o"])
        .arg(&bin)
        .arg(root.join("crates/capi/tests/c/block_test.c"))
        .arg("-I")
        .arg(root.join("include"))
        .arg(static_lib())
        .args(["-lpthread", "-ldl", "-lm", "-lrt", "-lutil", "-lgcc_s"])
        .output()
        .expect("a C compiler (cc) is installed");
    assert!(
        out.status.success(),
        "compiling the C test failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let model =
        outboard_devices::virtio_blk(Backing::open("mem:1M", None).unwrap(), Default::default())
            .unwrap();
    let f = PciFunction::with_backend(
        "in-process".into(),
        Arc::new(InProcess::new(Box::new(model))),
    )
    .unwrap();
    let host = VirtioBlock::new(
        "disk0",
        VirtioBlk::new(f, BlkDriverOptions::default()).unwrap(),
    );
    let sock = dir.path().join("host.sock");
    let (stop, t) = DriverHost::bind(
        &sock,
        vec![{
            let env = host.env();
            outboard_block_server::BlockDispatcher::served(host, env)
        }],
    )
    .unwrap()
    .spawn();

    let run = Command::new(&bin).arg(&sock).output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(run.status.success(), "{text}");
    assert!(text.contains("all checks passed"), "{text}");
    stop.store(true, Ordering::Relaxed);
    t.join().unwrap().unwrap();
}

/// The C library carries the client side only: no device model, no manager, no driver server.
/// A crate that is linked leaves its mangled name in the archive's symbols and paths.
#[test]
fn the_c_library_links_neither_device_models_nor_the_manager_nor_the_server() {
    let bytes = std::fs::read(static_lib()).unwrap();
    let contains = |needle: &str| bytes.windows(needle.len()).any(|w| w == needle.as_bytes());
    assert!(
        contains("outboard_client"),
        "the check itself is broken: the client library's name is not in the archive"
    );
    for absent in ["outboard_devices", "outboard_manager", "outboard_server"] {
        assert!(!contains(absent), "liboutboard_capi.a contains {absent}");
    }
}
