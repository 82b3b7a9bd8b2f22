//! The network class's half of a driver server: its dispatcher ([`dispatcher`]), which
//! transmits sessions' frames, runs each session's packet filter on every received frame and
//! hands the frame to the sessions that take it. The server core knows no class; a driver
//! server registers this one.
#![deny(missing_docs)]

pub mod dispatcher;

pub use dispatcher::NetDispatcher;
