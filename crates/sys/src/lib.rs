//! Operating-system helpers shared by several layers.
//!
//! [`sockpath`] claims a UNIX socket path the safe way: it replaces only a *stale* socket, never a
//! regular file and never a socket someone still listens on, and it removes on exit only the
//! socket it bound itself. [`process`] holds the process plumbing: children that die with
//! their parent, descriptors passed across exec, SIGPIPE.
#![deny(missing_docs)]

pub mod packet;
pub mod poll;
pub mod process;
pub mod sockpath;
pub mod timer;
pub mod units;
pub mod wait;

pub use sockpath::{bind_listener, connect_now, is_live, SockPathError, SocketPath};

/// `println!` for processes that serve others: a closed stdout (the terminal or pipe it was
/// started on went away) is not a reason to stop serving. `println!` panics on a write error,
/// and with SIGPIPE ignored a closed pipe is one.
#[macro_export]
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}

/// `eprintln!` for processes that serve others (see [`outln!`]).
#[macro_export]
macro_rules! errln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}
pub mod tap;
