//! `--confine` and `--check-confinement` for the roles that touch devices: driver servers and
//! device models.

pub use outboard_manager::children::ConfineArgs;
