//! The PCI timer model (`docs/timer.md`): a periodic interrupt and a free-running counter,
//! driven by the C timer driver and served as a clock. Its one key, `hz`, is the tick rate at
//! power-on (1 to 100,000; 1000 if not given).

use std::collections::BTreeMap;

use super::{KeyError, Keys, Launch, ModelError, Settled};
use crate::children::{ModelOwn, TimerOwn};
use crate::config::DeviceConfig;

/// The rate without a `hz` key.
const DEFAULT_HZ: u32 = 1000;

pub(super) fn settle(keys: &Keys, _: usize, _: &[DeviceConfig]) -> Result<Settled, KeyError> {
    let hz = match keys.get("hz") {
        None => DEFAULT_HZ,
        Some(h) => h
            .value
            .parse::<u32>()
            .ok()
            .filter(|hz| (1..=100_000).contains(hz))
            .ok_or_else(|| (h.at, format!("hz = {}: a rate from 1 to 100000", h.value)))?,
    };
    let mut settings = BTreeMap::new();
    settings.insert("hz".to_string(), hz.to_string());
    Ok(Settled {
        backing: format!("{hz} Hz"),
        settings,
    })
}

pub(super) fn launch(d: &DeviceConfig, _: i32) -> Result<Launch, ModelError> {
    // The rate was checked when the description was read.
    let hz = d
        .settings
        .get("hz")
        .and_then(|s| s.parse().ok())
        .unwrap_or(DEFAULT_HZ);
    Ok(Launch {
        own: ModelOwn::Timer(TimerOwn { hz }),
        fds: Vec::new(),
    })
}
