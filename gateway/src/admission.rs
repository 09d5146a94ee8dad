//! The admission queue's order: who may leave next.
//!
//! Requests that cannot be routed yet (no engine up, or every one saturated) take a
//! [`Ticket`] and wait. Only the first ticket — highest priority, then earliest — may leave
//! when an engine can take it; when it leaves (or gives up), every waiter is woken to see
//! whether it is now first, so a queue drains in order and without a polling delay per
//! request. The bounds (the whole queue's, a tenant's) are checked and the ticket taken
//! under one lock.

use std::cmp::Reverse;
use std::collections::{BTreeSet, HashMap};
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
    /// Places held per tenant (tenants with none are removed).
    by_tenant: HashMap<Arc<str>, usize>,
}

/// A place in the queue; dropping it leaves the queue.
#[derive(Debug)]
pub struct Ticket {
    queue: Arc<AdmissionQueue>,
    key: (Reverse<i32>, u64),
    tenant: Option<Arc<str>>,
}

/// Why a request may not join.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Full {
    /// The whole queue holds its maximum.
    Queue,
    /// The request's tenant holds its maximum.
    Tenant,
}

/// A tenant's share of the queue: who it is and how many places it may hold.
#[derive(Debug, Clone, Copy)]
pub struct TenantCap<'a> {
    /// The tenant's name.
    pub tenant: &'a Arc<str>,
    /// Places it may hold at once.
    pub max: usize,
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

    /// Join with `priority` (higher leaves first) unless `max` are already waiting, or the
    /// tenant of `cap` holds its maximum.
    pub fn try_enter(self: &Arc<Self>, priority: i32, max: usize, cap: Option<TenantCap<'_>>) -> Result<Ticket, Full> {
        let mut inner = self.inner.lock();
        if inner.order.len() >= max {
            return Err(Full::Queue);
        }
        if let Some(cap) = cap {
            let held = inner.by_tenant.entry(cap.tenant.clone()).or_default();
            if *held >= cap.max {
                return Err(Full::Tenant);
            }
            *held += 1;
        }
        let key = (Reverse(priority), inner.next_seq);
        inner.next_seq += 1;
        inner.order.insert(key);
        Ok(Ticket { queue: self.clone(), key, tenant: cap.map(|c| c.tenant.clone()) })
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
        let mut inner = self.queue.inner.lock();
        inner.order.remove(&self.key);
        if let Some(t) = &self.tenant {
            if let Some(held) = inner.by_tenant.get_mut(t) {
                *held -= 1;
                if *held == 0 {
                    inner.by_tenant.remove(t);
                }
            }
        }
        drop(inner);
        self.queue.changed.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn higher_priority_leaves_first_then_arrival_order() {
        let q = AdmissionQueue::new();
        let low = q.try_enter(0, 10, None).unwrap();
        let high_a = q.try_enter(5, 10, None).unwrap();
        let high_b = q.try_enter(5, 10, None).unwrap();
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
        let held: Vec<_> = (0..3).map(|i| q.try_enter(i, 3, None).unwrap()).collect();
        assert_eq!(q.try_enter(100, 3, None).unwrap_err(), Full::Queue, "full, whatever the priority");
        drop(held);
        assert!(q.try_enter(0, 3, None).is_ok());
    }

    #[test]
    fn a_tenant_holds_at_most_its_share_and_frees_it_on_leaving() {
        let q = AdmissionQueue::new();
        let (a, b): (Arc<str>, Arc<str>) = ("a".into(), "b".into());
        let cap = |tenant| Some(TenantCap { tenant, max: 2 });
        let a1 = q.try_enter(0, 10, cap(&a)).unwrap();
        let _a2 = q.try_enter(0, 10, cap(&a)).unwrap();
        assert_eq!(q.try_enter(9, 10, cap(&a)).unwrap_err(), Full::Tenant, "whatever the priority");
        let _b1 = q.try_enter(0, 10, cap(&b)).unwrap();
        let _anonymous = q.try_enter(0, 10, None).unwrap();
        assert_eq!(q.len(), 4);
        drop(a1);
        assert!(q.try_enter(0, 10, cap(&a)).is_ok(), "a left place is the tenant's again");
        // The whole queue's bound comes first.
        let _fill: Vec<_> = (0..7).map(|_| q.try_enter(0, 10, None).unwrap()).collect();
        assert_eq!(q.try_enter(0, 10, cap(&b)).unwrap_err(), Full::Queue);
    }

    #[tokio::test]
    async fn leaving_wakes_the_waiters() {
        let q = AdmissionQueue::new();
        let first = q.try_enter(0, 10, None).unwrap();
        let second = q.try_enter(0, 10, None).unwrap();
        let woken = q.changed();
        drop(first);
        tokio::time::timeout(std::time::Duration::from_secs(1), woken).await.expect("notified");
        assert!(second.is_first());
    }
}
