//! A null-request client for profiling the session path against a running driver server:
//! `cargo run --release -p outboard-bench --example null_client -- SOCKET DEVICE N [adaptive]`.
//! Prints the median round trip.

use std::path::PathBuf;
use std::time::Duration;

use outboard_block_client::{BlockClient, SessionOptions, WaitMode};

fn main() {
    let a: Vec<String> = std::env::args().collect();
    let (sock, dev) = (PathBuf::from(&a[1]), &a[2]);
    let n: usize = a[3].parse().expect("N");
    let mode = if a.get(4).is_some_and(|m| m == "adaptive") {
        WaitMode::Adaptive(Duration::from_micros(20))
    } else {
        WaitMode::Blocking
    };
    let mut d = BlockClient::open(
        &sock,
        dev,
        SessionOptions {
            mode,
            ..Default::default()
        },
    )
    .expect("open");
    let mut v = outboard_bench::workloads::null_latencies(&mut d, n).expect("null requests");
    println!(
        "median {:.2} µs over {n}",
        outboard_bench::stats::median(&mut v)
    );
}
