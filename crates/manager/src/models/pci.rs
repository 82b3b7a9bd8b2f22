//! A PCI function of this machine, bound to `vfio-pci`, instead of a model: `pci = "BDF"` in
//! a `[[device]]` table (no `model`). There is no process to start; the driver server opens the
//! function through VFIO. Whether the function can be used (present, bound to `vfio-pci`, its
//! IOMMU group viable) is checked when the machine comes up, where the host is looked at.

use std::collections::BTreeMap;

use super::{KeyError, Keys, Settled};
use crate::config::DeviceConfig;

/// The name a PCI function's device has where a model's name would be.
pub const NAME: &str = "pci";

pub(super) fn settle(
    keys: &Keys,
    dev_at: usize,
    others: &[DeviceConfig],
) -> Result<Settled, KeyError> {
    let given = keys.get("pci").ok_or((
        dev_at,
        "pci = \"BDF\": the function's PCI address".to_string(),
    ))?;
    let bdf = outboard_hw::host::canonical(&given.value).map_err(|e| (given.at, e.to_string()))?;
    if let Some(o) = others.iter().find(|o| address(o) == Some(bdf.as_str())) {
        return Err((
            given.at,
            format!("pci = {bdf:?}: device {} already has this function", o.name),
        ));
    }
    let mut settings = BTreeMap::new();
    settings.insert("pci".to_string(), bdf.clone());
    Ok(Settled {
        backing: format!("pci:{bdf}"),
        settings,
    })
}

/// The function's address, for a device that is one.
pub fn address(d: &DeviceConfig) -> Option<&str> {
    (d.model == NAME)
        .then(|| d.settings.get("pci").map(String::as_str))
        .flatten()
}

/// The driver server opens the function through VFIO.
pub(super) fn spec(d: &DeviceConfig) -> String {
    format!("vfio:{}", address(d).unwrap_or_default())
}
