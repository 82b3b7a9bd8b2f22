//! `outboard hw list` on this machine (it only reads), and `hw bind`/`unbind` against sysfs
//! trees the test builds — never this machine's own functions (its disk and network are PCI
//! functions: binding one would take it away). Binding for real runs in the QEMU guest test.

use std::os::unix::fs::symlink;
use std::path::Path;
use std::process::{Command, Output};

fn outboard(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_outboard"))
        .args(args)
        .output()
        .unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn hw_list_shows_every_function_of_this_machine_with_its_driver() {
    let devices = Path::new("/sys/bus/pci/devices");
    let Ok(entries) = std::fs::read_dir(devices) else {
        eprintln!("no PCI bus on this machine: nothing to list");
        return;
    };
    let o = outboard(&["hw", "list"]);
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    let mut n = 0;
    let mut drivers = Vec::new();
    for e in entries {
        let bdf = e.unwrap().file_name().to_string_lossy().into_owned();
        let driver = std::fs::read_link(devices.join(&bdf).join("driver"))
            .ok()
            .and_then(|t| t.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "-".into());
        let line = out
            .lines()
            .find(|l| l.starts_with(&bdf))
            .unwrap_or_else(|| panic!("{bdf} not listed:\n{out}"));
        assert!(
            line.split_whitespace().any(|w| w == driver),
            "{bdf}'s driver {driver} not shown: {line}"
        );
        drivers.push((bdf, driver));
        n += 1;
    }
    let groups = std::fs::read_dir("/sys/kernel/iommu_groups").map_or(0, |d| d.count());
    if groups == 0 {
        assert!(out.contains("no IOMMU groups"), "{out}");
    }
    let o = outboard(&["hw", "list", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v.as_array().unwrap().len(), n, "{v}");
    // Exactly each function's driver (null for none), by address.
    for (bdf, driver) in drivers {
        let f = v
            .as_array()
            .unwrap()
            .iter()
            .find(|f| f["address"] == bdf.as_str())
            .unwrap_or_else(|| panic!("{bdf} not in {v}"));
        let want = if driver == "-" {
            serde_json::Value::Null
        } else {
            serde_json::Value::from(driver)
        };
        assert_eq!(f["driver"], want, "{f}");
    }
    assert!(
        v[0]["address"].is_string() && v[0]["iommu"].is_boolean(),
        "{v}"
    );
}

/// A tree with one virtio disk at 0000:00:02.0 driven by virtio-pci, its `vda` mounted on /.
fn tree(root: &Path, iommu: bool) {
    let fun = root.join("sys/bus/pci/devices/0000:00:02.0");
    std::fs::create_dir_all(fun.join("virtio1/block/vda")).unwrap();
    for d in ["virtio-pci", "vfio-pci"] {
        let dir = root.join("sys/bus/pci/drivers").join(d);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("unbind"), "").unwrap();
        std::fs::write(dir.join("bind"), "").unwrap();
    }
    std::fs::write(root.join("sys/bus/pci/drivers_probe"), "").unwrap();
    for (f, v) in [
        ("vendor", "0x1af4"),
        ("device", "0x1042"),
        ("class", "0x018000"),
        ("driver_override", "(null)"),
    ] {
        std::fs::write(fun.join(f), v).unwrap();
    }
    std::fs::write(fun.join("virtio1/block/vda/dev"), "254:0\n").unwrap();
    std::fs::create_dir_all(root.join("sys/class/block")).unwrap();
    symlink(
        fun.join("virtio1/block/vda"),
        root.join("sys/class/block/vda"),
    )
    .unwrap();
    symlink("../../drivers/virtio-pci", fun.join("driver")).unwrap();
    std::fs::create_dir_all(root.join("sys/kernel/iommu_groups")).unwrap();
    if iommu {
        let g = root.join("sys/kernel/iommu_groups/3/devices");
        std::fs::create_dir_all(&g).unwrap();
        symlink(&fun, g.join("0000:00:02.0")).unwrap();
        symlink("../../../kernel/iommu_groups/3", fun.join("iommu_group")).unwrap();
    }
    std::fs::create_dir_all(root.join("proc/self")).unwrap();
    std::fs::write(
        root.join("proc/self/mountinfo"),
        "22 1 254:0 / / rw - ext4 /dev/vda rw\n",
    )
    .unwrap();
}

#[test]
fn hw_bind_refuses_without_iommu_groups_and_a_disk_in_use_writing_nothing() {
    for (iommu, why) in [
        (false, "no IOMMU groups"),
        (
            true,
            "in use by its kernel driver virtio-pci: disk vda is mounted on /",
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().to_str().unwrap();
        tree(dir.path(), iommu);
        let o = outboard(&["hw", "bind", "0000:00:02.0", "--sysfs-root", root]);
        assert_eq!(o.status.code(), Some(1), "{}", text(&o));
        assert!(text(&o).contains(why), "{}", text(&o));
        assert!(text(&o).contains("nothing was changed"), "{}", text(&o));
        let fun = dir.path().join("sys/bus/pci/devices/0000:00:02.0");
        assert_eq!(
            std::fs::read_to_string(fun.join("driver_override")).unwrap(),
            "(null)"
        );
        let unbind = dir.path().join("sys/bus/pci/drivers/virtio-pci/unbind");
        assert_eq!(std::fs::read_to_string(unbind).unwrap(), "");
    }
    // The list of that tree says what uses the disk and which driver would take it.
    let dir = tempfile::tempdir().unwrap();
    tree(dir.path(), true);
    let o = outboard(&["hw", "list", "--sysfs-root", dir.path().to_str().unwrap()]);
    let out = text(&o);
    assert!(
        out.contains("virtio-blk (block, 1000)") && out.contains("3 (viable)"),
        "{out}"
    );
    assert!(out.contains("disk vda is mounted on /"), "{out}");
    // unbind of a function that is not on vfio-pci is refused, saying whose it is.
    let o = outboard(&[
        "hw",
        "unbind",
        "00:02.0",
        "--sysfs-root",
        dir.path().to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        text(&o).contains("not bound to vfio-pci (its driver: virtio-pci)"),
        "{}",
        text(&o)
    );
}
