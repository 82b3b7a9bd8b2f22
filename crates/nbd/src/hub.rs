//! A session per exported device, reserved by the export and shared by the connections that
//! find the driver server full.
//!
//! A session per connection costs each connection its own buffer area in the driver server,
//! whether or not it sends anything: a few idle connections take the server's whole budget.
//! A connection that is refused for that reason shares this session instead, and buffer
//! memory is taken per request in flight, from one pool: an idle connection here holds
//! nothing, and no connection may hold more than its share. (A session of its own stays the
//! first choice: going through the pump costs a hop each way, about 40% of the IOPS at queue
//! depth 1 on a 2-core machine.)
//!
//! A pump thread owns the session: it submits what connections queue, reaps completions and
//! routes each to its connection (whose eventfd it signals). A connection sees the hub
//! through [`HubDevice`], an ordinary [`BlockDevice`] whose tags are its own, and takes its
//! buffers through [`HubBuffers`].

use std::collections::{HashMap, HashSet, VecDeque};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use outboard_block::{BlockCompletion, BlockDevice, BlockError, BlockInfo, BlockRequest};
use outboard_client::{Buffer, BufferPool};
use outboard_shm::SharedMem;

use crate::server::Opener;

/// Bits of a tag that are the connection's own; the rest names the connection.
const LOCAL_BITS: u32 = 40;
const LOCAL_MASK: u64 = (1 << LOCAL_BITS) - 1;

/// A connection as the pump sees it.
#[derive(Default)]
struct Member {
    /// Completions for it, with its own tags.
    done: Vec<BlockCompletion>,
    /// Signalled when `done` grows or buffers come free.
    wake: Option<Arc<OwnedFd>>,
    /// Buffers it holds.
    holding: HashSet<u64>,
    /// Bytes of them.
    held: u64,
    /// Requests of it in the device.
    in_flight: usize,
    /// It went away with requests in the device: its buffers are freed as they complete.
    gone: bool,
    /// It found no buffer: woken when one comes free.
    waiting: bool,
}

struct State {
    /// Requests queued for the pump (global tags).
    queue: Vec<BlockRequest>,
    members: HashMap<u64, Member>,
    pool: BufferPool,
    /// Buffer offset → length, for everything handed out.
    lengths: HashMap<u64, u64>,
    /// The device failed (its driver was given up): every request gets this until the
    /// session resumes on a driver that is back.
    failed: Option<BlockError>,
    next_member: u64,
    stop: bool,
}

/// A device shared by connections.
pub struct Hub {
    state: Mutex<State>,
    /// Wakes the pump (requests queued, or stop).
    pump_wake: OwnedFd,
    info: BlockInfo,
    /// The session's buffer area, mapped a second time for the connections.
    buffers: SharedMem,
    /// Most bytes of buffers one connection may hold.
    share: u64,
    pump: Mutex<Option<std::thread::JoinHandle<()>>>,
}

fn eventfd() -> Result<OwnedFd, String> {
    rustix::event::eventfd(
        0,
        rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
    )
    .map_err(|e| format!("eventfd: {e}"))
}

fn signal(fd: BorrowedFd<'_>) {
    let _ = rustix::io::write(fd, &1u64.to_ne_bytes());
}

fn drain(fd: BorrowedFd<'_>) {
    let mut b = [0u8; 8];
    let _ = rustix::io::read(fd, &mut b);
}

