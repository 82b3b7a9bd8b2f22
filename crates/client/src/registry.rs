//! The registry: a live tree of the machine (I/O Registry), printed like `ioreg`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// One node: machine, bus, PCI function, driver or class device.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Node {
    /// What it is (`machine`, `bus`, `pci-function`, `driver`, `block-device`).
    pub kind: String,
    /// Its name.
    pub name: String,
    /// Properties.
    pub props: BTreeMap<String, serde_json::Value>,
    /// Children.
    pub children: Vec<Node>,
}

impl Node {
    /// A node with no properties.
    pub fn new(kind: &str, name: &str) -> Self {
        Self {
            kind: kind.into(),
            name: name.into(),
            props: BTreeMap::new(),
            children: Vec::new(),
        }
    }

    /// Sets a property (builder style).
    pub fn with(mut self, key: &str, value: impl Into<serde_json::Value>) -> Self {
        self.props.insert(key.into(), value.into());
        self
    }

    /// Sets a property.
    pub fn set(&mut self, key: &str, value: impl Into<serde_json::Value>) {
        self.props.insert(key.into(), value.into());
    }

    /// Adds a child (builder style).
    pub fn child(mut self, c: Node) -> Self {
        self.children.push(c);
        self
    }

    /// The first node of `kind` named `name`, depth first.
    pub fn find_mut(&mut self, kind: &str, name: &str) -> Option<&mut Node> {
        if self.kind == kind && self.name == name {
            return Some(self);
        }
        self.children
            .iter_mut()
            .find_map(|c| c.find_mut(kind, name))
    }

    /// The first node of `kind` named `name`.
    pub fn find(&self, kind: &str, name: &str) -> Option<&Node> {
        if self.kind == kind && self.name == name {
            return Some(self);
        }
        self.children.iter().find_map(|c| c.find(kind, name))
    }

    /// The tree as text, one node per line, like `ioreg`.
    pub fn render(&self) -> String {
        let mut out = String::new();
        self.render_into(&mut out, "", true, true);
        out
    }

    fn render_into(&self, out: &mut String, prefix: &str, last: bool, root: bool) {
        let props: Vec<String> = self
            .props
            .iter()
            .map(|(k, v)| match v {
                serde_json::Value::String(s) => format!("{}={}", printable(k), printable(s)),
                v => format!("{}={}", printable(k), printable(&v.to_string())),
            })
            .collect();
        let branch = if root {
            ""
        } else if last {
            "└─ "
        } else {
            "├─ "
        };
        out.push_str(&format!(
            "{prefix}{branch}{} {}",
            printable(&self.kind),
            printable(&self.name)
        ));
        if !props.is_empty() {
            out.push_str(&format!("  <{}>", props.join(", ")));
        }
        out.push('\n');
        let child_prefix = if root {
            String::new()
        } else {
            format!("{prefix}{}", if last { "   " } else { "│  " })
        };
        for (i, c) in self.children.iter().enumerate() {
            c.render_into(out, &child_prefix, i + 1 == self.children.len(), false);
        }
    }
}

/// `s` with every control character (C0, DEL, C1) escaped as `\u{..}`: what a child process
/// reports (a device's failure, an export's peer) cannot move the cursor, clear the screen or
/// start a fake line in a terminal showing the registry. The JSON view escapes by itself.
pub fn printable(s: &str) -> std::borrow::Cow<'_, str> {
    if !s.chars().any(unsafe_to_show) {
        return s.into();
    }
    s.chars()
        .map(|c| {
            if unsafe_to_show(c) {
                c.escape_unicode().to_string()
            } else {
                c.to_string()
            }
        })
        .collect::<String>()
        .into()
}

/// A character that would change how the rest of the line looks rather than show itself:
/// control characters (ESC, CR, LF, C1), the line and paragraph separators, and the invisible
/// format characters that reorder or hide text (bidirectional overrides and isolates, zero-
/// width characters, the soft hyphen, the byte-order mark, interlinear annotation marks).
fn unsafe_to_show(c: char) -> bool {
    c.is_control()
        || matches!(c,
            '\u{00AD}' | '\u{061C}' | '\u{180E}' | '\u{200B}'..='\u{200F}'
            | '\u{2028}'..='\u{202E}' | '\u{2060}'..='\u{206F}' | '\u{FEFF}'
            | '\u{FFF9}'..='\u{FFFB}')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_children_report_cannot_draw_on_the_terminal() {
        let t = Node::new("machine", "m").child(
            Node::new("driver", "virtio-blk\n└─ driver forged")
                .with("state", "failed: \x1b[2J\x1b[Hall good\r\nmachine m")
                .with("peers", "\u{9b}31m"),
        );
        let s = t.render();
        assert_eq!(s.lines().count(), 2, "{s}");
        assert!(!s.chars().any(|c| c.is_control() && c != '\n'), "{s:?}");
        assert!(s.contains("\\u{1b}[2J"), "{s}");
    }

    #[test]
    fn text_that_reorders_or_hides_itself_is_shown_escaped() {
        let t = Node::new("driver", "d")
            .with("state", "running\u{202e}deliaf")
            .with("why", "a\u{2028}b\u{200b}c");
        let s = t.render();
        for c in ['\u{202e}', '\u{2028}', '\u{200b}'] {
            assert!(!s.contains(c), "{s:?}");
        }
        assert!(s.contains("\\u{202e}"), "{s}");
    }

    #[test]
    fn renders_a_tree() {
        let t = Node::new("machine", "m")
            .child(
                Node::new("bus", "vfio-user")
                    .child(Node::new("pci-function", "disk0").with("ids", "1af4:1042")),
            )
            .child(Node::new("bus", "other"));
        let s = t.render();
        assert_eq!(s, "machine m\n├─ bus vfio-user\n│  └─ pci-function disk0  <ids=1af4:1042>\n└─ bus other\n");
    }
}
