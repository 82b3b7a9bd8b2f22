//! The char class's half of a driver server: its dispatcher ([`dispatcher`]). The server
//! core knows no class; a driver server registers this one.
#![deny(missing_docs)]

pub mod dispatcher;

pub use dispatcher::CharDispatcher;