/// Waits until one of `fds` is readable or `deadline` passes; which ones are.
fn wait_any(fds: &[BorrowedFd<'_>], deadline: Instant) -> Vec<bool> {
    let mut pfds: Vec<_> = fds
        .iter()
        .map(|f| rustix::event::PollFd::new(f, rustix::event::PollFlags::IN))
        .collect();
    let left = deadline.saturating_duration_since(Instant::now());
    let ts = rustix::time::Timespec {
        tv_sec: left.as_secs() as _,
        tv_nsec: left.subsec_nanos() as _,
    };
    let _ = rustix::event::poll(&mut pfds, Some(&ts));
    pfds.iter().map(|p| !p.revents().is_empty()).collect()
}

impl Hub {
    /// Opens `device` in a pump thread of its own, which then serves every connection.
    /// `None` if the device's buffer area cannot be shared (a driver linked into this
    /// process keeps it in private memory): then each connection opens its own session.
    /// Also says whether the device serves several sessions at once (what NBD calls
    /// multi-connection consistency).
    pub fn start(device: &str, open: &Opener) -> Result<(Option<Arc<Self>>, bool), BlockError> {
        let (tx, rx) = std::sync::mpsc::channel();
        let (open, name) = (open.clone(), device.to_string());
        let (hub_tx, hub_rx) = std::sync::mpsc::channel::<Arc<Hub>>();
        let pump = std::thread::Builder::new()
            .name(format!("nbd-hub-{device}"))
            .spawn(move || {
                let (mut dev, multi) = match open(&name) {
                    Ok(x) => x,
                    Err(e) => {
                        let _ = tx.send(Err(e));
                        return;
                    }
                };
                let mapped = dev.buffers().fd().map(|fd| {
                    SharedMem::map(fd, 0, dev.buffers().len(), outboard_shm::Access::ReadWrite)
                });
                match mapped {
                    Some(Ok(m)) => {
                        let _ = tx.send(Ok((Some((dev.info().clone(), m)), multi)));
                    }
                    _ => {
                        let _ = tx.send(Ok((None, multi)));
                        return;
                    }
                }
                if let Ok(hub) = hub_rx.recv() {
                    hub.run(dev.as_mut());
                }
            })
            .map_err(|e| BlockError::Unreachable(format!("a thread for {device}: {e}")))?;
        let (info, buffers, multi) = match rx.recv() {
            Ok(Ok((Some((i, b)), multi))) => (i, b, multi),
            Ok(Ok((None, multi))) => return Ok((None, multi)),
            Ok(Err(e)) => return Err(e),
            Err(_) => return Err(BlockError::Unreachable(format!("{device}: the hub died"))),
        };
        let align = (info.block_size as u64).max(4096);
        let area = buffers.len() as u64;
        let hub = Arc::new(Hub {
            state: Mutex::new(State {
                queue: Vec::new(),
                members: HashMap::new(),
                pool: BufferPool::new(area, align),
                lengths: HashMap::new(),
                failed: None,
                next_member: 1,
                stop: false,
            }),
            pump_wake: eventfd().map_err(BlockError::Unreachable)?,
            info,
            // A quarter of the area, but at least two of the largest requests.
            share: (area / 4).max((crate::server::MAX_PAYLOAD as u64 * 2).min(area)),
            buffers,
            pump: Mutex::new(Some(pump)),
        });
        let _ = hub_tx.send(hub.clone());
        Ok((Some(hub), multi))
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Every change under the lock is whole; a panicking holder leaves it consistent.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// What the device is.
    pub fn info(&self) -> &BlockInfo {
        &self.info
    }

    /// Size of the buffer area every connection's requests share.
    pub fn area(&self) -> u64 {
        self.buffers.len() as u64
    }

    /// Why new requests fail, while the device is failed.
    pub fn failed(&self) -> Option<BlockError> {
        self.lock().failed.clone()
    }

    /// A connection joins: its device and its buffers.
    pub fn join(self: &Arc<Self>) -> Result<(HubDevice, HubBuffers), BlockError> {
        let wake = Arc::new(eventfd().map_err(BlockError::Unreachable)?);
        let mut st = self.lock();
        if let Some(e) = &st.failed {
            return Err(e.clone());
        }
        let id = st.next_member;
        st.next_member += 1;
        st.members.insert(
            id,
            Member {
                wake: Some(wake.clone()),
                ..Member::default()
            },
        );
        drop(st);
        Ok((
            HubDevice {
                hub: self.clone(),
                id,
                wake: wake.clone(),
                in_flight: 0,
            },
            HubBuffers {
                hub: self.clone(),
                id,
            },
        ))
    }

    /// Stops the pump (what is in flight is abandoned with the session).
    pub fn stop(&self) {
        self.lock().stop = true;
        signal(self.pump_wake.as_fd());
        if let Some(p) = self.pump.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = p.join();
        }
    }

    /// The pump: submits, reaps, routes, until stopped.
    fn run(&self, dev: &mut dyn BlockDevice) {
        let mut backlog: VecDeque<BlockRequest> = VecDeque::new();
        let mut in_device: HashSet<u64> = HashSet::new();
        let mut done = Vec::new();
        loop {
            {
                let mut st = self.lock();
                if st.stop {
                    return;
                }
                backlog.extend(st.queue.drain(..));
            }
            let mut refused = Vec::new();
            while let Some(r) = backlog.front() {
                match dev.submit(r) {
                    Ok(()) => {
                        in_device.insert(r.tag);
                        backlog.pop_front();
                    }
                    // Room comes back as requests complete.
                    Err(BlockError::QueueFull) => break,
                    Err(e) => {
                        let r = backlog.pop_front().expect("front");
                        refused.push(BlockCompletion {
                            tag: r.tag,
                            result: Err(e),
                        });
                    }
                }
            }
            done.clear();
            done.append(&mut refused);
            let result = dev.kick().and_then(|()| dev.poll(&mut done));
            let result = match result {
                Ok(0) if done.is_empty() => dev
                    .wait_or_readable(
                        &mut done,
                        Duration::from_millis(500),
                        self.pump_wake.as_fd(),
                    )
                    .map(|woken| {
                        if woken {
                            drain(self.pump_wake.as_fd());
                        }
                    }),
                other => other.map(drop),
            };
            if let Err(e) = result {
                // The session failed for good (its client library resumes what can be
                // resumed): everything in it and everything after fails with the reason.
                tracing::error!("export device: {e}");
                done.extend(in_device.drain().map(|tag| BlockCompletion {
                    tag,
                    result: Err(e.clone()),
                }));
                done.extend(backlog.drain(..).map(|r| BlockCompletion {
                    tag: r.tag,
                    result: Err(e.clone()),
                }));
                self.lock().failed = Some(e);
            }
            for c in &done {
                in_device.remove(&c.tag);
            }
            self.route(&done);
            let answers: Option<Vec<_>> = {
                let mut st = self.lock();
                // Nothing more reaches a failed device: what was queued before it failed is
                // answered with the reason, at a calm pace.
                st.failed.clone().map(|e| {
                    st.queue
                        .drain(..)
                        .map(|r| BlockCompletion {
                            tag: r.tag,
                            result: Err(e.clone()),
                        })
                        .collect()
                })
            };
            if let Some(answers) = answers {
                self.route(&answers);
                let _ = wait_any(
                    &[self.pump_wake.as_fd()],
                    Instant::now() + Duration::from_millis(200),
                );
                drain(self.pump_wake.as_fd());
                // Given up is not forever: once the manager brings the device back (its
                // retry, or `outboard restart`), the session resumes and requests flow again.
                let given_up = matches!(self.lock().failed, Some(BlockError::DeviceFailed(_)));
                if given_up && dev.block_until(Instant::now()).is_ok() {
                    tracing::info!("export device: serving again");
                    self.lock().failed = None;
                }
            }
        }
    }

    /// Hands each completion to its connection, with the connection's own tag.
    fn route(&self, done: &[BlockCompletion]) {
        if done.is_empty() {
            return;
        }
        let mut st = self.lock();
        let mut woken = Vec::new();
        for c in done {
            let id = c.tag >> LOCAL_BITS;
            let Some(m) = st.members.get_mut(&id) else {
                continue;
            };
            m.in_flight = m.in_flight.saturating_sub(1);
            if m.gone {
                if m.in_flight == 0 {
                    let m = st.members.remove(&id).expect("member");
                    release_all(&mut st, &m);
                    Hub::wake_waiting(&mut st);
                }
                continue;
            }
            m.done.push(BlockCompletion {
                tag: c.tag & LOCAL_MASK,
                result: c.result.clone(),
            });
            if let Some(w) = &m.wake {
                woken.push(w.clone());
            }
        }
        drop(st);
        for w in woken {
            signal(w.as_fd());
        }
    }

    /// Buffers came free: wakes the connections that found none.
    fn wake_waiting(st: &mut State) {
        for m in st.members.values_mut().filter(|m| m.waiting) {
            m.waiting = false;
            if let Some(w) = &m.wake {
                signal(w.as_fd());
            }
        }
    }
}

/// Frees every buffer `m` holds.
fn release_all(st: &mut State, m: &Member) {
    for off in &m.holding {
        if let Some(len) = st.lengths.remove(off) {
            st.pool.free(Buffer { offset: *off, len });
        }
    }
}

impl Drop for Hub {
    fn drop(&mut self) {
        self.lock().stop = true;
        signal(self.pump_wake.as_fd());
    }
}

/// A connection's view of the shared device.
pub struct HubDevice {
    hub: Arc<Hub>,
    id: u64,
    wake: Arc<OwnedFd>,
    in_flight: usize,
}

impl HubDevice {
    fn take(&mut self, out: &mut Vec<BlockCompletion>) -> usize {
        drain(self.wake.as_fd());
        let mut st = self.hub.lock();
        let Some(m) = st.members.get_mut(&self.id) else {
            return 0;
        };
        let n = m.done.len();
        out.append(&mut m.done);
        self.in_flight = self.in_flight.saturating_sub(n);
        n
    }
}

impl BlockDevice for HubDevice {
    fn info(&self) -> &BlockInfo {
        &self.hub.info
    }

    fn buffers(&self) -> &SharedMem {
        &self.hub.buffers
    }

    fn submit(&mut self, r: &BlockRequest) -> Result<(), BlockError> {
        if r.tag > LOCAL_MASK {
            return Err(BlockError::Invalid(format!("tag {} is too large", r.tag)));
        }
        let mut st = self.hub.lock();
        if let Some(e) = &st.failed {
            return Err(e.clone());
        }
        let global = BlockRequest {
            tag: (self.id << LOCAL_BITS) | r.tag,
            ..*r
        };
        st.queue.push(global);
        if let Some(m) = st.members.get_mut(&self.id) {
            m.in_flight += 1;
        }
        self.in_flight += 1;
        Ok(())
    }

    fn kick(&mut self) -> Result<(), BlockError> {
        signal(self.hub.pump_wake.as_fd());
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<BlockCompletion>) -> Result<usize, BlockError> {
        Ok(self.take(out))
    }

    /// Unlike a device of its own, this waits even with nothing in flight: buffers held by
    /// other connections coming free also wake it.
    fn wait(
        &mut self,
        out: &mut Vec<BlockCompletion>,
        timeout: Duration,
    ) -> Result<usize, BlockError> {
        let deadline = Instant::now() + timeout;
        loop {
            let n = self.take(out);
            if n > 0 {
                return Ok(n);
            }
            if Instant::now() >= deadline {
                return if self.in_flight > 0 {
                    Err(BlockError::Timeout)
                } else {
                    Ok(0)
                };
            }
            wait_any(&[self.wake.as_fd()], deadline);
            if self.in_flight == 0 {
                // Woken for buffers (or nothing): the caller tries again.
                return Ok(self.take(out));
            }
        }
    }

    fn block_until(&mut self, deadline: Instant) -> Result<(), BlockError> {
        wait_any(&[self.wake.as_fd()], deadline);
        Ok(())
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }

    fn wait_or_readable(
        &mut self,
        out: &mut Vec<BlockCompletion>,
        timeout: Duration,
        also: BorrowedFd<'_>,
    ) -> Result<bool, BlockError> {
        if self.take(out) > 0 {
            return Ok(false);
        }
        let ready = wait_any(&[self.wake.as_fd(), also], Instant::now() + timeout);
        self.take(out);
        Ok(ready[1])
    }
}

impl Drop for HubDevice {
    fn drop(&mut self) {
        let mut st = self.hub.lock();
        let Some(m) = st.members.get_mut(&self.id) else {
            return;
        };
        m.done.clear();
        m.wake = None;
        if m.in_flight == 0 {
            let m = st.members.remove(&self.id).expect("member");
            release_all(&mut st, &m);
            Hub::wake_waiting(&mut st);
        } else {
            // The device may still write into its buffers: they are freed as its requests
            // complete.
            m.gone = true;
        }
    }
}

/// A connection's buffers, taken from the hub's pool per request.
pub struct HubBuffers {
    hub: Arc<Hub>,
    id: u64,
}

impl crate::transmit::Buffers for HubBuffers {
    fn alloc(&mut self, len: u64) -> Option<Buffer> {
        let mut st = self.hub.lock();
        let held = st.members.get(&self.id).map_or(0, |m| m.held);
        let b = if held + len > self.hub.share {
            None
        } else {
            st.pool.alloc(len)
        };
        let Some(b) = b else {
            if let Some(m) = st.members.get_mut(&self.id) {
                m.waiting = true;
            }
            return None;
        };
        st.lengths.insert(b.offset, b.len);
        if let Some(m) = st.members.get_mut(&self.id) {
            m.holding.insert(b.offset);
            m.held += b.len;
        }
        Some(b)
    }

    fn free(&mut self, b: Buffer) {
        let mut st = self.hub.lock();
        if let Some(m) = st.members.get_mut(&self.id) {
            if m.holding.remove(&b.offset) {
                m.held -= b.len;
                st.lengths.remove(&b.offset);
                st.pool.free(b);
                Hub::wake_waiting(&mut st);
            }
        }
    }
}
