//! The gateway binary's global allocator: mimalloc, called the way std calls the system
//! allocator.
//!
//! Every request allocates header maps, buffers and small strings; glibc's malloc spent 14%
//! of the gateway's CPU on them under load, mimalloc's thread-local free lists far less.
//! Built without transparent huge pages (`no_thp`): with them, its 2 MiB pages tripled the
//! gateway's RSS at 1,000 open streams (211 MB against 70 MB).
//!
//! `mimalloc::MiMalloc` passes every allocation to `mi_malloc_aligned`, whose fast path in
//! mimalloc 3 only serves blocks up to 1 KiB that happen to be aligned; a larger block whose
//! size is not a power of two (a 4.4 KiB request future, a 1.5 KiB buffer) takes the
//! over-allocating path: ~300 instructions instead of ~20, and slack memory. Like std's
//! `System` on Unix, an alignment that `mi_malloc` guarantees anyway (≤ 16 and ≤ the size)
//! goes to `mi_malloc` / `mi_zalloc` / `mi_realloc`; only the rest is aligned explicitly.
//! Measured with `loadtest/bench/profile_gateway.sh` (see docs/performance.md).

use std::alloc::{GlobalAlloc, Layout};
use std::ffi::c_void;

use libmimalloc_sys as mi;

/// What `mi_malloc` aligns every block to (`MI_MAX_ALIGN_SIZE`, `sizeof(max_align_t)`).
const MALLOC_ALIGN: usize = 16;

/// mimalloc as the global allocator: `#[global_allocator] static A: Mimalloc = Mimalloc;`.
pub struct Mimalloc;

/// Whether `mi_malloc(size)` already returns a block aligned for `layout` (a block smaller
/// than 16 bytes is only aligned to its size class, hence `align <= size`).
fn plain(align: usize, size: usize) -> bool {
    align <= MALLOC_ALIGN && align <= size
}

// SAFETY: every method forwards to the mimalloc function with the same contract (a block of
// at least `size` bytes aligned to `align`, or null); `plain` only routes a layout to the
// unaligned entry points when their alignment guarantee covers it.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Mimalloc {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let (size, align) = (layout.size(), layout.align());
        // SAFETY: see the impl.
        unsafe { if plain(align, size) { mi::mi_malloc(size) } else { mi::mi_malloc_aligned(size, align) }.cast() }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let (size, align) = (layout.size(), layout.align());
        // SAFETY: see the impl.
        unsafe { if plain(align, size) { mi::mi_zalloc(size) } else { mi::mi_zalloc_aligned(size, align) }.cast() }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, _layout: Layout) {
        // SAFETY: `ptr` came from this allocator (the caller's contract).
        unsafe { mi::mi_free(ptr.cast::<c_void>()) }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let align = layout.align();
        // SAFETY: see the impl; `ptr` came from this allocator.
        unsafe {
            let p = ptr.cast::<c_void>();
            if plain(align, new_size) {
                mi::mi_realloc(p, new_size)
            } else {
                mi::mi_realloc_aligned(p, new_size, align)
            }
            .cast()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every size class boundary and alignment up to a page: the block is aligned, writable
    /// over its whole size, and keeps its bytes through growing and shrinking.
    #[test]
    fn blocks_are_aligned_and_keep_their_bytes() {
        let a = Mimalloc;
        for align in [1usize, 2, 4, 8, 16, 32, 64, 128, 4096] {
            for size in [1usize, 3, 8, 15, 16, 17, 24, 100, 1024, 1025, 1500, 4096, 4500, 70_000] {
                let layout = Layout::from_size_align(size, align).unwrap();
                #[allow(unsafe_code)]
                // SAFETY: the layout is non-zero-sized; each block is freed once with its layout.
                unsafe {
                    let p = a.alloc(layout);
                    assert!(!p.is_null() && (p as usize).is_multiple_of(align), "alloc {size}/{align}");
                    std::ptr::write_bytes(p, 0xAB, size);
                    let grown = a.realloc(p, layout, size * 3);
                    assert!(!grown.is_null() && (grown as usize).is_multiple_of(align), "realloc {size}/{align}");
                    assert!((0..size).all(|i| *grown.add(i) == 0xAB), "realloc kept bytes {size}/{align}");
                    let shrunk = a.realloc(grown, Layout::from_size_align(size * 3, align).unwrap(), size);
                    assert!((shrunk as usize).is_multiple_of(align) && *shrunk == 0xAB);
                    a.dealloc(shrunk, layout);
                    let z = a.alloc_zeroed(layout);
                    assert!(!z.is_null() && (z as usize).is_multiple_of(align), "zalloc {size}/{align}");
                    assert!((0..size).all(|i| *z.add(i) == 0), "zeroed {size}/{align}");
                    a.dealloc(z, layout);
                }
            }
        }
    }
}
