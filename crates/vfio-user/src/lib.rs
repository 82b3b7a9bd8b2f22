//! The vfio-user protocol, written here, both sides.
//!
//! vfio-user (QEMU `docs/interop/vfio-user.rst`, protocol 0.1) carries the VFIO device
//! interface — regions, DMA mappings, interrupts, reset — over a UNIX stream socket with fd
//! passing. Outboard's device models are servers ([`Server`] + [`DeviceBackend`]); its hardware
//! layer is a client ([`Client`]).
//!
//! What is implemented: VERSION with JSON capabilities (including twin-socket mode),
//! DMA_MAP/UNMAP with and without fds, DEVICE_GET_INFO, DEVICE_GET_REGION_INFO with sparse mmap
//! areas and their fds, DEVICE_GET_REGION_IO_FDS (ioeventfds), DEVICE_GET_IRQ_INFO,
//! DEVICE_SET_IRQS (eventfd trigger, mask/unmask, software trigger), REGION_READ/WRITE (with
//! posted writes), DMA_READ/WRITE (over the twin socket), DEVICE_RESET.
//!
//! What is not: REGION_WRITE_MULTI, DEVICE_FEATURE and migration (answered with `ENOSYS`), dirty
//! page tracking, ioregionfds, and non-`AF_UNIX` transports.
//!
//! Both sides treat the peer as hostile: sizes are bounded before allocation, every payload is
//! decoded by [`wire`] (property-tested never to panic), a malformed command gets an error reply,
//! a malformed stream closes the connection, and every wait has a deadline.
#![deny(missing_docs)]

pub mod caps;
pub mod channel;
pub mod client;
pub mod dma;
pub mod server;
pub mod wire;

pub use channel::{Channel, ChannelError};

/// How long each side of a connection keeps checking for the other's next message before it
/// sleeps, by default ([`ClientOptions::spin`], [`ServerOptions::spin`]). Longer than a
/// wake-up from another CPU on a virtual machine (20–40 µs measured on the development VM),
/// so that the client's spin still covers the server's wake-up for the first command of a
/// burst, and short enough that an idle connection costs nothing measurable.
pub const DEFAULT_SPIN: std::time::Duration = std::time::Duration::from_micros(50);
pub use client::{Client, ClientError, ClientOptions, IoEventFd, RegionInfo};
pub use dma::{DmaError, DmaMap};
pub use server::{
    DeviceBackend, DeviceContext, IoFdDesc, Irqs, MmapDesc, RegionDesc, Server, ServerError,
    ServerOptions, ServerStats, Source,
};
