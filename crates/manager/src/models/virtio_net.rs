//! The virtio-net model: an emulated NIC. Its keys: `mac` (its address; default one derived
//! from the device's name, locally administered), `mtu` (68 to 9000, default 1500; above 1500, jumbo frames), `link`
//! (`up` or `down` at power-on) and `wire`, a cable's name: the two NICs that name the same
//! wire are joined by it (frames one sends arrive at the other).
//!
//! The manager makes each cable once — a `SOCK_SEQPACKET` socket pair, one frame a message —
//! and hands one end to each NIC's model. Or `stream`, a UNIX socket path: the NIC's cable is
//! a connection to a QEMU VM's `-netdev stream` server, which its model makes at each start.
//!
//! Or `stream_listen`, a UNIX socket path the manager listens on: a QEMU VM's
//! `-netdev stream,server=off` plugs in from its end (the link is down until it connects).
//!
//! Or `tap`, a host interface's name: the NIC's cable is a TAP interface the manager makes
//! (its other end is the host's network stack; give it addresses with `ip`, move it into a
//! namespace).
//!
//! The manager makes each cable (and TAP interface) once and keeps it for as long as it runs,
//! so a model started again after a crash gets the same end back: the cable outlives either
//! NIC, and the interface keeps what the host set on it.

use std::collections::{BTreeMap, HashMap};
use std::os::fd::OwnedFd;
use std::sync::Mutex;

use super::{Given, KeyError, Keys, Launch, ModelError, Settled};
use crate::children::{parse_mac, ModelOwn, VirtioNetOwn};
use crate::config::DeviceConfig;

/// A locally administered address made from the device's name (the same name, the same
/// address, on every start).
fn default_mac(name: &str) -> String {
    // FNV-1a: stable across builds and platforms.
    let h = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    let b = h.to_le_bytes();
    format!(
        "02:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
        b[0], b[1], b[2], b[3], b[4]
    )
}

/// The largest MTU a NIC model is given: jumbo frames, whose frames a client's slot holds
/// (`outboard_net_client::session::MAX_SLOT`).
const MAX_MTU: u16 = 9000;

pub(super) fn settle(keys: &Keys, _: usize, others: &[DeviceConfig]) -> Result<Settled, KeyError> {
    let mut settings = BTreeMap::new();
    if let Some(m) = keys.get("mac") {
        let mac = parse_mac(&m.value).map_err(|e| (m.at, format!("mac = {e}")))?;
        let text: Vec<String> = mac.iter().map(|b| format!("{b:02x}")).collect();
        settings.insert("mac".to_string(), text.join(":"));
    }
    if let Some(m) = keys.get("mtu") {
        let ok = m
            .value
            .parse::<u16>()
            .ok()
            .filter(|v| (68..=MAX_MTU).contains(v));
        let mtu = ok.ok_or_else(|| (m.at, format!("mtu = {}: 68 to {MAX_MTU} bytes", m.value)))?;
        settings.insert("mtu".to_string(), mtu.to_string());
    }
    if let Some(l) = keys.get("link") {
        if l.value != "up" && l.value != "down" {
            return Err((l.at, format!("link = {:?}: up or down", l.value)));
        }
        settings.insert("link".to_string(), l.value.clone());
    }
    let cables: Vec<_> = ["wire", "stream", "tap", "stream_listen"]
        .into_iter()
        .filter_map(|k| keys.get(k).map(|v| (k, v.at)))
        .collect();
    if let [(a, _), (b, at), ..] = cables[..] {
        return Err((at, format!("{a} and {b}: a NIC has one cable")));
    }
    if let Some(p) = keys.get("stream_listen") {
        if !p.value.starts_with('/') {
            return Err((
                p.at,
                format!(
                    "stream_listen = {:?}: an absolute path for a UNIX socket",
                    p.value
                ),
            ));
        }
        held_by_another(others, "stream_listen", p)?;
        settings.insert("stream_listen".to_string(), p.value.clone());
        return Ok(Settled {
            backing: format!("stream-listen:{}", p.value),
            settings,
        });
    }
    if let Some(t) = keys.get("tap") {
        crate::config::check_interface(&t.value).map_err(|why| (t.at, format!("tap = {why}")))?;
        held_by_another(others, "tap", t)?;
        settings.insert("tap".to_string(), t.value.clone());
        return Ok(Settled {
            backing: format!("tap:{}", t.value),
            settings,
        });
    }
    if let Some(p) = keys.get("stream") {
        if !p.value.starts_with('/') {
            return Err((
                p.at,
                format!("stream = {:?}: an absolute path to a UNIX socket", p.value),
            ));
        }
        settings.insert("stream".to_string(), p.value.clone());
        return Ok(Settled {
            backing: format!("stream:{}", p.value),
            settings,
        });
    }
    let backing = match keys.get("wire") {
        Some(w) => {
            let on_it = others
                .iter()
                .filter(|d| d.model == "virtio-net" && d.settings.get("wire") == Some(&w.value))
                .count();
            if on_it >= 2 {
                return Err((
                    w.at,
                    format!(
                        "wire {:?} joins two NICs already: a wire has two ends",
                        w.value
                    ),
                ));
            }
            if w.value.is_empty() {
                return Err((w.at, "wire = \"\": name the cable".into()));
            }
            settings.insert("wire".to_string(), w.value.clone());
            format!("wire:{}", w.value)
        }
        None => "no cable".to_string(),
    };
    Ok(Settled { backing, settings })
}

