//! Listing, binding and unbinding against sysfs trees built here: never the machine's own.

use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};

use super::*;

/// A fake root: `sys` with PCI functions, drivers and IOMMU groups; `proc` with mounts,
/// swaps and consoles.
struct Fake {
    dir: tempfile::TempDir,
}

impl Fake {
    fn new(iommu: bool) -> Self {
        let f = Self {
            dir: tempfile::tempdir().unwrap(),
        };
        for d in [
            "sys/bus/pci/devices",
            "sys/kernel/iommu_groups",
            "proc/self",
        ] {
            std::fs::create_dir_all(f.root().join(d)).unwrap();
        }
        touch(&f.sys("bus/pci/drivers_probe"));
        for d in [VFIO_PCI, "virtio-pci", "e1000", "pcieport"] {
            f.driver(d);
        }
        std::fs::write(
            f.root().join("proc/self/mountinfo"),
            "22 1 254:1 / / rw - ext4 /dev/vda1 rw\n23 22 0:22 / /sys rw - sysfs sysfs rw\n",
        )
        .unwrap();
        std::fs::write(
            f.root().join("proc/swaps"),
            "Filename Type Size Used Priority\n/dev/vdb partition 1024 0 -2\n",
        )
        .unwrap();
        std::fs::write(f.root().join("proc/consoles"), "ttyS0 -W- (EC p a) 4:64\n").unwrap();
        if iommu {
            std::fs::create_dir_all(f.sys("kernel/iommu_groups/99/devices")).unwrap();
        }
        f
    }

    fn root(&self) -> &Path {
        self.dir.path()
    }

    fn sys(&self, p: &str) -> PathBuf {
        self.root().join("sys").join(p)
    }

    fn view(&self) -> HostView {
        HostView::rooted(self.root())
    }

    fn driver(&self, name: &str) {
        let d = self.sys(&format!("bus/pci/drivers/{name}"));
        std::fs::create_dir_all(&d).unwrap();
        touch(&d.join("bind"));
        touch(&d.join("unbind"));
    }

    /// A function with `class` (24 bits), bound to `driver`, in `group`.
    fn function(
        &self,
        bdf: &str,
        id: (u16, u16),
        class: u32,
        driver: Option<&str>,
        group: Option<u32>,
    ) -> PathBuf {
        let at = self.sys(&format!("bus/pci/devices/{bdf}"));
        std::fs::create_dir_all(&at).unwrap();
        for (n, v) in [
            ("vendor", format!("{:#06x}\n", id.0)),
            ("device", format!("{:#06x}\n", id.1)),
            ("class", format!("{class:#08x}\n")),
            ("revision", "0x01\n".into()),
            ("subsystem_vendor", "0x1af4\n".into()),
            ("subsystem_device", "0x0002\n".into()),
            ("driver_override", "(null)\n".into()),
        ] {
            std::fs::write(at.join(n), v).unwrap();
        }
        if let Some(d) = driver {
            symlink(format!("../../drivers/{d}"), at.join("driver")).unwrap();
        }
        if let Some(g) = group {
            let gd = self.sys(&format!("kernel/iommu_groups/{g}/devices"));
            std::fs::create_dir_all(&gd).unwrap();
            symlink(&at, gd.join(bdf)).unwrap();
            symlink(
                format!("../../../kernel/iommu_groups/{g}"),
                at.join("iommu_group"),
            )
            .unwrap();
        }
        at
    }
}

/// Lists `dev` (a device directory below a function) in `sys/class/CLASS` as `name`, the
/// way the kernel links its class members to their devices.
fn class(f: &Fake, class: &str, name: &str, dev: &Path) {
    let dir = f.sys(&format!("class/{class}"));
    std::fs::create_dir_all(&dir).unwrap();
    symlink(dev, dir.join(name)).unwrap();
}

fn touch(p: &Path) {
    std::fs::write(p, "").unwrap();
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap()
}

