//! Opening a block device by name: the block class's side of open-by-name
//! (`outboard_client::open`). A URI (`nbd://HOST[:PORT]/EXPORT`, `nbd+unix:///EXPORT?socket=PATH`)
//! opens a remote disk over NBD instead, without the manager.

use std::path::Path;

use outboard_block::{BlockDevice, BlockError, CLASS};
use outboard_client::api::Placement;
use outboard_client::{ClassClient, Control, Supervisor};
use outboard_drivers::Attachment;
use outboard_hw::DeviceSpec;

use crate::colocated::Colocated;
use crate::session::{BlockClient, SessionOptions};

/// The block class, with the options its sessions open with.
#[derive(Debug, Clone, Copy, Default)]
pub struct Block {
    /// Session depth, buffer area, waiting.
    pub opts: SessionOptions,
}

impl ClassClient for Block {
    const CLASS: &'static str = CLASS;
    type Handle = Box<dyn BlockDevice>;
    type Error = BlockError;

    fn separate(
        &self,
        server: &Path,
        name: &str,
        supervisor: Supervisor,
    ) -> Result<Self::Handle, BlockError> {
        Ok(Box::new(BlockClient::open_supervised(
            supervisor, server, name, self.opts,
        )?))
    }

    fn colocated(&self, name: &str, device: DeviceSpec) -> Result<Self::Handle, BlockError> {
        Ok(Box::new(Colocated::open(
            name,
            &Attachment::Pci(device),
            self.opts.buffer_size as usize,
        )?))
    }

    fn not_there(e: &BlockError) -> bool {
        matches!(
            e,
            BlockError::DeviceGone | BlockError::NoSuchDevice(_) | BlockError::Timeout
        )
    }
}

/// Opens block device `name` wherever the machine places its driver: a session with its
/// driver server, or the driver linked into this process; or a remote disk by URI.
pub fn open_block(control_path: &Path, name: &str) -> Result<Box<dyn BlockDevice>, BlockError> {
    open_block_with(control_path, name, SessionOptions::default()).map(|(d, _)| d)
}

/// As [`open_block`], with the session's depth and buffer area chosen; also says where the
/// driver runs (a colocated driver serves one client at a time).
pub fn open_block_with(
    control_path: &Path,
    name: &str,
    opts: SessionOptions,
) -> Result<(Box<dyn BlockDevice>, Placement), BlockError> {
    open_block_via(&Control::from(control_path), name, opts)
}

/// As [`open_block_with`], asking the manager through `control` (a brokered client's
/// connection, say).
pub fn open_block_via(
    control: &Control,
    name: &str,
    opts: SessionOptions,
) -> Result<(Box<dyn BlockDevice>, Placement), BlockError> {
    // A remote disk's URI needs no manager: the same API reaches it over NBD.
    if crate::remote::is_uri(name) {
        let d = crate::remote::NbdClient::open(name, opts.buffer_size as usize)?;
        return Ok((Box::new(d), Placement::Separate));
    }
    outboard_client::open_via(control, name, &Block { opts })
}
