//! A started driver whose class is not named: what the driver catalog hands out and what the
//! server core and the colocated client pass around without knowing any class.
//!
//! A class's driver trait (block's `BlockDriver`, entropy's `EntropyDriver`) lives in that
//! class's folder. A personality's `start` returns the driver behind that trait wrapped in the
//! class's binding, which implements [`AnyDriver`]; whoever serves the class (its dispatcher in
//! a driver server, its colocated handle in a client) takes the typed driver back out with
//! [`AnyDriver::into_any`] and a downcast to that binding. Only the class's own code names the
//! binding, so nothing between the catalog and the class needs to know which classes exist.

use std::any::Any;

use crate::driver::Driver;

/// A started driver of some class.
pub trait AnyDriver: Send {
    /// The class it serves, as sessions name it (`block`, `entropy`).
    fn class(&self) -> &'static str;
    /// Its environment side: event sources, events, abandon.
    fn driver(&self) -> &dyn Driver;
    /// The class's binding, for the class's code to downcast.
    fn into_any(self: Box<Self>) -> Box<dyn Any + Send>;
}

impl std::fmt::Debug for dyn AnyDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AnyDriver")
            .field("class", &self.class())
            .field("driver", &self.driver().driver_name())
            .finish()
    }
}

/// Takes a class's typed binding `B` out of `d`, or says which class `d` serves instead.
pub fn downcast<B: Any>(d: Box<dyn AnyDriver>, wanted: &str) -> Result<B, String> {
    let class = d.class();
    d.into_any()
        .downcast::<B>()
        .map(|b| *b)
        .map_err(|_| format!("the driver serves the {class} class, not {wanted}"))
}
