//! A C driver's active probe (`probe` in `include/outboard/driver.h`): run inside an `osenv`
//! environment of its own whose device is a snapshot of the function's configuration space,
//! so the probe looks and cannot touch (`outboard_osenv::Osenv::for_probe`).

use outboard_hw::ConfigSnapshot;
use outboard_osenv::Osenv;

use super::descriptor::CDriver;
use crate::personality::Probe;

/// C driver `c`'s bid for the device `dev` its ids took, starting from `initial`: its
/// probe's, or `initial` if it has none; `Err` says why it declines.
pub fn probe_c(c: &CDriver, dev: &Probe<'_>, initial: u32) -> Result<u32, String> {
    if !c.has_probe() {
        return Ok(initial);
    }
    let Probe::Pci(f) = dev else {
        return Err(format!("{} drives PCI functions", c.name));
    };
    let snapshot = f
        .snapshot()
        .map_err(|e| format!("the device cannot be looked at: {e}"))?;
    run(c, snapshot, initial)
}

/// Runs `c`'s probe on `snapshot` in this process.
pub fn run(c: &CDriver, snapshot: ConfigSnapshot, initial: u32) -> Result<u32, String> {
    let env =
        Osenv::for_probe(&c.name, snapshot).map_err(|e| format!("its probe's environment: {e}"))?;
    let bid = {
        let _inside = env.enter();
        c.call_probe(initial)
    };
    // The environment (its interrupt thread) ends before the answer is used.
    drop(env);
    bid.map_err(|(rc, why)| {
        if why.is_empty() {
            format!("its probe declines the device (error {rc})")
        } else {
            format!("its probe declines the device: {why}")
        }
    })
}
