//! The virtio-rng model: an emulated entropy source. Its one key, `seed`, makes it give a
//! seeded generator's bytes instead of the operating system's (tests that must know what a
//! driver reads); without it the bytes come from `getrandom`.

use std::collections::BTreeMap;

use super::{KeyError, Keys, Launch, ModelError, Settled};
use crate::children::{ModelOwn, VirtioRngOwn};
use crate::config::DeviceConfig;

pub(super) fn settle(keys: &Keys, _: usize, _: &[DeviceConfig]) -> Result<Settled, KeyError> {
    let mut settings = BTreeMap::new();
    let backing = match keys.get("seed") {
        None => "getrandom".to_string(),
        Some(s) => {
            let seed: u64 = s
                .value
                .parse()
                .map_err(|_| (s.at, format!("seed = {}: a number from 0 up", s.value)))?;
            settings.insert("seed".to_string(), seed.to_string());
            format!("seed:{seed}")
        }
    };
    Ok(Settled { backing, settings })
}

pub(super) fn launch(d: &DeviceConfig, _: i32) -> Result<Launch, ModelError> {
    // The seed was checked when the description was read.
    let seed = d.settings.get("seed").and_then(|s| s.parse().ok());
    Ok(Launch {
        own: ModelOwn::VirtioRng(VirtioRngOwn { seed }),
        fds: Vec::new(),
    })
}
