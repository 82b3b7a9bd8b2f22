//! The JSON capabilities exchanged in VERSION.

use serde::{Deserialize, Serialize};

use crate::wire::{MAX_DATA_XFER, MAX_FDS};

/// Major protocol version spoken here (as QEMU and libvfio-user do).
pub const MAJOR: u16 = 0;
/// Minor protocol version spoken here.
pub const MINOR: u16 = 1;

/// Top-level JSON object.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
pub struct VersionData {
    /// Capabilities; absent means all defaults.
    #[serde(default)]
    pub capabilities: Capabilities,
}

/// Capabilities (unknown names are ignored, as the spec requires for forward compatibility).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Capabilities {
    /// Most fds the sender can receive in one message.
    #[serde(default = "default_max_msg_fds")]
    pub max_msg_fds: u32,
    /// Largest data transfer the sender accepts. Any value a peer announces is accepted
    /// (libvfio-user sends 64-bit values); what is used is clamped to what Outboard handles
    /// ([`Capabilities::data_xfer_limit`]).
    #[serde(default = "default_max_data_xfer")]
    pub max_data_xfer_size: u64,
    /// Twin-socket mode for server-to-client commands.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub twin_socket: Option<TwinSocket>,
}

/// The `twin_socket` capability.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
pub struct TwinSocket {
    /// Whether the sender supports (client) or enabled (server) twin-socket mode.
    #[serde(default)]
    pub supported: bool,
    /// Index of the server-to-client socket among the reply's fds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fd_index: Option<u32>,
}

fn default_max_msg_fds() -> u32 {
    1
}
fn default_max_data_xfer() -> u64 {
    MAX_DATA_XFER as u64
}

impl Default for Capabilities {
    fn default() -> Self {
        Self {
            max_msg_fds: default_max_msg_fds(),
            max_data_xfer_size: default_max_data_xfer(),
            twin_socket: None,
        }
    }
}

impl Capabilities {
    /// What this implementation offers.
    pub fn ours(twin: Option<TwinSocket>) -> Self {
        Self {
            max_msg_fds: MAX_FDS as u32,
            max_data_xfer_size: MAX_DATA_XFER as u64,
            twin_socket: twin,
        }
    }

    /// The most bytes one message to this peer may carry as data: what it announced, but no
    /// more than Outboard itself handles, and at least one byte.
    pub fn data_xfer_limit(&self) -> usize {
        self.max_data_xfer_size.clamp(1, MAX_DATA_XFER as u64) as usize
    }

    /// The most fds one message to this peer may carry: what it announced, but no more than
    /// Outboard sends in one message.
    pub fn fds_limit(&self) -> usize {
        (self.max_msg_fds as usize).min(MAX_FDS)
    }
}

/// Parses a peer's capability JSON; empty means defaults.
pub fn parse(json: &str) -> Result<Capabilities, serde_json::Error> {
    if json.trim().is_empty() {
        return Ok(Capabilities::default());
    }
    Ok(serde_json::from_str::<VersionData>(json)?.capabilities)
}

/// Serialises capabilities for a VERSION message.
pub fn to_json(caps: &Capabilities) -> String {
    serde_json::to_string(&VersionData {
        capabilities: caps.clone(),
    })
    .expect("capabilities serialise")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_peers_with_unknown_and_missing_fields() {
        let c = parse(r#"{"capabilities":{"max_msg_fds":8,"migration":{"pgsize":4096}}}"#).unwrap();
        assert_eq!(c.max_msg_fds, 8);
        assert_eq!(c.max_data_xfer_size, MAX_DATA_XFER as u64);
        assert!(parse("").is_ok());
        assert!(parse("{not json").is_err());
    }

    #[test]
    fn sizes_past_32_bits_are_accepted_and_clamped() {
        let c = parse(r#"{"capabilities":{"max_msg_fds":64,"max_data_xfer_size":8589934592}}"#)
            .unwrap();
        assert_eq!(c.max_data_xfer_size, 1 << 33);
        assert_eq!(c.data_xfer_limit(), MAX_DATA_XFER as usize);
        assert_eq!(c.fds_limit(), MAX_FDS);
        let small =
            parse(r#"{"capabilities":{"max_msg_fds":1,"max_data_xfer_size":1024}}"#).unwrap();
        assert_eq!((small.data_xfer_limit(), small.fds_limit()), (1024, 1));
    }
}
