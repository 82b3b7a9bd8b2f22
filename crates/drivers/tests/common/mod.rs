//! What the drivers' tests share: a device model served over vfio-user from a thread of the
//! test, a stand-in for a driver server's work loop, and the lock that keeps a C driver (its
//! state in statics) one instance at a time.

#![allow(dead_code)] // each test binary uses part of it

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use outboard_env::{DeviceEvent, Driver};
use outboard_hw::DeviceSpec;

/// Serves `model` at `dir/name` until the returned flag is set.
pub fn serve_model<M>(dir: &std::path::Path, name: &str, model: M) -> (DeviceSpec, Arc<AtomicBool>)
where
    M: outboard_vfio_user::DeviceBackend + Send + 'static,
{
    let path = dir.join(name);
    let mut server = outboard_vfio_user::Server::bind(
        &path,
        model,
        outboard_vfio_user::ServerOptions::default(),
    )
    .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let s = stop.clone();
    std::thread::spawn(move || server.run(&s));
    (
        format!("vfio-user:{}", path.display()).parse().unwrap(),
        stop,
    )
}

/// A C driver keeps its state in statics: one instance at a time in this process.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

pub fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner())
}

/// Stands in for a driver server's loop: waits on the driver's vector 0 and calls `handle`
/// (which calls the driver on this thread) each time it fired, until `done` or `within`.
pub fn pump<D: Driver>(driver: &mut D, within: Duration, mut done: impl FnMut(&mut D) -> bool) {
    let deadline = Instant::now() + within;
    let bell = driver
        .sources()
        .iter()
        .find(|(e, _)| *e == DeviceEvent::Interrupt(0))
        .map(|(_, fd)| rustix::io::dup(fd).unwrap())
        .expect("an interrupt source");
    while !done(driver) && Instant::now() < deadline {
        let mut p = [rustix::event::PollFd::new(
            &bell,
            rustix::event::PollFlags::IN,
        )];
        let ms = rustix::time::Timespec {
            tv_sec: 0,
            tv_nsec: 20_000_000,
        };
        if rustix::event::poll(&mut p, Some(&ms)).unwrap() > 0 {
            driver.handle(DeviceEvent::Interrupt(0)).unwrap();
        }
    }
}
