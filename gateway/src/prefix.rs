//! The shared prefix index of the request path: [`PrefixIndex`] behind a mutex, plus the
//! bookkeeping that keeps it honest — a backend's entries are dropped when it leaves the
//! config or restarts (the scraper counts restarts: counters going backwards or a new
//! process start time; see `Backend::restarts`), since its cache is gone.
//!
//! Locking: one short critical section per lookup and per insert (a few hash-map probes per
//! 64-byte block of prompt); the hashes are computed before taking the lock.

use foldhash::{HashMap, HashMapExt};
use parking_lot::Mutex;

use crate::config::PrefixIndexConfig;
use crate::policy::prefix_index::PrefixIndex;

/// Index id of a backend key (the index stores 32-bit backend ids).
pub fn index_id(key: u64) -> u32 {
    (key ^ (key >> 32)) as u32
}

struct Inner {
    config: PrefixIndexConfig,
    index: PrefixIndex,
    /// Restart count last seen per backend id.
    epochs: HashMap<u32, u32>,
}

/// See the module documentation.
pub struct PrefixTracker {
    inner: Mutex<Inner>,
}

impl PrefixTracker {
    /// An empty tracker for `config`.
    pub fn new(config: &PrefixIndexConfig) -> Self {
        PrefixTracker {
            inner: Mutex::new(Inner {
                config: config.clone(),
                index: PrefixIndex::new(config.max_bytes),
                epochs: HashMap::new(),
            }),
        }
    }

    /// Apply a (possibly) new config: a changed block size or bound starts a fresh index.
    pub fn reconfigure(&self, config: &PrefixIndexConfig) {
        let mut g = self.inner.lock();
        if g.config != *config {
            *g = Inner { config: config.clone(), index: PrefixIndex::new(config.max_bytes), epochs: HashMap::new() };
        }
    }

    /// Leading blocks of `hashes` held by each of `backends` (`(key, restarts)`), in order.
    /// A backend whose restart count changed since last seen is forgotten first.
    pub fn matched_blocks(&self, hashes: &[u64], backends: &[(u64, u32)]) -> Vec<usize> {
        let mut g = self.inner.lock();
        for &(key, restarts) in backends {
            let id = index_id(key);
            let seen = g.epochs.insert(id, restarts);
            if seen.is_some_and(|s| s != restarts) {
                g.index.remove_backend(id);
            }
        }
        if hashes.is_empty() {
            return vec![0; backends.len()];
        }
        let found = g.index.matches(hashes);
        backends.iter().map(|&(key, _)| found.iter().find(|(b, _)| *b == index_id(key)).map_or(0, |m| m.1)).collect()
    }

    /// Record that the backend `key` was sent a prompt with these block hashes.
    pub fn insert(&self, key: u64, hashes: &[u64]) -> usize {
        let mut g = self.inner.lock();
        g.index.insert(index_id(key), hashes);
        g.index.approx_bytes()
    }

    /// Forget a backend that left the config.
    pub fn remove(&self, key: u64) {
        let mut g = self.inner.lock();
        g.index.remove_backend(index_id(key));
        g.epochs.remove(&index_id(key));
    }

    /// Memory charged by the index now.
    #[cfg(test)]
    pub fn approx_bytes(&self) -> usize {
        self.inner.lock().index.approx_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::prefix_index::block_hashes;

    #[test]
    fn a_restart_or_removal_forgets_the_backend() {
        let t = PrefixTracker::new(&PrefixIndexConfig::default());
        let h = block_hashes(&[b'x'; 640], 64);
        t.insert(1, &h);
        t.insert(2, &h[..4]);
        assert_eq!(t.matched_blocks(&h, &[(1, 0), (2, 0), (3, 0)]), vec![10, 4, 0]);
        // Backend 1's restart count moved: its entries go, backend 2's stay.
        assert_eq!(t.matched_blocks(&h, &[(1, 1), (2, 0)]), vec![0, 4]);
        t.remove(2);
        assert_eq!(t.matched_blocks(&h, &[(1, 1), (2, 0)]), vec![0, 0]);
        assert!(t.approx_bytes() < 1024);
    }
}
