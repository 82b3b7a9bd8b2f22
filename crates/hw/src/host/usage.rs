//! Whether a kernel driver is using its function. Binding a function in use to `vfio-pci`
//! takes it away from whoever uses it — the machine's own disk, network or console — so `bind`
//! refuses it unless forced.
//!
//! The uses are found from the other end: every block device, network interface, tty and
//! framebuffer the kernel lists (`/sys/class/…`) whose device path lies below the function,
//! however deep (an NVMe namespace is `FUNCTION/nvme/nvme0/nvme0n1`, a SATA disk
//! `FUNCTION/ata1/host0/target0:0:0/0:0:0:0/block/sda`), and then whether it is in use: mounted
//! (by device number, or by source for file systems such as btrfs whose mounts show an
//! anonymous number), swap, held by another block device (device-mapper, RAID), up, the
//! console. Besides: a virtio vsock or balloon below it, and SR-IOV virtual functions.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

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

/// How deep below the function a virtio device's own driver is looked for
/// (`FUNCTION/virtio3/driver`).
const DRIVER_DEPTH: usize = 2;

/// The classes whose members are looked for below a function.
const CLASSES: &[&str] = &["block", "net", "tty", "graphics"];

/// What the machine says once, for every function looked at: the members of [`CLASSES`] with
/// their devices' real paths, and what `/proc` says is mounted, swapped on and the console.
pub(super) struct Index {
    /// Class, member name and real path, by class and name.
    members: Vec<(&'static str, String, PathBuf)>,
    seen: Seen,
}

impl Index {
    /// Reads the classes under `sys` and the mounts, swaps and consoles under `proc_`.
    pub(super) fn read(sys: &Path, proc_: &Path) -> Self {
        let mut members = Vec::new();
        for class in CLASSES {
            let Ok(entries) = std::fs::read_dir(sys.join("class").join(class)) else {
                continue;
            };
            let mut v: Vec<(&'static str, String, PathBuf)> = entries
                .filter_map(|e| e.ok())
                .filter_map(|e| {
                    let real = std::fs::canonicalize(e.path()).ok()?;
                    Some((*class, e.file_name().to_string_lossy().into_owned(), real))
                })
                .collect();
            v.sort();
            members.extend(v);
        }
        Self {
            members,
            seen: Seen::read(proc_),
        }
    }

    /// The members of `class` whose device lies below `root`: name and real path.
    fn below<'a>(
        &'a self,
        class: &'a str,
        root: &'a Path,
    ) -> impl Iterator<Item = (&'a str, &'a Path)> + 'a {
        self.members
            .iter()
            .filter(move |(c, _, real)| *c == class && real.starts_with(root))
            .map(|(_, name, real)| (name.as_str(), real.as_path()))
    }

    /// Each use found of `function` (its sysfs directory).
    pub(super) fn uses(&self, function: &Path) -> Vec<String> {
        let Ok(root) = std::fs::canonicalize(function) else {
            return Vec::new();
        };
        let seen = &self.seen;
        let mut found = Vec::new();
        for (name, dev) in self.below("block", &root) {
            block_uses(name, dev, seen, &mut found);
        }
        for (ifname, dev) in self.below("net", &root) {
            // IFF_UP is bit 0 of the interface flags.
            let flags = std::fs::read_to_string(dev.join("flags")).unwrap_or_default();
            let flags = u32::from_str_radix(flags.trim().trim_start_matches("0x"), 16);
            if flags.is_ok_and(|f| f & 1 != 0) {
                found.push(format!("network interface {ifname} is up"));
            }
        }
        for (tty, _) in self.below("tty", &root) {
            if seen.consoles.iter().any(|c| c == tty) {
                found.push(format!("{tty} is the console"));
            }
        }
        for (fb, _) in self.below("graphics", &root) {
            found.push(format!("framebuffer {fb} (a console may be drawn on it)"));
        }
        drivers_in_use(&root, 0, &mut found);
        let vfs = std::fs::read_to_string(root.join("sriov_numvfs")).unwrap_or_default();
        if let Ok(n @ 1..) = vfs.trim().parse::<u32>() {
            found.push(format!(
                "{n} SR-IOV virtual functions, which go away with its driver"
            ));
        }
        found
    }
}

/// What `/proc` says about the machine's block devices and consoles.
struct Seen {
    /// Mount points by device number (`254:1`).
    by_number: HashMap<String, String>,
    /// Mount points by source (`/dev/vda2`).
    by_source: HashMap<String, String>,
    /// Swap devices (`/dev/vda2`).
    swaps: Vec<String>,
    /// Console ttys (`ttyS0`).
    consoles: Vec<String>,
}

impl Seen {
    fn read(proc_: &Path) -> Self {
        let text = |f: &str| std::fs::read_to_string(proc_.join(f)).unwrap_or_default();
        let (mut by_number, mut by_source) = (HashMap::new(), HashMap::new());
        // This process's mounts and init's (another mount namespace may hold the root).
        for table in ["self/mountinfo", "1/mountinfo"] {
            // ID PARENT MAJOR:MINOR ROOT MOUNTPOINT … - FSTYPE SOURCE OPTIONS
            for line in text(table).lines() {
                let f: Vec<&str> = line.split_whitespace().collect();
                if f.len() < 5 {
                    continue;
                }
                by_number
                    .entry(f[2].to_string())
                    .or_insert_with(|| f[4].to_string());
                if let Some(dash) = f.iter().position(|w| *w == "-") {
                    if let Some(source) = f.get(dash + 2) {
                        by_source
                            .entry(source.to_string())
                            .or_insert_with(|| f[4].to_string());
                    }
                }
            }
        }
        let first = |line: &str| line.split_whitespace().next().map(str::to_owned);
        Self {
            by_number,
            by_source,
            swaps: text("swaps").lines().skip(1).filter_map(first).collect(),
            consoles: text("consoles").lines().filter_map(first).collect(),
        }
    }
}

/// A block device's uses (its partitions are block devices of their own in the class).
fn block_uses(name: &str, dev: &Path, seen: &Seen, found: &mut Vec<String>) {
    let number = std::fs::read_to_string(dev.join("dev")).unwrap_or_default();
    let node = format!("/dev/{name}");
    if let Some(at) = seen
        .by_number
        .get(number.trim())
        .or_else(|| seen.by_source.get(&node))
    {
        found.push(format!("disk {name} is mounted on {at}"));
    }
    if seen.swaps.contains(&node) {
        found.push(format!("disk {name} is swap"));
    }
    let mut holders: Vec<String> = std::fs::read_dir(dev.join("holders"))
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    holders.sort();
    if !holders.is_empty() {
        found.push(format!("disk {name} is held by {}", holders.join(", ")));
    }
}

/// Virtio devices below the function whose driver's use sysfs does not show.
fn drivers_in_use(dir: &Path, depth: usize, found: &mut Vec<String>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut dirs: Vec<PathBuf> = entries
        .filter_map(|e| e.ok())
        // Children are directories; links (driver, subsystem, iommu_group…) lead elsewhere.
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| e.path())
        .collect();
    dirs.sort();
    for d in dirs {
        if let Some(name) = super::link_name(&d.join("driver")) {
            if let Some((_, what)) = DRIVERS_IN_USE.iter().find(|(n, _)| *n == name) {
                found.push(format!("{what}, driven by {name}"));
            }
        }
        if depth + 1 < DRIVER_DEPTH {
            drivers_in_use(&d, depth + 1, found);
        }
    }
}
