//! `outboard hw latency`: what each kind of device access costs on this machine.
//!
//! Numbers, not pass/fail: the evaluation suite (`outboard bench`) is where targets live.

use std::time::{Duration, Instant};

use outboard_drivers::virtio_blk::{BlkDriverOptions, BlkOp, BlkRequest, VirtioBlk};
use outboard_hw::{DeviceSpec, PciFunction};

struct Sample(Vec<f64>);

impl Sample {
    fn stat(&mut self, p: f64) -> f64 {
        self.0.sort_by(|a, b| a.total_cmp(b));
        let i = ((self.0.len() as f64 - 1.0) * p).round() as usize;
        self.0.get(i).copied().unwrap_or(f64::NAN)
    }
    fn row(mut self, what: &str, per_op: Option<f64>) {
        let (med, p99) = (self.stat(0.5), self.stat(0.99));
        let rate = per_op.map_or_else(String::new, |r| format!("{:>10.0}", r));
        println!("  {what:<44} {med:>9.2} {p99:>9.2} {rate}");
    }
}

fn time_each(n: u32, mut f: impl FnMut() -> Result<(), String>) -> Result<Sample, String> {
    let mut v = Vec::with_capacity(n as usize);
    for _ in 0..n {
        let t = Instant::now();
        f()?;
        v.push(t.elapsed().as_secs_f64() * 1e6);
    }
    Ok(Sample(v))
}

/// A fast deterministic sector sequence (xorshift), 4 KiB aligned.
struct Rng(u64);
impl Rng {
    fn sector(&mut self, capacity: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % (capacity / 8)) * 8
    }
}

pub fn run(spec: &DeviceSpec, n: u32) -> Result<(), String> {
    let e = |e: &dyn std::fmt::Display| e.to_string();
    let f = PciFunction::open(spec).map_err(|x| e(&x))?;
    println!("{spec}: {n} operations per row, times in microseconds");
    println!(
        "  {:<44} {:>9} {:>9} {:>10}",
        "measurement", "median", "p99", "ops/s"
    );

    // A trapped register: a configuration-space dword (one REGION_READ round trip over vfio-user).
    time_each(n, || f.config_read32(0).map(|_| ()).map_err(|x| e(&x)))?
        .row("trapped register read (config dword)", None);

    let mut d = VirtioBlk::new(f, BlkDriverOptions::default()).map_err(|x| e(&x))?;
    let info = d.info();
    if info.capacity < 64 {
        return Err("the disk is too small to measure".into());
    }
    let buf = d.function().dma().alloc(32 * 4096).map_err(|x| e(&x))?;
    let null = |d: &mut VirtioBlk| -> Result<(), String> {
        d.execute(BlkRequest {
            op: BlkOp::GetId,
            sector: 0,
            bufs: vec![(buf.iova(), 20)],
            tag: 0,
        })
        .map(|_| ())
        .map_err(|x| e(&x))
    };
    // The doorbell alone: what the driver pays to notify (an eventfd write for an ioeventfd).
    time_each(n, || d.notify(0).map_err(|x| e(&x)))?.row("doorbell write (queue notify)", None);
    for _ in 0..200 {
        null(&mut d)?;
    }
    let s = time_each(n, || null(&mut d))?;
    let rate = n as f64 / (s.0.iter().sum::<f64>() / 1e6);
    s.row("null request round trip (GET_ID, QD1)", Some(rate));

    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let cap = info.capacity;
    let s = time_each(n, || {
        let sector = rng.sector(cap);
        d.read(sector, &buf, 0, 4096).map(|_| ()).map_err(|x| e(&x))
    })?;
    let rate = n as f64 / (s.0.iter().sum::<f64>() / 1e6);
    s.row("4 KiB random read, QD1", Some(rate));

    // QD32: keep 32 requests in flight; latency is submit-to-completion per request.
    let mut started = vec![Instant::now(); 32];
    let mut lat = Vec::with_capacity(n as usize);
    let mut submitted = 0u32;
    let mut done = Vec::new();
    let t0 = Instant::now();
    while lat.len() < n as usize {
        while submitted < n && d.in_flight(0) < 32 {
            let slot = (submitted % 32) as u64;
            let r = BlkRequest {
                op: BlkOp::Read,
                sector: rng.sector(cap),
                bufs: vec![(buf.iova() + slot * 4096, 4096)],
                tag: slot,
            };
            started[slot as usize] = Instant::now();
            d.submit(0, &r).map_err(|x| e(&x))?;
            submitted += 1;
        }
        d.kick(0).map_err(|x| e(&x))?;
        done.clear();
        d.wait(0, &mut done, Duration::from_secs(10))
            .map_err(|x| e(&x))?;
        for c in &done {
            c.result.clone().map_err(|x| e(&x))?;
            lat.push(started[c.tag as usize].elapsed().as_secs_f64() * 1e6);
        }
    }
    let rate = n as f64 / t0.elapsed().as_secs_f64();
    Sample(lat).row("4 KiB random read, QD32", Some(rate));
    Ok(())
}
