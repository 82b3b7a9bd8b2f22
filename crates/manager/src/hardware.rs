//! Devices that are PCI functions of this machine (`pci = "ADDRESS"`): checked where the host
//! is looked at — present, bound to `vfio-pci`, its IOMMU group viable — each refusal saying
//! what to do; then probed through VFIO the way its driver will see it and matched like a
//! model's function, and shown on the registry's `pci` bus with its address and IOMMU group.
//! There is no process to start for it: its driver server opens it.

use outboard_hw::host::{HostView, Viability, VFIO_PCI};

use super::*;
use crate::launch::{function_node, probe_function};

impl Manager {
    /// Claims each of `devices` that is a PCI function, adding it to the `pci` bus.
    pub(crate) fn claim_functions(&mut self, devices: &[DeviceConfig]) -> Result<(), ManagerError> {
        let host = HostView::real();
        let mut bus = Node::new("bus", "pci");
        for d in devices
            .iter()
            .filter(|d| d.model().kind == models::Kind::Hardware)
        {
            let bdf = models::pci::address(d).unwrap_or_default();
            let refuse = |why: String| ManagerError::Function {
                device: d.name.clone(),
                why,
            };
            let group = usable(&host, bdf).map_err(refuse)?;
            // VFIO gives a group to one process at a time, and each device's server claims
            // its own container: two devices whose functions share a group cannot both run.
            // Those claimed before, and those claimed in this pass (not yet on the registry).
            let claimed = self.registry.find("bus", "pci").into_iter();
            let functions = claimed.chain([&bus]).flat_map(|b| b.children.iter());
            if let Some(other) = in_group(functions, group, &d.name) {
                return Err(refuse(format!(
                    "{bdf} shares IOMMU group {group} with {other}'s function: one driver server \
                     would have to drive both, which is not supported yet; describe one of them"
                )));
            }
            let (kind, name) = function_node(d);
            let mut node = Node::new(kind, &name)
                .with("model", d.model.as_str())
                .with("address", bdf)
                .with("iommu-group", group)
                .with("backing", d.backing.as_str())
                .with("state", State::Running.word());
            // The manager holds the function only while it probes it: released, it is free
            // for the driver server (VFIO gives a group to one process at a time).
            let driver = probe_function(d, &DeviceSpec::Vfio(bdf.to_string()), &mut node)?;
            bus.children.push(node.child(driver));
        }
        self.merge_bus(bus);
        Ok(())
    }
}

impl Manager {
    /// The IOMMU group of device `d`'s function, as claimed (its registry node says).
    pub(crate) fn iommu_group(&self, d: &DeviceConfig) -> String {
        let (kind, name) = function_node(d);
        self.registry
            .find(kind, &name)
            .and_then(|n| n.props.get("iommu-group"))
            .and_then(|g| g.as_u64())
            .map(|g| g.to_string())
            // Not claimed (cannot happen: claimed before its server starts): a path that
            // does not exist, so the server's start fails saying which.
            .unwrap_or_else(|| "unclaimed".into())
    }
}

/// The device (not `name`) of one of `functions` (nodes of the `pci` bus) that is in IOMMU
/// group `group` and not detached.
fn in_group<'a>(
    functions: impl Iterator<Item = &'a Node>,
    group: u32,
    name: &str,
) -> Option<String> {
    functions
        .filter(|f| f.props.get("iommu-group").and_then(|g| g.as_u64()) == Some(group.into()))
        .filter(|f| f.props.get("state").and_then(|s| s.as_str()) != Some("detached"))
        .map(|f| f.name.trim_end_matches("@pci").to_string())
        .find(|n| n != name)
}

/// Whether function `bdf` can be given to a driver as things stand: its IOMMU group, or what
/// is in the way and what to do about it.
pub(crate) fn usable(host: &HostView, bdf: &str) -> Result<u32, String> {
    let f = host.function(bdf).map_err(|e| e.to_string())?;
    if f.driver.as_deref() != Some(VFIO_PCI) {
        return Err(format!(
            "{bdf} is bound to {}, not vfio-pci: `outboard hw bind {bdf}` hands it over",
            f.driver.as_deref().unwrap_or("no driver")
        ));
    }
    match (f.iommu_group, f.viability()) {
        (Some(g), Viability::Viable) => Ok(g),
        (Some(g), Viability::Blocked(by)) => Err(format!(
            "{bdf}'s IOMMU group {g} is not viable: {} still driven by the kernel; bind them to \
             vfio-pci too (`outboard hw bind`) or unbind them",
            by.join(", ")
        )),
        _ => Err(format!(
            "{bdf} is in no IOMMU group: VFIO cannot take it (is the IOMMU on? `outboard hw \
             list` says)"
        )),
    }
}
