//! The PCI 16550 UART (QEMU's pci-serial), driven by the C 16550 driver and served as a char
//! device. Its one key, `line`, is the far end of its line on this host: `pty`, `socket:PATH`,
//! `listen:PATH`, `file:PATH` (paths absolute), `loopback` or `null` (the default).

use std::collections::BTreeMap;

use outboard_devices::serial_line::LineSpec;

use super::{KeyError, Keys, Launch, ModelError, Settled};
use crate::children::{ModelOwn, SerialOwn};
use crate::config::DeviceConfig;

pub(super) fn settle(keys: &Keys, _: usize, _: &[DeviceConfig]) -> Result<Settled, KeyError> {
    let line = match keys.get("line") {
        None => LineSpec::Null,
        Some(l) => {
            let spec = LineSpec::parse(&l.value).map_err(|e| (l.at, format!("line = {e}")))?;
            let relative = match &spec {
                LineSpec::Connect(p) | LineSpec::Listen(p) | LineSpec::File(p) => !p.is_absolute(),
                _ => false,
            };
            if relative {
                return Err((
                    l.at,
                    format!("line = {:?}: the path must be absolute", l.value),
                ));
            }
            spec
        }
    };
    let mut settings = BTreeMap::new();
    settings.insert("line".to_string(), line.to_string());
    Ok(Settled {
        backing: format!("line {line}"),
        settings,
    })
}

pub(super) fn launch(d: &DeviceConfig, _: i32) -> Result<Launch, ModelError> {
    // The line was checked when the description was read.
    let line = d
        .settings
        .get("line")
        .and_then(|s| LineSpec::parse(s).ok())
        .unwrap_or(LineSpec::Null);
    Ok(Launch {
        own: ModelOwn::Serial(SerialOwn { line }),
        fds: Vec::new(),
    })
}
