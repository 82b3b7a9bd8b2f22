//! Why a request between Outboard's processes was refused: one code from a closed list and a
//! reason for people, the same type in the driver server's replies, the manager's replies and
//! what the client library returns. The code is what programs branch on; the reason travels
//! unchanged from whoever refused to whoever asked.

use serde::{Deserialize, Serialize};

/// What kind of refusal it is. On the wire a kebab-case string; a code this build does not
/// know reads as [`Code::Unknown`] (a newer peer), never as an error of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Code {
    /// No device of that name here.
    NoSuchDevice,
    /// The device is of another class than the one asked for.
    WrongClass,
    /// The request is malformed or not allowed as asked.
    Invalid,
    /// Someone else holds it, or a limit is reached: try again later or elsewhere.
    Busy,
    /// The server could not get memory, descriptors or mappings for it.
    Resources,
    /// The device is being brought back: try again shortly.
    Restarting,
    /// The server restarted while the request was in flight, and the class's policy is not to
    /// send it again: it may or may not have taken effect (a serial port's transmitted bytes).
    Interrupted,
    /// The device failed; the reason says why.
    DeviceFailed,
    /// The restart policy gave the device up (a crash loop): not served now, but the manager
    /// retries it on a slow schedule and `outboard restart` brings it back at once, so a
    /// client may ask again later. Classes report it as their device-failed error.
    GivenUp,
    /// The device is no longer part of the machine (detached), or its server is gone.
    DeviceGone,
    /// Attaching the device failed; the reason says why.
    AttachFailed,
    /// The caller may not ask this (the control socket's peer check).
    Denied,
    /// Whoever should answer is not there (no manager, no server at that socket).
    Unreachable,
    /// No answer in time.
    Timeout,
    /// The peer broke the protocol.
    Protocol,
    /// A code this build does not know.
    #[serde(other)]
    Unknown,
}

impl Code {
    /// The code as it is written on the wire (`no-such-device`).
    pub fn as_str(self) -> &'static str {
        match self {
            Code::NoSuchDevice => "no-such-device",
            Code::WrongClass => "wrong-class",
            Code::Invalid => "invalid",
            Code::Busy => "busy",
            Code::Resources => "resources",
            Code::Restarting => "restarting",
            Code::Interrupted => "interrupted",
            Code::DeviceFailed => "device-failed",
            Code::GivenUp => "given-up",
            Code::DeviceGone => "device-gone",
            Code::AttachFailed => "attach-failed",
            Code::Denied => "denied",
            Code::Unreachable => "unreachable",
            Code::Timeout => "timeout",
            Code::Protocol => "protocol",
            Code::Unknown => "unknown",
        }
    }
}

impl std::fmt::Display for Code {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A refusal: its code and the reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason}")]
pub struct Refusal {
    /// What kind.
    pub code: Code,
    /// Why, for people.
    pub reason: String,
}

impl Refusal {
    /// A refusal with `code` because of `reason`.
    pub fn new(code: Code, reason: impl Into<String>) -> Self {
        Self {
            code,
            reason: reason.into(),
        }
    }
}

/// Implements `From<Refusal>` for a class's error type, the same mapping for every class: the
/// variants `NoSuchDevice(String)`, `DeviceFailed(String)`, `Restarting`, `DeviceGone`,
/// `Busy(String)`, `Unreachable(String)`, `Timeout`, `Protocol(String)`, `Invalid(String)` and
/// `Refused { code, reason }` take the codes of their names (`GivenUp` and `AttachFailed` are
/// a failed device, `Resources` is busy; `WrongClass`, `Denied` and `Unknown` keep their code
/// in `Refused`); the class says what `Interrupted` (a request a dead server may have carried
/// out) is to it, with the refusal bound to the name it gives.
///
/// ```ignore
/// outboard_session::from_refusal!(EntropyError, |r| EntropyError::Io(r.reason));
/// ```
#[macro_export]
macro_rules! from_refusal {
    ($err:ident, |$r:ident| $interrupted:expr) => {
        impl From<$crate::Refusal> for $err {
            /// A refusal from a driver server or the manager, as this class's client sees it.
            fn from($r: $crate::Refusal) -> Self {
                use $crate::Code;
                match $r.code {
                    Code::NoSuchDevice => $err::NoSuchDevice($r.reason),
                    Code::DeviceFailed | Code::GivenUp | Code::AttachFailed => {
                        $err::DeviceFailed($r.reason)
                    }
                    Code::Restarting => $err::Restarting,
                    Code::Interrupted => $interrupted,
                    Code::DeviceGone => $err::DeviceGone,
                    Code::Busy | Code::Resources => $err::Busy($r.reason),
                    Code::Unreachable => $err::Unreachable($r.reason),
                    Code::Timeout => $err::Timeout,
                    Code::Protocol => $err::Protocol($r.reason),
                    Code::Invalid => $err::Invalid($r.reason),
                    Code::WrongClass | Code::Denied | Code::Unknown => $err::Refused {
                        code: $r.code,
                        reason: $r.reason,
                    },
                }
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_written_as_their_wire_names_and_unknown_ones_still_read() {
        for c in [
            Code::NoSuchDevice,
            Code::WrongClass,
            Code::Invalid,
            Code::Busy,
            Code::Resources,
            Code::Restarting,
            Code::Interrupted,
            Code::DeviceFailed,
            Code::GivenUp,
            Code::DeviceGone,
            Code::AttachFailed,
            Code::Denied,
            Code::Unreachable,
            Code::Timeout,
            Code::Protocol,
        ] {
            let wire = serde_json::to_string(&c).unwrap();
            assert_eq!(wire, format!("\"{}\"", c.as_str()));
            assert_eq!(serde_json::from_str::<Code>(&wire).unwrap(), c);
        }
        assert_eq!(
            serde_json::from_str::<Code>("\"from-the-future\"").unwrap(),
            Code::Unknown
        );
    }
}
