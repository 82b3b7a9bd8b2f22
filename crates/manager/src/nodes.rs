//! The registry as the manager reads and writes it: class devices and their drivers found by
//! name whatever their class, and a class's status record as properties.

use super::*;

impl Manager {
    /// Class device `name`'s registry node, whatever its class.
    pub(crate) fn class_device(&self, name: &str) -> Option<&Node> {
        fn find<'a>(n: &'a Node, name: &str) -> Option<&'a Node> {
            if n.kind.ends_with("-device") && n.name == name {
                return Some(n);
            }
            n.children.iter().find_map(|c| find(c, name))
        }
        find(&self.registry, name)
    }

    /// The same, to change.
    pub(crate) fn class_device_mut(&mut self, name: &str) -> Option<&mut Node> {
        fn find<'a>(n: &'a mut Node, name: &str) -> Option<&'a mut Node> {
            if n.kind.ends_with("-device") && n.name == name {
                return Some(n);
            }
            n.children.iter_mut().find_map(|c| find(c, name))
        }
        find(&mut self.registry, name)
    }

    /// The driver node serving class device `name`.
    pub(crate) fn driver_of(&self, name: &str) -> Option<&Node> {
        fn find<'a>(n: &'a Node, name: &str) -> Option<&'a Node> {
            if n.kind == "driver" && n.children.iter().any(|c| c.name == name) {
                return Some(n);
            }
            n.children.iter().find_map(|c| find(c, name))
        }
        find(&self.registry, name)
    }

    pub(crate) fn driver_of_mut(&mut self, name: &str) -> Option<&mut Node> {
        fn find<'a>(n: &'a mut Node, name: &str) -> Option<&'a mut Node> {
            if n.kind == "driver" && n.children.iter().any(|c| c.name == name) {
                return Some(n);
            }
            n.children.iter_mut().find_map(|c| find(c, name))
        }
        find(&mut self.registry, name)
    }
}

/// A class device's registry node: its kind names its class (`block-device`,
/// `entropy-device`).
pub(crate) fn class_device(class: &str, name: &str) -> Node {
    Node::new(&format!("{class}-device"), name).with("class", class)
}
