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

/// A started driver handed to code for another class.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the driver serves the {serves} class, not {wanted}")]
pub struct WrongClass {
    /// The class the driver serves.
    pub serves: String,
    /// The class the code is for.
    pub wanted: String,
}

/// Takes a class's typed binding `B` out of `d`, or says which class `d` serves instead.
pub fn downcast<B: Any>(d: Box<dyn AnyDriver>, wanted: &str) -> Result<B, WrongClass> {
    let serves = d.class();
    d.into_any()
        .downcast::<B>()
        .map(|b| *b)
        .map_err(|_| WrongClass {
            serves: serves.to_string(),
            wanted: wanted.to_string(),
        })
}

/// Declares a class's binding: the struct that carries a driver of the class through
/// class-free code, its [`AnyDriver`] implementation, and `bind`/`unbind` for the class's
/// personalities and its own code. A class's `driver.rs` has one line of it:
/// `outboard_env::class_binding!(BlockBinding, BlockDriver, CLASS);`
#[macro_export]
macro_rules! class_binding {
    ($binding:ident, $driver:path, $class:expr) => {
        /// A started driver of this class as class-free code carries it.
        pub struct $binding(pub Box<dyn $driver>);

        impl $crate::AnyDriver for $binding {
            fn class(&self) -> &'static str {
                $class
            }

            fn driver(&self) -> &dyn $crate::Driver {
                self.0.as_ref()
            }

            fn into_any(self: Box<Self>) -> Box<dyn ::std::any::Any + Send> {
                self
            }
        }

        /// Wraps a driver of this class for class-free code (a personality's `start`).
        pub fn bind(d: impl $driver + 'static) -> Box<dyn $crate::AnyDriver> {
            Box::new($binding(Box::new(d)))
        }

        /// Takes this class's driver back out of a started driver; an error names the class
        /// it serves instead.
        pub fn unbind(
            d: Box<dyn $crate::AnyDriver>,
        ) -> Result<Box<dyn $driver>, $crate::WrongClass> {
            $crate::downcast::<$binding>(d, $class).map(|b| b.0)
        }
    };
}