/// A virtio disk at `bdf` whose block device `vda` has number `dev`.
fn virtio_disk(f: &Fake, bdf: &str, dev: &str, group: Option<u32>) -> PathBuf {
    virtio_disk_named(f, bdf, "vda", dev, group)
}

/// The same, its block device named `name`.
fn virtio_disk_named(f: &Fake, bdf: &str, name: &str, dev: &str, group: Option<u32>) -> PathBuf {
    let at = f.function(bdf, (0x1af4, 0x1042), 0x018000, Some("virtio-pci"), group);
    let vda = at.join("virtio1/block").join(name);
    std::fs::create_dir_all(vda.join("holders")).unwrap();
    std::fs::write(vda.join("dev"), format!("{dev}\n")).unwrap();
    class(f, "block", name, &vda);
    at
}

#[test]
fn addresses_are_read_in_sysfs_form_and_nonsense_is_refused() {
    assert_eq!(canonical("00:04.0").unwrap(), "0000:00:04.0");
    assert_eq!(canonical("0000:3B:00.7").unwrap(), "0000:3b:00.7");
    for bad in [
        "",
        "04.0",
        "0000:00:04",
        "0000:00:20.0",
        "0000:00:04.8",
        "../../x",
        "0000:00:0g.0",
        "0:0:4.0",
        "0000:00:04.0/driver",
    ] {
        assert!(
            matches!(canonical(bad), Err(HostError::NotAnAddress(_))),
            "{bad:?} accepted"
        );
    }
}

#[test]
fn functions_are_listed_with_identity_driver_group_and_uses() {
    let f = Fake::new(true);
    virtio_disk(&f, "0000:00:02.0", "254:0", Some(3));
    let mounted = virtio_disk_named(&f, "0000:00:03.0", "vdc", "254:1", Some(4));
    let nic = f.function(
        "0000:00:05.0",
        (0x8086, 0x100e),
        0x020000,
        Some("e1000"),
        Some(5),
    );
    let eth = nic.join("net/eth0");
    std::fs::create_dir_all(&eth).unwrap();
    std::fs::write(eth.join("flags"), "0x1003\n").unwrap();
    class(&f, "net", "eth0", &eth);
    f.function("0000:00:00.0", (0x8086, 0x29c0), 0x060000, None, None);

    let list = f.view().functions().unwrap();
    let bdfs: Vec<&str> = list.iter().map(|x| x.bdf.as_str()).collect();
    assert_eq!(
        bdfs,
        [
            "0000:00:00.0",
            "0000:00:02.0",
            "0000:00:03.0",
            "0000:00:05.0"
        ]
    );
    let disk = &list[1];
    assert_eq!(
        (disk.identity.vendor, disk.identity.device),
        (0x1af4, 0x1042)
    );
    assert_eq!((disk.identity.class, disk.identity.subclass), (0x01, 0x80));
    assert_eq!(disk.driver.as_deref(), Some("virtio-pci"));
    assert_eq!(disk.iommu_group, Some(3));
    assert!(disk.uses.is_empty(), "{:?}", disk.uses);
    assert_eq!(disk.viability(), Viability::Viable);
    assert_eq!(list[2].uses, ["disk vdc is mounted on /"], "{mounted:?}");
    assert_eq!(list[3].uses, ["network interface eth0 is up"]);
    assert_eq!(list[0].bridge(), Some("Host bridge"));
    assert_eq!(list[0].viability(), Viability::NoGroup);
}

