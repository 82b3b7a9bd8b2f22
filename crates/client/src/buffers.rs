//! A buffer allocator for a session's buffer area: clients with several requests in flight
//! take a distinct, aligned piece of the area for each, instead of all using offset 0.
//!
//! First fit over a sorted free list, neighbours merged on free. The area is the client's own
//! memory, so a mistake here corrupts only the client's data — but the device reads and writes
//! these ranges, so pieces must never overlap: the property test checks that.

/// A piece of the buffer area.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Buffer {
    /// Offset in the buffer area (what a request's `buf_offset` carries).
    pub offset: u64,
    /// Length in bytes (the request rounded up to the alignment).
    pub len: u64,
}

/// Hands out pieces of a buffer area of a given size.
#[derive(Debug, Clone)]
pub struct BufferPool {
    align: u64,
    size: u64,
    /// Free ranges `(offset, len)`, sorted, never adjacent.
    free: Vec<(u64, u64)>,
}

impl BufferPool {
    /// A pool over `size` bytes handing out pieces aligned to `align` (a power of two: the
    /// device's block size, or a page for DMA-friendly buffers).
    pub fn new(size: u64, align: u64) -> Self {
        assert!(
            align.is_power_of_two(),
            "alignment {align} is not a power of two"
        );
        let usable = size / align * align;
        Self {
            align,
            size: usable,
            free: if usable > 0 {
                vec![(0, usable)]
            } else {
                vec![]
            },
        }
    }

    /// Takes `len` bytes (rounded up to the alignment); `None` if no free range is that long.
    pub fn alloc(&mut self, len: u64) -> Option<Buffer> {
        if len == 0 {
            return None;
        }
        let len = len.checked_next_multiple_of(self.align)?;
        let i = self.free.iter().position(|&(_, l)| l >= len)?;
        let (offset, l) = self.free[i];
        if l == len {
            self.free.remove(i);
        } else {
            self.free[i] = (offset + len, l - len);
        }
        Some(Buffer { offset, len })
    }

    /// Returns a piece. Giving back something that was not handed out (or twice) is refused
    /// with `false` and changes nothing.
    pub fn free(&mut self, b: Buffer) -> bool {
        let end = match b.offset.checked_add(b.len) {
            Some(e) if e <= self.size && b.len > 0 && b.offset.is_multiple_of(self.align) => e,
            _ => return false,
        };
        let i = self.free.partition_point(|&(o, _)| o < b.offset);
        let overlaps_prev = i > 0 && self.free[i - 1].0 + self.free[i - 1].1 > b.offset;
        let overlaps_next = i < self.free.len() && self.free[i].0 < end;
        if overlaps_prev || overlaps_next {
            return false;
        }
        self.free.insert(i, (b.offset, b.len));
        // Merge with the next, then the previous neighbour.
        if i + 1 < self.free.len() && self.free[i].0 + self.free[i].1 == self.free[i + 1].0 {
            self.free[i].1 += self.free[i + 1].1;
            self.free.remove(i + 1);
        }
        if i > 0 && self.free[i - 1].0 + self.free[i - 1].1 == self.free[i].0 {
            self.free[i - 1].1 += self.free[i].1;
            self.free.remove(i);
        }
        true
    }

    /// Free bytes.
    pub fn available(&self) -> u64 {
        self.free.iter().map(|f| f.1).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn pieces_are_aligned_and_the_area_comes_back_whole() {
        let mut p = BufferPool::new(64 << 10, 4096);
        let a = p.alloc(1).unwrap();
        let b = p.alloc(5000).unwrap();
        assert_eq!((a.offset, a.len), (0, 4096));
        assert_eq!((b.offset, b.len), (4096, 8192));
        assert!(p.alloc(64 << 10).is_none());
        assert!(p.free(a));
        assert!(!p.free(a), "a double free is refused");
        assert!(
            !p.free(Buffer {
                offset: 100,
                len: 4096
            }),
            "unaligned"
        );
        assert!(p.free(b));
        assert_eq!(p.available(), 64 << 10);
        assert_eq!(p.alloc(64 << 10).unwrap().offset, 0);
    }

    proptest! {
        /// Whatever the order of allocations and frees, live pieces never overlap, stay inside
        /// the area, and freeing everything gives the whole area back.
        #[test]
        fn live_pieces_never_overlap(ops in proptest::collection::vec((any::<bool>(), 1u64..40_000, any::<prop::sample::Index>()), 1..200)) {
            let size = 256 << 10;
            let mut p = BufferPool::new(size, 512);
            let mut live: Vec<Buffer> = Vec::new();
            for (alloc, len, pick) in ops {
                if alloc || live.is_empty() {
                    if let Some(b) = p.alloc(len) {
                        prop_assert!(b.offset + b.len <= size);
                        prop_assert_eq!(b.offset % 512, 0);
                        prop_assert!(b.len >= len);
                        for o in &live {
                            prop_assert!(b.offset + b.len <= o.offset || o.offset + o.len <= b.offset);
                        }
                        live.push(b);
                    }
                } else {
                    let b = live.swap_remove(pick.index(live.len()));
                    prop_assert!(p.free(b));
                }
                let used: u64 = live.iter().map(|b| b.len).sum();
                prop_assert_eq!(p.available() + used, size);
            }
            for b in live.drain(..) {
                prop_assert!(p.free(b));
            }
            prop_assert_eq!(p.available(), size);
            prop_assert_eq!(p.free.len(), 1);
        }
    }
}
