//! Outboard's client against servers that behave as libvfio-user's does (its
//! `lib/libvfio-user.c`), message by message: a scripted server plays each part.

mod common;

use std::os::fd::{AsFd, OwnedFd};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use outboard_shm::SharedMem;
use outboard_vfio_user::wire::{self, cmd, region, Header};
use outboard_vfio_user::{Channel, Client, ClientError, ClientOptions};

/// What the scripted server saw: (command, payload, number of fds).
type Seen = mpsc::Receiver<(u16, Vec<u8>, usize)>;

/// Serves one client on a socket pair: VERSION with `caps` (JSON), DEVICE_GET_INFO, and every
/// other command through `answer` (payload and fds, or an errno).
fn scripted(
    caps: &'static str,
    mut answer: impl FnMut(u16, &[u8]) -> Result<(Vec<u8>, Vec<OwnedFd>), u32> + Send + 'static,
) -> (Client, Seen) {
    let (ours, theirs) = rustix::net::socketpair(
        rustix::net::AddressFamily::UNIX,
        rustix::net::SocketType::STREAM,
        rustix::net::SocketFlags::CLOEXEC,
        None,
    )
    .unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let chan = Channel::new(theirs);
        while let Ok(m) = chan.recv(Instant::now() + Duration::from_secs(30)) {
            let h = m.header;
            let _ = tx.send((h.command, m.payload.clone(), m.fds.len()));
            let reply = match h.command {
                cmd::VERSION => Ok((
                    wire::Version {
                        major: 0,
                        minor: 1,
                        json: caps.into(),
                    }
                    .encode(),
                    vec![],
                )),
                cmd::DEVICE_GET_INFO => Ok((
                    wire::DeviceInfo {
                        argsz: 16,
                        flags: wire::device::FLAG_PCI,
                        num_regions: 9,
                        num_irqs: 5,
                    }
                    .encode(),
                    vec![],
                )),
                c => answer(c, &m.payload),
            };
            let sent = match reply {
                Ok((p, fds)) => {
                    let b: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
                    chan.send(&Header::reply(&h, p.len()), &p, &b)
                }
                Err(e) => chan.send(&Header::error_reply(&h, e), &[], &[]),
            };
            if sent.is_err() {
                return;
            }
        }
    });
    let c = Client::from_fd(ours, ClientOptions::default()).expect("negotiates");
    (c, rx)
}

fn memfd() -> OwnedFd {
    SharedMem::create("bar", 4096)
        .unwrap()
        .fd()
        .unwrap()
        .try_clone_to_owned()
        .unwrap()
}

/// libvfio-user answers a short REGION_INFO with the full `argsz`, FLAG_MMAP set, no
/// FLAG_CAPS and no fd; the fd comes only with the full reply. (Outboard's client used to ask
/// again only when FLAG_CAPS was set, and failed: "mmappable region came with 0 fds".)
#[test]
fn region_info_asks_again_for_a_larger_reply_and_takes_its_fd() {
    let (mut c, _seen) = scripted("{}", |command, payload| {
        assert_eq!(command, cmd::DEVICE_GET_REGION_INFO);
        let req = wire::RegionInfo::decode(payload).unwrap();
        let info = wire::RegionInfo {
            index: req.index,
            flags: region::FLAG_READ | region::FLAG_WRITE | region::FLAG_MMAP,
            size: 0x2000,
            sparse: vec![wire::SparseArea {
                offset: 0x1000,
                size: 0x1000,
            }],
            ..Default::default()
        };
        let reply = info.encode_reply(req.argsz);
        let whole = wire::RegionInfo::is_whole_reply(&reply);
        Ok((reply, if whole { vec![memfd()] } else { vec![] }))
    });
    let r = c.region_info(region::BAR0).unwrap();
    assert!(r.fd.is_some(), "the fd of the full reply");
    assert_eq!(r.info.sparse.len(), 1);
    assert_ne!(r.info.flags & region::FLAG_MMAP, 0);
}