#[test]
fn partitions_swap_holders_consoles_and_vsocks_are_uses() {
    let f = Fake::new(true);
    let a = virtio_disk(&f, "0000:00:02.0", "254:0", Some(1));
    let part = a.join("virtio1/block/vda/vda1");
    std::fs::create_dir_all(&part).unwrap();
    touch(&part.join("partition"));
    std::fs::write(part.join("dev"), "254:1\n").unwrap();
    class(&f, "block", "vda1", &part);
    let b = f.function(
        "0000:00:03.0",
        (0x1af4, 0x1042),
        0x018000,
        Some("virtio-pci"),
        Some(2),
    );
    let vdb = b.join("virtio2/block/vdb");
    std::fs::create_dir_all(vdb.join("holders/dm-0")).unwrap();
    std::fs::write(vdb.join("dev"), "254:16\n").unwrap();
    class(&f, "block", "vdb", &vdb);
    let s = f.function(
        "0000:00:04.0",
        (0x1b36, 0x0002),
        0x070002,
        Some("serial"),
        Some(3),
    );
    for t in ["ttyS0", "ttyS1"] {
        std::fs::create_dir_all(s.join("tty").join(t)).unwrap();
        class(&f, "tty", t, &s.join("tty").join(t));
    }
    let v = f.function(
        "0000:00:05.0",
        (0x1af4, 0x1053),
        0xffff00,
        Some("virtio-pci"),
        Some(4),
    );
    std::fs::create_dir_all(v.join("virtio3")).unwrap();
    symlink(
        "../../../drivers/vmw_vsock_virtio_transport",
        v.join("virtio3/driver"),
    )
    .unwrap();

    let h = f.view();
    assert_eq!(
        h.function("00:02.0").unwrap().uses,
        ["disk vda1 is mounted on /"]
    );
    assert_eq!(
        h.function("00:03.0").unwrap().uses,
        ["disk vdb is swap", "disk vdb is held by dm-0"]
    );
    assert_eq!(
        h.function("00:04.0").unwrap().uses,
        ["ttyS0 is the console"]
    );
    let vsock = h.function("00:05.0").unwrap().uses;
    assert!(vsock.len() == 1 && vsock[0].contains("vsock"), "{vsock:?}");
}

#[test]
fn disks_deep_below_the_function_nvme_sata_btrfs_and_sriov_are_uses() {
    let f = Fake::new(true);
    // An NVMe namespace has no `block` directory: FUNCTION/nvme/nvme0/nvme0n1, partition p1.
    let nvme = f.function(
        "0000:00:04.0",
        (0x1b36, 0x0010),
        0x010802,
        Some("nvme"),
        Some(1),
    );
    let ns = nvme.join("nvme/nvme0/nvme0n1");
    std::fs::create_dir_all(ns.join("nvme0n1p1")).unwrap();
    std::fs::write(ns.join("dev"), "259:0\n").unwrap();
    std::fs::write(ns.join("nvme0n1p1/dev"), "259:1\n").unwrap();
    class(&f, "block", "nvme0n1", &ns);
    class(&f, "block", "nvme0n1p1", &ns.join("nvme0n1p1"));
    // A SATA disk six levels down, its partition a btrfs mount (an anonymous 0:NN number in
    // mountinfo: found by its source), in init's mount namespace.
    let ahci = f.function(
        "0000:00:1f.2",
        (0x8086, 0x2922),
        0x010601,
        Some("ahci"),
        Some(2),
    );
    let sda = ahci.join("ata1/host0/target0:0:0/0:0:0:0/block/sda");
    std::fs::create_dir_all(sda.join("sda2")).unwrap();
    std::fs::write(sda.join("dev"), "8:0\n").unwrap();
    std::fs::write(sda.join("sda2/dev"), "8:2\n").unwrap();
    class(&f, "block", "sda", &sda);
    class(&f, "block", "sda2", &sda.join("sda2"));
    std::fs::create_dir_all(f.root().join("proc/1")).unwrap();
    std::fs::write(
        f.root().join("proc/1/mountinfo"),
        "22 1 259:1 / / rw - ext4 /dev/nvme0n1p1 rw\n30 22 0:33 / /home rw - btrfs /dev/sda2 rw\n",
    )
    .unwrap();
    // A NIC with virtual functions.
    let pf = f.function(
        "0000:03:00.0",
        (0x8086, 0x10fb),
        0x020000,
        Some("ixgbe"),
        Some(3),
    );
    std::fs::write(pf.join("sriov_numvfs"), "4\n").unwrap();
    // Another NVMe function, whose namespace is not listed below it.
    f.function(
        "0000:00:05.0",
        (0x1b36, 0x0010),
        0x010802,
        Some("nvme"),
        Some(4),
    );
    let h = f.view();
    assert_eq!(
        h.function("00:04.0").unwrap().uses,
        ["disk nvme0n1p1 is mounted on /"]
    );
    assert_eq!(
        h.function("00:1f.2").unwrap().uses,
        ["disk sda2 is mounted on /home"]
    );
    assert_eq!(
        h.function("03:00.0").unwrap().uses,
        ["4 SR-IOV virtual functions, which go away with its driver"]
    );
    assert!(h.function("00:05.0").unwrap().uses.is_empty());
    // A VMD domain has five digits.
    assert_eq!(canonical("10000:e0:06.0").unwrap(), "10000:e0:06.0");
}