/// The cables made so far, by name: each holds the end its second NIC has not taken yet, then
/// both ends (kept, so that a model started again gets its end back).
static CABLES: Mutex<Option<HashMap<String, Cable>>> = Mutex::new(None);

struct Cable {
    /// The device that took each end.
    ends: [(Option<String>, OwnedFd); 2],
}

/// This device's end of cable `wire`: made with the cable the first time, the same one after.
/// A cable only one NIC may hold (a TAP interface, a listening socket): refused if another
/// NIC of the machine holds `key = given` already.
fn held_by_another(others: &[DeviceConfig], key: &str, given: &Given) -> Result<(), KeyError> {
    let taken = others
        .iter()
        .any(|d| d.model == "virtio-net" && d.settings.get(key) == Some(&given.value));
    match taken {
        true => Err((
            given.at,
            format!("{key} = {:?}: another NIC's already", given.value),
        )),
        false => Ok(()),
    }
}

fn end(wire: &str, device: &str) -> Result<OwnedFd, ModelError> {
    let os = |what| {
        move |e: rustix::io::Errno| ModelError::Os {
            what,
            err: std::io::Error::from_raw_os_error(e.raw_os_error()),
        }
    };
    let mut all = CABLES.lock().unwrap_or_else(|p| p.into_inner());
    let cables = all.get_or_insert_with(HashMap::new);
    if !cables.contains_key(wire) {
        let (a, b) = rustix::net::socketpair(
            rustix::net::AddressFamily::UNIX,
            rustix::net::SocketType::SEQPACKET,
            rustix::net::SocketFlags::CLOEXEC,
            None,
        )
        .map_err(os("socketpair"))?;
        cables.insert(
            wire.to_string(),
            Cable {
                ends: [(None, a), (None, b)],
            },
        );
    }
    let cable = cables.get_mut(wire).expect("made above");
    let i = match cable
        .ends
        .iter()
        .position(|(d, _)| d.as_deref() == Some(device))
    {
        Some(i) => i,
        None => {
            let i = cable
                .ends
                .iter()
                .position(|(d, _)| d.is_none())
                .ok_or_else(|| ModelError::Cable(format!("wire {wire} has two NICs already")))?;
            cable.ends[i].0 = Some(device.to_string());
            i
        }
    };
    cable.ends[i].1.try_clone().map_err(|e| ModelError::Os {
        what: "dup",
        err: e,
    })
}

/// The TAP interfaces made so far, by name: made at a NIC model's first start and kept, so
/// that a model started again gets the same interface back — with the addresses, routes and
/// namespace the host gave it.
static TAPS: Mutex<Option<HashMap<String, OwnedFd>>> = Mutex::new(None);

/// A descriptor of TAP interface `name` for a NIC of `mtu`: made the first time (with that
/// MTU, so the host sends the NIC's frames whole), the same one after.
fn tap(name: &str, mtu: u16) -> Result<OwnedFd, ModelError> {
    let mut all = TAPS.lock().unwrap_or_else(|p| p.into_inner());
    let taps = all.get_or_insert_with(HashMap::new);
    if !taps.contains_key(name) {
        let failed = |why| ModelError::Cable(format!("tap {name}: {why}"));
        let (fd, _) = outboard_sys::tap::open(name).map_err(failed)?;
        if mtu != 1500 {
            outboard_sys::tap::set_mtu(name, mtu).map_err(failed)?;
        }
        taps.insert(name.to_string(), fd);
    }
    taps[name].try_clone().map_err(|e| ModelError::Os {
        what: "dup",
        err: e,
    })
}

