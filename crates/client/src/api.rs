//! The manager's control API: typed JSON messages on its SEQPACKET socket. Defined here, on
//! the client's side, so that clients speak it without linking the manager.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::registry::Node;

/// Where a device's driver runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Placement {
    /// In a driver server process.
    Separate,
    /// Linked into each client.
    Colocated,
}

/// A request to the manager.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case", deny_unknown_fields)]
pub enum Request {
    /// The registry.
    List,
    /// How to reach a class device by name.
    Open {
        /// Device name.
        name: String,
    },
    /// A class device's registry entry: its properties and state.
    Status {
        /// Device name.
        name: String,
    },
    /// Quiesce (`suspend`) a class device, or put it back in service (`resume`). Suspending
    /// stops its driver taking new requests, which wait, and finishes those in flight; the
    /// device's state then reads `suspended`. The reply is its registry entry at once.
    Power {
        /// Device name.
        name: String,
        /// Suspend (true) or resume (false).
        suspend: bool,
    },
    /// Attach devices at run time: `name`, one the machine declares detached, or every
    /// `[[device]]` table in `description` (machine-description syntax). The reply is the
    /// (last) class device's registry entry, once its driver serves.
    Attach {
        /// A declared device.
        #[serde(default)]
        name: Option<String>,
        /// New devices.
        #[serde(default)]
        description: Option<String>,
    },
    /// Detach a class device: its driver stops taking new requests, finishes those in flight,
    /// then it and the device are released. The reply is its registry entry at once (state
    /// `detaching`); once detached, opens and status requests answer `device-gone`.
    Detach {
        /// Device name.
        name: String,
    },
    /// Start a class device's driver again: one given up (its model too, if that was given
    /// up), or a running one (its server is ended and started again; clients replay). The
    /// crash history is forgiven. The reply is its registry entry at once (`restarting`).
    Restart {
        /// Device name.
        name: String,
        /// A running server drains first: its devices finish what is in them and take no
        /// more, then it is ended, so clients resume with nothing to replay.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        graceful: bool,
        /// The program the new server (and its later restarts) runs instead of the manager's
        /// own (a live upgrade): an absolute path to an executable file that only its owner,
        /// root or the manager's user, may write. Only the manager's user or root may ask.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        exe: Option<std::path::PathBuf>,
    },
    /// Moves class device `name`'s driver, live, into driver server `server`: one that runs
    /// for other devices (they share it from then on) or a new one of its own. Both servers
    /// drain first, as for a graceful restart, then start again with their new devices;
    /// clients resume on the device's new server with nothing to replay. The reply is its
    /// registry entry at once (`restarting`); it says `serving` once the move is done. The
    /// machine description is not rewritten: the next `up` places the device as it says.
    Move {
        /// Device name.
        name: String,
        /// Name of the driver server to run it in.
        server: String,
    },
    /// An export started by hand (`outboard export nbd`) says it serves `device` at `uri`, and
    /// says it again whenever its clients (`clients`: their addresses) change. It shows in
    /// the registry under the device as `export nbd:NAME` for as long as this connection
    /// stays open. The reply is [`Reply::Noted`].
    ExportUp {
        /// The export's name.
        name: String,
        /// The class device it serves.
        device: String,
        /// Where clients reach it.
        uri: String,
        /// Its clients now.
        clients: Vec<String>,
    },
    /// Stop the machine, as Ctrl-C on `outboard up` does: every export, driver server and
    /// device model stops, and their sockets and the control socket go. The reply
    /// ([`Reply::Stopping`]) comes first. Only the manager's user or root may ask.
    Down,
    /// A connection to the driver server of class device `name`, made by the manager and
    /// passed with the reply ([`Reply::Connected`]). Only on a broker connection, for a
    /// device the manager gave that child (see [`crate::link`]).
    Connect {
        /// Device name.
        name: String,
    },
}

/// The manager's answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "kebab-case", deny_unknown_fields)]
pub enum Reply {
    /// The registry tree.
    Registry {
        /// Root node.
        tree: Node,
    },
    /// Where the device is served.
    Open {
        /// The device's class (its driver's), for the client to check it speaks it.
        #[serde(default)]
        class: Option<String>,
        /// Placement.
        placement: Placement,
        /// The driver server's socket (separate).
        server: Option<PathBuf>,
        /// The device model's vfio-user socket (colocated: the client drives it).
        device: Option<PathBuf>,
    },
    /// The connection asked for with [`Request::Connect`] is the reply's one descriptor.
    Connected,
    /// The machine stops ([`Request::Down`]).
    Stopping,
    /// Taken into the registry ([`Request::ExportUp`]).
    Noted,
    /// A registry entry.
    Status {
        /// The class device's node.
        node: Node,
    },
    /// The request failed.
    Error {
        /// Machine-readable code.
        code: outboard_session::Code,
        /// What went wrong.
        message: String,
    },
}

impl<'de> Deserialize<'de> for Placement {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match String::deserialize(d)?.as_str() {
            "separate" => Ok(Placement::Separate),
            "colocated" => Ok(Placement::Colocated),
            other => Err(serde::de::Error::custom(format!(
                "unknown placement {other:?}"
            ))),
        }
    }
}