#[test]
fn a_group_with_a_member_whose_driver_owns_its_dma_is_not_viable() {
    let f = Fake::new(true);
    f.function(
        "0000:01:00.0",
        (0x8086, 0x10fb),
        0x020000,
        Some(VFIO_PCI),
        Some(7),
    );
    f.function(
        "0000:01:00.1",
        (0x8086, 0x10fb),
        0x020000,
        Some("ixgbe"),
        Some(7),
    );
    f.function(
        "0000:00:1c.0",
        (0x8086, 0x1234),
        0x060400,
        Some("pcieport"),
        Some(7),
    );
    let h = f.view();
    assert_eq!(
        h.function("0000:01:00.0").unwrap().viability(),
        Viability::Blocked(vec!["0000:01:00.1 (ixgbe)".into()])
    );
    assert_eq!(
        h.function("0000:01:00.1").unwrap().viability(),
        Viability::Viable,
        "its peers are vfio-pci and a port driver"
    );
}

/// Every file of the tree and its contents: to show a refusal wrote nothing.
fn snapshot(root: &Path) -> Vec<(PathBuf, String)> {
    let mut v = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().filter_map(|e| e.ok()) {
            let t = e.file_type().unwrap();
            if t.is_dir() {
                stack.push(e.path());
            } else if t.is_file() {
                v.push((e.path(), read(&e.path())));
            }
        }
    }
    v.sort();
    v
}

#[test]
fn bind_refuses_before_any_write() {
    // No IOMMU groups: refused first, even for a function that is free.
    let f = Fake::new(false);
    virtio_disk(&f, "0000:00:02.0", "254:0", None);
    let before = snapshot(f.root());
    assert!(matches!(
        f.view().bind("0000:00:02.0", true),
        Err(HostError::NoIommu)
    ));
    assert_eq!(snapshot(f.root()), before);

    let f = Fake::new(true);
    virtio_disk(&f, "0000:00:03.0", "254:1", Some(1));
    f.function("0000:00:00.0", (0x8086, 0x29c0), 0x060000, None, Some(2));
    f.function(
        "0000:00:06.0",
        (0x8086, 0x100e),
        0x020000,
        Some("e1000"),
        None,
    );
    let before = snapshot(f.root());
    let h = f.view();
    let e = h.bind("0000:00:03.0", false).unwrap_err();
    assert!(
        matches!(&e, HostError::InUse { uses, .. } if uses == &["disk vda is mounted on /"]),
        "{e}"
    );
    assert!(e.to_string().contains("--force"), "{e}");
    assert!(matches!(
        h.bind("0000:00:00.0", true),
        Err(HostError::Bridge(_, "Host bridge"))
    ));
    assert!(matches!(
        h.bind("0000:00:06.0", false),
        Err(HostError::NoGroup(_))
    ));
    assert!(matches!(
        h.bind("0000:00:09.0", false),
        Err(HostError::NoFunction(_))
    ));
    assert!(matches!(
        h.bind("../../../etc", false),
        Err(HostError::NotAnAddress(_))
    ));
    std::fs::remove_dir_all(f.sys("bus/pci/drivers/vfio-pci")).unwrap();
    let before_novfio = snapshot(f.root());
    assert!(matches!(
        h.bind("0000:00:03.0", true),
        Err(HostError::NoVfioPci)
    ));
    assert_eq!(snapshot(f.root()), before_novfio);
    let mut before = before;
    before.retain(|(p, _)| !p.starts_with(f.sys("bus/pci/drivers/vfio-pci")));
    assert_eq!(snapshot(f.root()), before);
}

