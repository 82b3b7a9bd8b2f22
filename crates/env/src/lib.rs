//! The driver execution environment (the native work-loop model).
//!
//! A driver runs on one thread that the environment owns: it waits on event sources —
//! interrupt eventfds, timerfds, session doorbells, control sockets — in a [`WorkLoop`] and
//! calls the driver for each one ([`Driver::handle`]), so nothing inside a driver needs a lock.
//! The environment also provides what a driver needs from the host: DMA mappings
//! ([`DeviceEnv`]), timers and deadlines ([`Timer`]), and failure events ([`Failure`]). The
//! `osenv` legacy model (Fluke: drivers written for a uniprocessor kernel) is [`legacy`]; it
//! shares these services.
#![deny(missing_docs)]

pub mod bound;
pub mod driver;
pub mod legacy;
pub mod timer;
pub mod workloop;

pub use bound::{downcast, AnyDriver, WrongClass};
pub use driver::{
    DeviceEnv, DeviceEvent, Driver, EnvError, Failure, Fence, Mapping, WaitError, Waiter,
};
pub use timer::Timer;
pub use workloop::{LoopError, WorkLoop};

#[cfg(test)]
mod tests {
    use super::*;
    use rustix::event::{eventfd, EventfdFlags};
    use std::os::fd::AsFd;
    use std::time::{Duration, Instant};

    #[derive(Debug, Clone, Copy, PartialEq)]
    enum Src {
        A,
        B(u32),
        Tick,
    }

    #[test]
    fn reports_what_fired_as_the_value_it_was_registered_with() {
        let mut wl = WorkLoop::new().unwrap();
        let a = eventfd(0, EventfdFlags::NONBLOCK).unwrap();
        let b = eventfd(0, EventfdFlags::NONBLOCK).unwrap();
        wl.add(a.as_fd(), Src::A).unwrap();
        wl.add(b.as_fd(), Src::B(7)).unwrap();
        let mut ready = Vec::new();
        assert_eq!(
            wl.wait(Some(Duration::from_millis(1)), &mut ready).unwrap(),
            0
        );
        rustix::io::write(&b, &1u64.to_ne_bytes()).unwrap();
        wl.wait(Some(Duration::from_secs(1)), &mut ready).unwrap();
        assert_eq!(ready, vec![Src::B(7)]);
    }

    /// A device's loss source is its connection's socket, which is also readable while a
    /// reply to another of the driver's threads is on its way (a legacy driver's interrupt
    /// thread reaches the device beside the loop): only a hang-up is a loss.
    #[test]
    fn a_loss_source_fires_at_the_hang_up_not_at_data() {
        use crate::{DeviceEvent, Waiter};
        let (mine, peer) = rustix::net::socketpair(
            rustix::net::AddressFamily::UNIX,
            rustix::net::SocketType::SEQPACKET,
            rustix::net::SocketFlags::CLOEXEC,
            None,
        )
        .unwrap();
        let mut w = Waiter::new(vec![(DeviceEvent::Lost, mine.as_fd())]).unwrap();
        let mut seen = Vec::new();
        rustix::io::write(&peer, b"a reply for another thread").unwrap();
        w.wait_and_handle(Duration::from_millis(20), |e| {
            seen.push(e);
            Ok(())
        })
        .unwrap();
        assert!(seen.is_empty(), "data was taken for a loss: {seen:?}");
        drop(peer);
        w.wait_and_handle(Duration::from_secs(1), |e| {
            seen.push(e);
            Ok(())
        })
        .unwrap();
        assert_eq!(seen, vec![DeviceEvent::Lost]);
    }

    #[test]
    fn a_removed_source_is_not_reported_and_its_slot_is_reused() {
        let mut wl = WorkLoop::new().unwrap();
        let a = eventfd(0, EventfdFlags::NONBLOCK).unwrap();
        let b = eventfd(0, EventfdFlags::NONBLOCK).unwrap();
        wl.add(a.as_fd(), Src::A).unwrap();
        wl.remove(a.as_fd()).unwrap();
        rustix::io::write(&a, &1u64.to_ne_bytes()).unwrap();
        wl.add(b.as_fd(), Src::B(1)).unwrap();
        rustix::io::write(&b, &1u64.to_ne_bytes()).unwrap();
        let mut ready = Vec::new();
        wl.wait(Some(Duration::from_secs(1)), &mut ready).unwrap();
        assert_eq!(ready, vec![Src::B(1)]);
    }

    #[test]
    fn a_timer_wakes_the_loop_when_due_and_not_before() {
        let mut wl = WorkLoop::new().unwrap();
        let mut t = Timer::new().unwrap();
        wl.add(t.fd(), Src::Tick).unwrap();
        let start = Instant::now();
        t.arm_at(start + Duration::from_millis(30)).unwrap();
        let mut ready = Vec::new();
        wl.wait(Some(Duration::from_secs(5)), &mut ready).unwrap();
        assert_eq!(ready, vec![Src::Tick]);
        assert!(start.elapsed() >= Duration::from_millis(30));
        t.ack();
        assert_eq!(t.due(), None);
        ready.clear();
        assert_eq!(
            wl.wait(Some(Duration::from_millis(20)), &mut ready)
                .unwrap(),
            0
        );
    }

    #[test]
    fn a_disarmed_timer_stays_quiet() {
        let mut wl = WorkLoop::new().unwrap();
        let mut t = Timer::new().unwrap();
        wl.add(t.fd(), Src::Tick).unwrap();
        t.arm_at(Instant::now() + Duration::from_millis(10))
            .unwrap();
        t.disarm().unwrap();
        let mut ready = Vec::new();
        assert_eq!(
            wl.wait(Some(Duration::from_millis(40)), &mut ready)
                .unwrap(),
            0
        );
    }

    #[test]
    fn a_timer_armed_in_the_past_fires_at_once() {
        let mut wl = WorkLoop::new().unwrap();
        let mut t = Timer::new().unwrap();
        wl.add(t.fd(), Src::Tick).unwrap();
        t.arm_at(Instant::now() - Duration::from_secs(1)).unwrap();
        let mut ready = Vec::new();
        assert_eq!(
            wl.wait(Some(Duration::from_secs(1)), &mut ready).unwrap(),
            1
        );
    }
}