/// A region flagged mmappable whose fd never comes is trapped, not an error.
#[test]
fn a_mappable_region_without_an_fd_is_trapped() {
    let (mut c, _seen) = scripted("{}", |_, payload| {
        let req = wire::RegionInfo::decode(payload).unwrap();
        let info = wire::RegionInfo {
            index: req.index,
            flags: region::FLAG_READ | region::FLAG_MMAP,
            size: 0x1000,
            ..Default::default()
        };
        Ok((info.encode_reply(req.argsz), vec![]))
    });
    let r = c.region_info(region::BAR0).unwrap();
    assert!(r.fd.is_none());
    assert_eq!(r.info.flags & region::FLAG_MMAP, 0);
}

/// A server that announced max_msg_fds 8 gets 16 MSI-X eventfds as two SET_IRQS, each naming
/// its own range of vectors. (All 16 used to go in one message.)
#[test]
fn set_irqs_is_split_by_the_servers_max_msg_fds() {
    let (mut c, seen) = scripted(r#"{"capabilities":{"max_msg_fds":8}}"#, |_, _| {
        Ok((vec![], vec![]))
    });
    let efds: Vec<OwnedFd> = (0..16)
        .map(|_| rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC).unwrap())
        .collect();
    let b: Vec<_> = efds.iter().map(|f| f.as_fd()).collect();
    c.set_irq_eventfds(wire::irq::MSIX, 0, &b).unwrap();
    let sets: Vec<_> = seen
        .try_iter()
        .filter(|(command, ..)| *command == cmd::DEVICE_SET_IRQS)
        .map(|(_, p, n)| (wire::IrqSet::decode(&p).unwrap(), n))
        .collect();
    assert_eq!(sets.len(), 2);
    for (i, (s, n)) in sets.iter().enumerate() {
        assert_eq!((s.start, s.count, *n), (i as u32 * 8, 8, 8));
    }
}

/// Without a twin socket a server sends DMA_READ/WRITE on the main socket, in the middle of
/// the client's own exchanges: memory without an fd is refused before anything is sent.
#[test]
fn memory_without_an_fd_needs_a_twin_socket() {
    let (mut c, seen) = scripted("{}", |_, _| Ok((vec![], vec![])));
    let mem = std::sync::Arc::new(SharedMem::create("inband", 4096).unwrap());
    let e = c.dma_map_in_band(0x1000, mem, 3).unwrap_err();
    assert!(matches!(e, ClientError::Unsupported { .. }), "{e}");
    assert!(e.to_string().contains("twin socket"), "{e}");
    assert!(seen.try_iter().all(|(command, ..)| command != cmd::DMA_MAP));
}

/// libvfio-user announces sizes as 64-bit numbers; 2^33 must not be refused, and reads larger
/// than a small announced limit are split to fit it.
#[test]
fn announced_sizes_are_clamped_and_honoured() {
    let (_c, _) = scripted(
        r#"{"capabilities":{"max_msg_fds":16,"max_data_xfer_size":8589934592}}"#,
        |_, _| Ok((vec![], vec![])),
    );
    let (mut c, seen) = scripted(
        r#"{"capabilities":{"max_data_xfer_size":1024}}"#,
        |_, payload| {
            let a = wire::RegionAccess::decode(payload, false).unwrap();
            assert!(a.count <= 1024, "a {}-byte read", a.count);
            Ok((
                wire::RegionAccess {
                    data: vec![a.offset as u8; a.count as usize],
                    ..a
                }
                .encode(),
                vec![],
            ))
        },
    );
    let mut buf = vec![0u8; 3000];
    c.region_read(region::BAR0, 0, &mut buf).unwrap();
    assert_eq!(buf[0], 0);
    assert_eq!(buf[1024], (1024 & 0xff) as u8);
    assert_eq!(buf[2048], (2048 & 0xff) as u8);
    let reads = seen
        .try_iter()
        .filter(|(command, ..)| *command == cmd::REGION_READ)
        .count();
    assert_eq!(reads, 3);
}
