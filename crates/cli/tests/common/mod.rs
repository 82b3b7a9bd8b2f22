//! Helpers shared by the CLI's integration tests: start device models as real processes.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A device model process, killed on drop.
pub struct DeviceProcess {
    pub child: Child,
    pub socket: PathBuf,
}

impl DeviceProcess {
    /// Starts `outboard device virtio-blk` with extra arguments and waits for its socket.
    pub fn virtio_blk(dir: &Path, backing: &str, extra: &[&str]) -> Self {
        let socket = dir.join("blk.sock");
        let child = Command::new(env!("CARGO_BIN_EXE_outboard"))
            .args(["device", "virtio-blk", "--socket"])
            .arg(&socket)
            .args(["--backing", backing])
            .args(extra)
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn outboard device");
        let deadline = Instant::now() + Duration::from_secs(10);
        while !socket.exists() {
            assert!(
                Instant::now() < deadline,
                "device model did not create its socket"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        Self { child, socket }
    }

    /// Whether the process is still running.
    pub fn alive(&mut self) -> bool {
        self.child.try_wait().expect("try_wait").is_none()
    }

    /// Sends SIGTERM and waits for a clean exit.
    pub fn terminate(mut self) -> std::process::ExitStatus {
        rustix::process::kill_process(
            rustix::process::Pid::from_child(&self.child),
            rustix::process::Signal::TERM,
        )
        .expect("kill");
        self.child.wait().expect("wait")
    }
}

impl Drop for DeviceProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A deterministic byte pattern distinct per seed.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}
