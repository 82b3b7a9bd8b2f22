//! Whether a kernel driver is using its function: what hangs below the function in sysfs (a
//! block device, a network interface, a tty, a framebuffer, a virtio device's own driver) and
//! whether that is in use (mounted, swap, held by another block device, up, the console).
//! Binding a function in use to `vfio-pci` takes it away from whoever uses it — the machine's
//! own disk, network or console — so `bind` refuses it unless forced.

use std::collections::HashMap;
use std::path::Path;

/// How deep below the function the children are looked for: a virtio disk is
/// `FUNCTION/virtio1/block/vda`, an NVMe namespace `FUNCTION/nvme/nvme0/nvme0n1`.
const DEPTH: usize = 4;

/// Virtio devices whose driver's use is not seen in sysfs, and what taking them away costs.
const DRIVERS_IN_USE: &[(&str, &str)] = &[
    (
        "vmw_vsock_virtio_transport",
        "a virtio vsock (this machine may be reached over it)",
    ),
    (
        "virtio_balloon",
        "the memory balloon of this virtual machine",
    ),
];

/// Each use found below `function` (sysfs) given what `proc_` says is mounted, swapped on and
/// the console.
pub(super) fn uses(function: &Path, proc_: &Path) -> Vec<String> {
    let view = Seen::read(proc_);
    let mut found = Vec::new();
    walk(function, 0, &view, &mut found);
    found
}

/// What `/proc` says about the machine's block devices and consoles.
struct Seen {
    /// Mount points by device number (`254:1`).
    mounts: HashMap<String, String>,
    /// Swap devices (`/dev/vda2`).
    swaps: Vec<String>,
    /// Console ttys (`ttyS0`).
    consoles: Vec<String>,
}

impl Seen {
    fn read(proc_: &Path) -> Self {
        let text = |f: &str| std::fs::read_to_string(proc_.join(f)).unwrap_or_default();
        // mountinfo: ID PARENT MAJOR:MINOR ROOT MOUNTPOINT …
        let mut mounts = HashMap::new();
        for line in text("self/mountinfo").lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() > 4 {
                mounts
                    .entry(f[2].to_string())
                    .or_insert_with(|| f[4].to_string());
            }
        }
        let first = |line: &str| line.split_whitespace().next().map(str::to_owned);
        Self {
            mounts,
            swaps: text("swaps").lines().skip(1).filter_map(first).collect(),
            consoles: text("consoles").lines().filter_map(first).collect(),
        }
    }
}

fn walk(dir: &Path, depth: usize, seen: &Seen, found: &mut Vec<String>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.filter_map(|e| e.ok()) {
        // Children are directories; links (driver, subsystem, iommu_group…) lead elsewhere.
        if !e.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let path = e.path();
        let name = e.file_name().to_string_lossy().into_owned();
        match name.as_str() {
            "block" => each_child(&path, |dev, n| block_uses(dev, n, seen, found)),
            "net" => each_child(&path, |ifdir, ifname| {
                // IFF_UP is bit 0 of the interface flags.
                let flags = std::fs::read_to_string(ifdir.join("flags")).unwrap_or_default();
                let flags = u32::from_str_radix(flags.trim().trim_start_matches("0x"), 16);
                if flags.is_ok_and(|f| f & 1 != 0) {
                    found.push(format!("network interface {ifname} is up"));
                }
            }),
            "tty" => each_child(&path, |_, tty| {
                if seen.consoles.iter().any(|c| c == tty) {
                    found.push(format!("{tty} is the console"));
                }
            }),
            "graphics" => each_child(&path, |_, fb| {
                found.push(format!("framebuffer {fb} (a console may be drawn on it)"))
            }),
            _ => {
                if let Some(d) = super::link_name(&path.join("driver")) {
                    if let Some((_, what)) = DRIVERS_IN_USE.iter().find(|(n, _)| *n == d) {
                        found.push(format!("{what}, driven by {d}"));
                    }
                }
                if depth + 1 < DEPTH {
                    walk(&path, depth + 1, seen, found);
                }
            }
        }
    }
}

fn each_child(dir: &Path, mut f: impl FnMut(&Path, &str)) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut names: Vec<_> = entries.filter_map(|e| e.ok()).collect();
    names.sort_by_key(|e| e.file_name());
    for e in names {
        f(&e.path(), &e.file_name().to_string_lossy());
    }
}

/// A block device's uses, and its partitions'.
fn block_uses(dev: &Path, name: &str, seen: &Seen, found: &mut Vec<String>) {
    let number = std::fs::read_to_string(dev.join("dev")).unwrap_or_default();
    if let Some(at) = seen.mounts.get(number.trim()) {
        found.push(format!("disk {name} is mounted on {at}"));
    }
    if seen.swaps.iter().any(|s| s == &format!("/dev/{name}")) {
        found.push(format!("disk {name} is swap"));
    }
    let mut holders = Vec::new();
    each_child(&dev.join("holders"), |_, h| holders.push(h.to_string()));
    if !holders.is_empty() {
        found.push(format!("disk {name} is held by {}", holders.join(", ")));
    }
    // Partitions are directories of the disk that have a `partition` attribute.
    each_child(dev, |part, pname| {
        if part.join("partition").is_file() {
            block_uses(part, pname, seen, found);
        }
    });
}