#[test]
fn bind_writes_override_unbind_and_probe_in_order_and_remembers_the_driver() {
    let f = Fake::new(true);
    let at = f.function(
        "0000:00:06.0",
        (0x8086, 0x100e),
        0x020000,
        Some("e1000"),
        Some(3),
    );
    std::fs::create_dir_all(at.join("net/eth1")).unwrap();
    std::fs::write(at.join("net/eth1/flags"), "0x1002\n").unwrap();
    class(&f, "net", "eth1", &at.join("net/eth1"));
    let h = f.view();
    // A fake kernel does not move the driver link: bind says vfio-pci did not take it,
    // after writing what a real kernel acts on, and puts the override back.
    let e = h.bind("0000:00:06.0", false).unwrap_err();
    assert!(
        e.to_string().contains("vfio-pci did not take 0000:00:06.0")
            && e.to_string().contains("put back"),
        "{e}"
    );
    assert_eq!(read(&at.join("driver_override")), "\n");
    assert_eq!(read(&f.sys("bus/pci/drivers/e1000/unbind")), "0000:00:06.0");
    assert_eq!(read(&f.sys("bus/pci/drivers_probe")), "0000:00:06.0");
    assert_eq!(
        h.remembered("0000:00:06.0"),
        None,
        "nothing left to remember"
    );

    // What the kernel would have done, then unbind gives it back to e1000.
    std::fs::remove_file(at.join("driver")).unwrap();
    symlink("../../drivers/vfio-pci", at.join("driver")).unwrap();
    std::fs::create_dir_all(f.root().join("run/outboard/pci")).unwrap();
    std::fs::write(f.root().join("run/outboard/pci/0000:00:06.0"), "e1000").unwrap();
    assert_eq!(h.bind("0000:00:06.0", false).unwrap(), Bound::Already);
    let u = h.unbind("0000:00:06.0").unwrap();
    assert_eq!(u.remembered.as_deref(), Some("e1000"));
    assert_eq!(read(&at.join("driver_override")), "\n");
    assert_eq!(
        read(&f.sys("bus/pci/drivers/vfio-pci/unbind")),
        "0000:00:06.0"
    );
    assert_eq!(read(&f.sys("bus/pci/drivers/e1000/bind")), "0000:00:06.0");
    assert_eq!(h.remembered("0000:00:06.0"), None);
}

#[test]
fn unbind_refuses_a_function_not_on_vfio_pci_or_whose_group_is_open() {
    let f = Fake::new(true);
    f.function(
        "0000:00:06.0",
        (0x8086, 0x100e),
        0x020000,
        Some("e1000"),
        Some(3),
    );
    f.function(
        "0000:00:07.0",
        (0x1af4, 0x1042),
        0x018000,
        Some(VFIO_PCI),
        Some(8),
    );
    let fd = f.root().join("proc/4242/fd");
    std::fs::create_dir_all(&fd).unwrap();
    symlink("/dev/vfio/8", fd.join("5")).unwrap();
    std::fs::write(f.root().join("proc/4242/comm"), "outboard\n").unwrap();
    let before = snapshot(f.root());
    let h = f.view();
    assert!(matches!(
        h.unbind("0000:00:06.0"),
        Err(HostError::NotVfio { driver: Some(d), .. }) if d == "e1000"
    ));
    let e = h.unbind("0000:00:07.0").unwrap_err();
    assert!(
        matches!(&e, HostError::Open { group: 8, holders, .. } if holders == &["4242 (outboard)"]),
        "{e}"
    );
    assert_eq!(snapshot(f.root()), before);
}
