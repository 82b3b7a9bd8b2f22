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

    /// Takes a class's status record (whatever its class) as properties: each scalar field,
    /// named in kebab-case, and each field of a record inside it as `record.field`
    /// (`counters.rx-frames`); the device's name is the node's own.
    pub fn set_status(&mut self, status: &serde_json::Value) {
        let Some(fields) = status.as_object() else {
            return;
        };
        let kebab = |k: &str| k.replace('_', "-");
        for (key, value) in fields {
            match value {
                serde_json::Value::Object(inner) => {
                    for (k, v) in inner {
                        if !(v.is_object() || v.is_array() || v.is_null()) {
                            self.set(&format!("{}.{}", kebab(key), kebab(k)), v.clone());
                        }
                    }
                }
                v if key == "name" || v.is_array() || v.is_null() => {}
                v => self.set(&kebab(key), v.clone()),
            }
        }
    }

    /// Adds a child (builder style).
    pub fn child(mut self, c: Node) -> Self {
        self.children.push(c);
        self
    }

    /// Its state, read from its `state` property (see [`State`]).
    pub fn state(&self) -> Option<State> {
        State::of(self.props.get("state")?.as_str()?)
    }

    /// Sets its state, with words for people after it (`gave up: …`) or none.
    pub fn set_state(&mut self, state: State, detail: Detail<'_>) {
        self.set("state", state.text(detail));
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

/// What a node is doing: a closed list, so that the manager, clients and scripts decide on a
/// word instead of guessing at a sentence. The `state` property is the word, then what people
/// want to know (`gave up: …`, `restarting (signal: 9 (SIGKILL))`); [`State::of`] reads the
/// word back and is the only reader. A word this build does not know reads as `None`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Being started.
    Starting,
    /// A process that serves (a driver server, a model, an export).
    Running,
    /// A device that answers requests.
    Serving,
    /// Going down to be started again; it will be back.
    Restarting,
    /// Draining for `power suspend`.
    Suspending,
    /// Quiesced: requests wait.
    Suspended,
    /// Being detached.
    Detaching,
    /// Not attached.
    Detached,
    /// Its driver reported the device failed (it may be re-opening it).
    Failed,
    /// Given up by the restart policy: retried on a slow schedule, or by `outboard restart`.
    GaveUp,
    /// A colocated driver: it runs in each client, not in a server of its own.
    Linked,
}

/// What follows a [`State`]'s word in the text.
#[derive(Debug, Clone, Copy)]
pub enum Detail<'a> {
    /// Nothing.
    None,
    /// `word: why` — the reason.
    Because(&'a str),
    /// `word (note)` — a remark.
    Note(&'a str),
    /// `word, note: why` — e.g. `failed, restarting: …`.
    While(&'a str, &'a str),
}

impl State {
    const ALL: [State; 11] = [
        State::Starting,
        State::Running,
        State::Serving,
        State::Restarting,
        State::Suspending,
        State::Suspended,
        State::Detaching,
        State::Detached,
        State::Failed,
        State::GaveUp,
        State::Linked,
    ];

    /// Its word.
    pub fn word(self) -> &'static str {
        match self {
            State::Starting => "starting",
            State::Running => "running",
            State::Serving => "serving",
            State::Restarting => "restarting",
            State::Suspending => "suspending",
            State::Suspended => "suspended",
            State::Detaching => "detaching",
            State::Detached => "detached",
            State::Failed => "failed",
            State::GaveUp => "gave up",
            State::Linked => "linked into each client",
        }
    }

    /// The `state` property's text: the word and the detail.
    pub fn text(self, detail: Detail<'_>) -> String {
        let w = self.word();
        match detail {
            Detail::None => w.to_string(),
            Detail::Because(why) => format!("{w}: {why}"),
            Detail::Note(note) => format!("{w} ({note})"),
            Detail::While(note, why) => format!("{w}, {note}: {why}"),
        }
    }

    /// The state a `state` property's text starts with, if any this build knows.
    pub fn of(text: &str) -> Option<State> {
        Self::ALL.into_iter().find(|s| {
            text.strip_prefix(s.word())
                .is_some_and(|rest| rest.is_empty() || rest.starts_with([':', ' ', ',']))
        })
    }

    /// Not serving, and not on its way back by itself right now: its device failed, or the
    /// restart policy gave it up.
    pub fn is_down(self) -> bool {
        matches!(self, State::Failed | State::GaveUp)
    }
}

impl std::fmt::Display for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.word())
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
    fn a_status_record_becomes_properties_nested_records_included() {
        let mut n = Node::new("net-device", "nic0");
        n.set_status(&serde_json::json!({
            "name": "other",
            "link_up": true,
            "mac": "02:00:00:00:00:01",
            "counters": { "rx_frames": 3, "deeper": { "x": 1 } },
            "list": [1, 2],
        }));
        assert_eq!(n.name, "nic0");
        assert_eq!(n.props["link-up"], true);
        assert_eq!(n.props["counters.rx-frames"], 3);
        assert_eq!(n.props.len(), 3, "{:?}", n.props);
    }

    #[test]
    fn a_state_reads_back_from_its_text_whatever_follows_it() {
        for s in State::ALL {
            for d in [
                Detail::None,
                Detail::Because("x: y"),
                Detail::Note("restarted 3 times"),
                Detail::While("restarting", "why"),
            ] {
                assert_eq!(State::of(&s.text(d)), Some(s), "{}", s.text(d));
            }
        }
        // A word must end where the state's word ends: no state is a prefix guess.
        assert_eq!(State::of("runningx"), None);
        assert_eq!(State::of("gave"), None);
        assert_eq!(State::of(""), None);
        assert_eq!(State::of("sleeping"), None);
        let mut n = Node::new("driver", "d");
        assert_eq!(n.state(), None);
        n.set_state(State::GaveUp, Detail::Because("5 crashes"));
        assert_eq!(n.props["state"], "gave up: 5 crashes");
        assert_eq!(n.state(), Some(State::GaveUp));
    }

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
