//! One device per copy of a C driver's code in a process.

use std::collections::HashSet;
use std::sync::{Mutex, OnceLock};

use super::descriptor::CDriver;
use crate::personality::StartError;

/// The C drivers (by their operations table) with a live instance in this process. A C
/// driver keeps its state in its own statics, as a kernel's drivers do, so one copy of its code
/// drives one device: a second device for it needs a server of its own.
fn claimed() -> &'static Mutex<HashSet<usize>> {
    static CLAIMED: OnceLock<Mutex<HashSet<usize>>> = OnceLock::new();
    CLAIMED.get_or_init(|| Mutex::new(HashSet::new()))
}

/// A C driver's code, claimed for one device until this is dropped.
pub(crate) struct Claim(usize);

impl Claim {
    pub(crate) fn take(c: &CDriver, driver: &str) -> Result<Self, StartError> {
        let mut all = claimed().lock().unwrap_or_else(|p| p.into_inner());
        if !all.insert(c.code()) {
            return Err(StartError::Refused(format!(
                "{driver} already drives a device in this driver server, and a C driver keeps \
                 its state in statics: give each of its devices a server of its own"
            )));
        }
        Ok(Self(c.code()))
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        claimed()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.0);
    }
}
