//! The admission queue's order: who may leave next.
//!
//! Requests that cannot be routed yet (no engine up, or every one saturated) take a
//! [`Ticket`] and wait. Only the first ticket — highest priority, then earliest — may leave
//! when an engine can take it; when it leaves (or gives up), every waiter is woken to see
//! whether it is now first, so a queue drains in order and without a polling delay per
//! request. The bound is checked and the ticket taken under one lock.

use std::cmp::Reverse;
use std::collections::BTreeSet;
use std::sync::Arc;

use parking_lot::Mutex;

use tokio::sync::Notify;

/// Waiting requests, in leaving order.
#[derive(Debug, Default)]
pub struct AdmissionQueue {
    inner: Mutex<Inner>,
    changed: Notify,
}

#[derive(Debug, Default)]
struct Inner {
    order: BTreeSet<(Reverse<i32>, u64)>,
    next_seq: u64,
}

/// A place in the queue; dropping it leaves the queue.
#[derive(Debug)]
pub struct Ticket {
    queue: Arc<AdmissionQueue>,
    key: (Reverse<i32>, u64),
}

impl AdmissionQueue {
    /// An empty queue.
    pub fn new() -> Arc<Self> {
        Arc::new(AdmissionQueue::default())
    }

    /// Requests waiting.
    pub fn len(&self) -> usize {
        self.inner.lock().order.len()
    }

    /// Whether nobody waits.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Join with `priority` (higher leaves first) unless `max` are already waiting.
    pub fn try_enter(self: &Arc<Self>, priority: i32, max: usize) -> Option<Ticket> {
        let mut inner = self.inner.lock();
        if inner.order.len() >= max {
            return None;
        }
        let key = (Reverse(priority), inner.next_seq);
        inner.next_seq += 1;
        inner.order.insert(key);
        Some(Ticket { queue: self.clone(), key })
    }

    /// Resolves when a ticket leaves (create it before checking, then await it).
    pub fn changed(&self) -> tokio::sync::futures::Notified<'_> {
        self.changed.notified()
    }
}

impl Ticket {
    /// Whether this ticket is the next to leave.
    pub fn is_first(&self) -> bool {
        self.queue.inner.lock().order.first() == Some(&self.key)
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.queue.inner.lock().order.remove(&self.key);
        self.queue.changed.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn higher_priority_leaves_first_then_arrival_order() {
        let q = AdmissionQueue::new();
        let low = q.try_enter(0, 10).unwrap();
        let high_a = q.try_enter(5, 10).unwrap();
        let high_b = q.try_enter(5, 10).unwrap();
        assert!(high_a.is_first() && !high_b.is_first() && !low.is_first());
        drop(high_a);
        assert!(high_b.is_first());
        drop(high_b);
        assert!(low.is_first());
        assert_eq!(q.len(), 1);
        drop(low);
        assert!(q.is_empty());
    }

    #[test]
    fn the_bound_is_exact() {
        let q = AdmissionQueue::new();
        let held: Vec<_> = (0..3).map(|i| q.try_enter(i, 3).unwrap()).collect();
        assert!(q.try_enter(100, 3).is_none(), "full, whatever the priority");
        drop(held);
        assert!(q.try_enter(0, 3).is_some());
    }

    #[tokio::test]
    async fn leaving_wakes_the_waiters() {
        let q = AdmissionQueue::new();
        let first = q.try_enter(0, 10).unwrap();
        let second = q.try_enter(0, 10).unwrap();
        let woken = q.changed();
        drop(first);
        tokio::time::timeout(std::time::Duration::from_secs(1), woken).await.expect("notified");
        assert!(second.is_first());
    }
}
