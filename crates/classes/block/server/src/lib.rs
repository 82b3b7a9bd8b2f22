//! The block class's half of a driver server: its [`Dispatcher`](outboard_server::Dispatcher)
//! ([`dispatcher`]) and the range locks that order partial-block writes ([`ranges`]). The
//! server core knows no class; a driver server registers this one.
#![deny(missing_docs)]

pub mod dispatcher;
pub mod ranges;

pub use dispatcher::BlockDispatcher;
