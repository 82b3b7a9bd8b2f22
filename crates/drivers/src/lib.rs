//! Outboard's drivers.
//!
//! Each driver is split Mach-style into generic code shared by a family ([`virtio`]: the PCI
//! transport and the split virtqueue) and device-specific code ([`virtio_blk`]). Drivers reach
//! hardware only through `outboard-hw`, so the same code drives an Outboard device model over
//! vfio-user, a model in-process, or a real function through VFIO.
//!
//! Each driver implements the environment's contract (`outboard_env::Driver`) and one trait
//! per class it serves (`outboard_block::BlockDriver`). [`personalities`] is the driver side of matching (I/O Kit): what each driver can drive and
//! how well; the device manager's catalog is built from it.
#![deny(missing_docs)]

pub mod hosted;
pub mod legacy;
pub mod native_c;
pub mod null_blk;
pub mod personality;
pub mod timer;
pub mod virtio;
pub mod virtio_blk;
pub mod virtio_block;
pub mod virtio_net;
pub mod virtio_rng;

pub use legacy::library::{
    answer_probe, load as load_library, register_described, set_remote_prober,
    shown as shown_library_text, Described as DescribedLibrary, LibraryError, ProbeAnswer,
    ProbeRequest,
};
pub use personality::{
    by_name, candidates, personalities, probe_driver, restarter, start, start_colocated,
    Attachment, DriverFault, Identity, Personality, Probe, Probed, StartError, StartOptions,
    Started, NO_MATCH,
};
