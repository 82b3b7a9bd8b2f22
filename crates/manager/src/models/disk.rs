//! The disk models: virtio-blk (an emulated disk over a file or memory) and null-blk (no
//! device: its driver server completes every request, to measure the session path).

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;

use outboard_devices::backing::parse_size;

use super::{KeyError, Keys, Launch, ModelError, Settled};
use crate::children::{DiskOptions, ModelOwn, VirtioBlkOwn, DEFAULT_SERIAL};
use crate::config::DeviceConfig;

/// A size that is a positive multiple of 512.
fn sectors(text: &str) -> Option<u64> {
    parse_size(text).filter(|n| *n > 0 && n % 512 == 0)
}

pub(super) fn settle(
    keys: &Keys,
    dev_at: usize,
    others: &[DeviceConfig],
) -> Result<Settled, KeyError> {
    let b = keys.get("backing").ok_or_else(|| {
        (
            dev_at,
            "a virtio-blk device needs backing = \"FILE\" or \"mem:SIZE\"".to_string(),
        )
    })?;
    let backing = b.value.clone();
    if let Some(size) = backing.strip_prefix("mem:") {
        if sectors(size).is_none() {
            return Err((
                b.at,
                format!(
                    "backing {backing:?}: mem:SIZE needs a size that is a positive multiple of \
                     512 (e.g. mem:64M)"
                ),
            ));
        }
    } else if backing.is_empty() {
        return Err((b.at, "backing is empty".into()));
    }
    let mut settings = BTreeMap::new();
    if let Some(c) = keys.get("create") {
        let n = sectors(&c.value).ok_or_else(|| {
            (
                c.at,
                format!(
                    "create = {:?}: not a size that is a multiple of 512",
                    c.value
                ),
            )
        })?;
        settings.insert("create".into(), n.to_string());
    }
    let read_only = match keys.get("read_only") {
        None => false,
        Some(r) => r
            .value
            .parse::<bool>()
            .map_err(|_| (r.at, format!("read_only = {}: true or false", r.value)))?,
    };
    settings.insert("read_only".into(), read_only.to_string());
    let queues = match keys.get("queues") {
        None => 1,
        Some(q) => q
            .value
            .parse::<u16>()
            .ok()
            .filter(|n| (1..=16).contains(n))
            .ok_or_else(|| (q.at, format!("queues = {}: must be 1 to 16", q.value)))?,
    };
    settings.insert("queues".into(), queues.to_string());
    if backing.starts_with('/') || !backing.contains(':') {
        let shared = others.iter().find(|o| {
            o.model == "virtio-blk"
                && same_file(&o.backing, &backing)
                && (!o.flag("read_only") || !read_only)
        });
        if let Some(o) = shared {
            return Err((
                b.at,
                format!(
                    "backing {backing:?} is also {}'s: two devices may share a file only when \
                     both are read_only",
                    o.name
                ),
            ));
        }
    }
    Ok(Settled { backing, settings })
}

pub(super) fn launch(d: &DeviceConfig, first_fd: i32) -> Result<Launch, ModelError> {
    let backing = match d.backing.strip_prefix("mem:") {
        Some(size) => disk_memory(&d.name, size)?,
        None => {
            let create = d.settings.get("create").and_then(|c| c.parse().ok());
            outboard_devices::backing::Backing::open_with(&d.backing, create, d.flag("read_only"))?
                .into_fd()
        }
    };
    // The settings were checked when the description was read.
    let own = VirtioBlkOwn {
        backing: format!("fd:{first_fd}"),
        create: None,
        disk: DiskOptions {
            read_only: d.flag("read_only"),
            queues: d.setting("queues", "1").parse().unwrap_or(1),
            serial: DEFAULT_SERIAL.to_string(),
        },
    };
    Ok(Launch {
        own: ModelOwn::VirtioBlk(own),
        fds: vec![backing],
    })
}

/// A memory disk's backing: a memfd of `size`, which outlives the model's restarts because
/// the manager holds it.
fn disk_memory(name: &str, size: &str) -> Result<OwnedFd, ModelError> {
    let len = parse_size(size).ok_or_else(|| ModelError::Size(size.to_string()))?;
    let os = |what| {
        move |e: rustix::io::Errno| ModelError::Os {
            what,
            err: e.into(),
        }
    };
    let fd = rustix::fs::memfd_create(
        format!("outboard-disk-{name}").as_str(),
        rustix::fs::MemfdFlags::CLOEXEC,
    )
    .map_err(os("memfd_create"))?;
    rustix::fs::ftruncate(&fd, len).map_err(os("ftruncate"))?;
    Ok(fd)
}

pub(super) fn null_settle(
    keys: &Keys,
    dev_at: usize,
    _: &[DeviceConfig],
) -> Result<Settled, KeyError> {
    let size = keys.get("size").ok_or_else(|| {
        (
            dev_at,
            "a null-blk device needs size = \"SIZE\"".to_string(),
        )
    })?;
    let n = sectors(&size.value).ok_or_else(|| {
        (
            size.at,
            format!(
                "size = {:?}: not a size that is a multiple of 512",
                size.value
            ),
        )
    })?;
    Ok(Settled {
        backing: format!("null:{n}"),
        settings: BTreeMap::new(),
    })
}

pub(super) fn null_spec(d: &DeviceConfig) -> String {
    d.backing.clone()
}

/// Whether two backing paths name the same file (the same inode if both exist, else the same
/// absolute path).
fn same_file(a: &str, b: &str) -> bool {
    let abs = |p: &str| std::path::absolute(p).unwrap_or_else(|_| p.into());
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) => {
            use std::os::unix::fs::MetadataExt;
            x.dev() == y.dev() && x.ino() == y.ino()
        }
        _ => abs(a) == abs(b),
    }
}
