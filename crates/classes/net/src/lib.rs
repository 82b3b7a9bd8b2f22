//! The network class (Mach's device interface for a network), one folder: its contract with
//! clients ([`contract`]: requests, completions, status, errors, ring entries), its packet
//! filter ([`bpf`]: classic BPF, checked like the kernel's checker and run on every received
//! frame; [`reception`]: the rule that decides whose a frame is) and its contract with drivers ([`driver`]: [`NetDriver`] and its class-free binding).
//! Its dispatcher in a driver server is `server/` (`outboard-net-server`), its client `client/`
//! (`outboard-net-client`).
//!
//! A client transmits frames from its buffer area (the device reads them there: zero copy) and
//! posts pieces of its buffer area to receive into; every frame the device receives is offered
//! to each session on the NIC, and a session whose filter accepts it (no filter: frames to the
//! NIC's address, broadcast and the multicast groups it joined; promiscuous: every frame) gets
//! it in its oldest posted buffer. Several sessions may share one NIC.
#![deny(missing_docs)]

pub mod bpf;
pub mod contract;
pub mod driver;
pub mod reception;

pub use contract::*;
pub use driver::{bind, unbind, NetBinding, NetDriver};