/// The listening sockets made so far, by path, with the path's guard: bound at a NIC model's
/// first start and kept for as long as the manager runs, so a QEMU VM that reconnects finds
/// the same socket whether or not the model was started again meanwhile. (The file stays
/// after the manager; the next start replaces it as a stale socket.)
static LISTENERS: Mutex<Option<HashMap<String, (OwnedFd, outboard_sys::sockpath::SocketPath)>>> =
    Mutex::new(None);

/// A listening socket at `path` for a NIC whose cable is plugged in from the other end.
fn listener(path: &str) -> Result<OwnedFd, ModelError> {
    let mut all = LISTENERS.lock().unwrap_or_else(|p| p.into_inner());
    let listeners = all.get_or_insert_with(HashMap::new);
    if !listeners.contains_key(path) {
        let bound = outboard_sys::sockpath::bind_listener(
            std::path::Path::new(path),
            rustix::net::SocketType::STREAM,
            1,
        )
        .map_err(|e| ModelError::Cable(format!("stream_listen {path}: {e}")))?;
        listeners.insert(path.to_string(), bound);
    }
    listeners[path].0.try_clone().map_err(|e| ModelError::Os {
        what: "dup",
        err: e,
    })
}

pub(super) fn launch(d: &DeviceConfig, first_fd: i32) -> Result<Launch, ModelError> {
    // The keys were checked when the description was read.
    let mut fds = Vec::new();
    let wire = match d.settings.get("wire") {
        Some(w) => {
            fds.push(end(w, &d.name)?);
            Some(format!("fd:{first_fd}"))
        }
        None => None,
    };
    let mtu = d
        .settings
        .get("mtu")
        .and_then(|m| m.parse().ok())
        .unwrap_or(1500);
    let tap = match d.settings.get("tap") {
        Some(t) => {
            fds.push(tap(t, mtu)?);
            Some(format!("fd:{first_fd}"))
        }
        None => None,
    };
    let stream_listen = match d.settings.get("stream_listen") {
        Some(p) => {
            fds.push(listener(p)?);
            Some(format!("fd:{first_fd}"))
        }
        None => None,
    };
    Ok(Launch {
        own: ModelOwn::VirtioNet(VirtioNetOwn {
            mac: d
                .settings
                .get("mac")
                .cloned()
                .unwrap_or_else(|| default_mac(&d.name)),
            mtu,
            link_down: d.settings.get("link").is_some_and(|l| l == "down"),
            wire,
            stream: d.settings.get("stream").map(std::path::PathBuf::from),
            tap,
            stream_listen,
        }),
        fds,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_default_address_is_stable_local_and_unicast() {
        let m = default_mac("nic0");
        assert_eq!(m, default_mac("nic0"));
        assert_ne!(m, default_mac("nic1"));
        let b = parse_mac(&m).unwrap();
        assert_eq!(b[0], 2);
    }

    #[test]
    fn a_cable_has_two_ends_and_gives_each_device_its_own_again() {
        use std::os::fd::AsRawFd;
        let a = end("test-cable", "x").unwrap();
        let b = end("test-cable", "y").unwrap();
        rustix::net::send(&a, b"hello", rustix::net::SendFlags::empty()).unwrap();
        let mut buf = [0u8; 8];
        let n = rustix::net::recv(&b, &mut buf, rustix::net::RecvFlags::empty())
            .unwrap()
            .0;
        assert_eq!(&buf[..n], b"hello");
        // x starts again: the same cable end, so y still hears it.
        let a2 = end("test-cable", "x").unwrap();
        assert_ne!(a.as_raw_fd(), a2.as_raw_fd());
        rustix::net::send(&a2, b"again", rustix::net::SendFlags::empty()).unwrap();
        let n = rustix::net::recv(&b, &mut buf, rustix::net::RecvFlags::empty())
            .unwrap()
            .0;
        assert_eq!(&buf[..n], b"again");
        assert!(end("test-cable", "z").is_err());
    }
}
