//! `outboard hw list|bind|unbind`: the host's PCI functions, and handing one to `vfio-pci` so
//! that an Outboard driver can serve it (and giving it back), as `dpdk-devbind.py` does.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use outboard_drivers::{candidates, Identity};
use outboard_hw::host::{Bound, Function, HostView, Viability};
use outboard_spec::pci;

/// Which sysfs to read and write.
#[derive(Args)]
pub struct Root {
    /// Read (and for bind/unbind write) a tree laid out under DIR — DIR/sys, DIR/proc,
    /// DIR/run — instead of the machine's own: for tests and for trying the commands safely.
    #[arg(long, value_name = "DIR")]
    sysfs_root: Option<PathBuf>,
}

impl Root {
    fn view(&self) -> HostView {
        match &self.sysfs_root {
            Some(r) => HostView::rooted(r),
            None => HostView::real(),
        }
    }
}

#[derive(Args)]
pub struct ListArgs {
    /// One JSON object per function, in an array.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    root: Root,
}

#[derive(Args)]
pub struct BindArgs {
    /// The function's PCI address, e.g. 0000:03:00.0 (or 03:00.0).
    bdf: String,
    /// Take the function even though its kernel driver is using it (a mounted disk, an
    /// interface that is up, the console): whoever uses it loses it.
    #[arg(long)]
    force: bool,
    #[command(flatten)]
    root: Root,
}

#[derive(Args)]
pub struct UnbindArgs {
    /// The function's PCI address, e.g. 0000:03:00.0 (or 03:00.0).
    bdf: String,
    #[command(flatten)]
    root: Root,
}

/// The Outboard driver whose passive match takes `f` with the highest initial score.
fn outboard_driver(f: &Function) -> Option<(&'static str, &'static str, u32)> {
    let id = Identity::Pci(f.identity);
    candidates(&id)
        .max_by_key(|p| p.score)
        .map(|p| (p.driver, p.class, p.score))
}

fn group_text(f: &Function) -> String {
    match (f.iommu_group, f.viability()) {
        (Some(g), Viability::Viable) => format!("{g} (viable)"),
        (Some(g), Viability::Blocked(by)) => format!("{g} (not viable: {})", by.join(", ")),
        _ => "-".into(),
    }
}

pub fn list(a: &ListArgs) -> Result<ExitCode, String> {
    let view = a.root.view();
    let fs = view.functions().map_err(|e| e.to_string())?;
    let groups = view.iommu_groups();
    if a.json {
        let v: Vec<serde_json::Value> = fs.iter().map(|f| json(f, groups > 0)).collect();
        println!(
            "{}",
            serde_json::to_string_pretty(&v).map_err(|e| e.to_string())?
        );
        return Ok(ExitCode::SUCCESS);
    }
    let rows: Vec<Vec<String>> = fs
        .iter()
        .map(|f| {
            let id = &f.identity;
            vec![
                f.bdf.clone(),
                format!("{:04x}:{:04x}", id.vendor, id.device),
                pci::class_name(id.class, id.subclass).to_string(),
                f.driver.clone().unwrap_or_else(|| "-".into()),
                group_text(f),
                outboard_driver(f).map_or("-".into(), |(d, c, s)| format!("{d} ({c}, {s})")),
                if f.uses.is_empty() {
                    "-".into()
                } else {
                    f.uses.join("; ")
                },
            ]
        })
        .collect();
    print!(
        "{}",
        crate::top::table(
            &[
                "ADDRESS",
                "ID",
                "CLASS",
                "DRIVER",
                "IOMMU GROUP",
                "OUTBOARD DRIVER (CLASS, SCORE)",
                "IN USE",
            ],
            &rows
        )
    );
    if groups == 0 {
        println!(
            "\nThis machine has no IOMMU groups: no function can be used through VFIO here \
             (turn on VT-d/AMD-Vi in the firmware and boot with intel_iommu=on or amd_iommu=on)."
        );
    } else {
        println!(
            "\n{} functions, {groups} IOMMU groups. `outboard hw bind ADDRESS` hands a function \
             to vfio-pci; a driver's score is its passive match (the active probe runs when it \
             starts).",
            fs.len()
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn json(f: &Function, iommu: bool) -> serde_json::Value {
    let id = &f.identity;
    let (viable, blocked_by) = match f.viability() {
        Viability::Viable => (Some(true), Vec::new()),
        Viability::Blocked(by) => (Some(false), by),
        Viability::NoGroup => (None, Vec::new()),
    };
    serde_json::json!({
        "address": f.bdf,
        "vendor": format!("{:04x}", id.vendor),
        "device": format!("{:04x}", id.device),
        "subsystem_vendor": format!("{:04x}", id.subsystem_vendor),
        "subsystem": format!("{:04x}", id.subsystem),
        "class": format!("{:02x}{:02x}{:02x}", id.class, id.subclass, id.prog_if),
        "class_name": pci::class_name(id.class, id.subclass),
        "revision": id.revision,
        "driver": f.driver,
        "iommu": iommu,
        "iommu_group": f.iommu_group,
        "viable": viable,
        "blocked_by": blocked_by,
        "outboard_driver": outboard_driver(f).map(|(d, c, s)| serde_json::json!({
            "driver": d, "class": c, "score": s,
        })),
        "in_use": f.uses,
    })
}

pub fn bind(a: &BindArgs) -> Result<ExitCode, String> {
    let view = a.root.view();
    match view.bind(&a.bdf, a.force).map_err(|e| e.to_string())? {
        Bound::Already => println!("{} is already bound to vfio-pci", a.bdf),
        Bound::From(from) => {
            let f = view.function(&a.bdf).map_err(|e| e.to_string())?;
            println!(
                "{} bound to vfio-pci (from {}); IOMMU group {}",
                f.bdf,
                from.as_deref().unwrap_or("no driver"),
                group_text(&f)
            );
            if let Viability::Blocked(by) = f.viability() {
                eprintln!(
                    "warning: its group is not viable until these are bound to vfio-pci too \
                     (or unbound): {}",
                    by.join(", ")
                );
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub fn unbind(a: &UnbindArgs) -> Result<ExitCode, String> {
    let u = a.root.view().unbind(&a.bdf).map_err(|e| e.to_string())?;
    match (&u.driver, &u.remembered) {
        (Some(d), _) => println!("{} unbound from vfio-pci, now driven by {d}", a.bdf),
        (None, Some(r)) => {
            println!(
                "{} unbound from vfio-pci; {r}, which it came from, did not take it back",
                a.bdf
            )
        }
        (None, None) => println!("{} unbound from vfio-pci; no kernel driver took it", a.bdf),
    }
    Ok(ExitCode::SUCCESS)
}
