//! Idle keep-alive connections to engines, kept without a task per connection.
//!
//! pingora's connection pool spawns a watcher task for every connection it takes back (to
//! notice the engine closing it while idle) and cancels that task when the connection is
//! reused, and it asks the kernel for the socket's peer address on each reuse. With one
//! request per connection use, that is a task spawn, a cross-task wake-up and a syscall per
//! request: about 5% of the gateway's instructions in a profile of short streamed requests.
//!
//! Here an idle connection just waits in its backend's stack (last in, first out: the
//! warmest connection is reused first). Whether the engine closed it is checked when it is
//! taken, with one non-blocking read (end of stream or unexpected bytes: dropped), and
//! once a second for every idle connection ([`UpstreamPool::sweep`]), which also drops
//! those idle longer than the timeout. A connection that dies between that check and its
//! use fails before any response byte, which the proxy retries on a new connection.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use foldhash::{HashMap, HashMapExt};
use futures_util::FutureExt;
use parking_lot::Mutex;
#[cfg(test)]
use pingora::protocols::Stream;
use tokio::io::{AsyncRead, AsyncReadExt};

/// What the pool keeps: a connection to an engine (with whatever it carries along, such as
/// its read buffer), checked for life through its stream.
pub trait Pooled: Send {
    /// What the connection reads from.
    type Io: AsyncRead + Unpin;
    /// The connection's stream.
    fn stream_mut(&mut self) -> &mut Self::Io;
}

/// A bare stream pools as itself (the tests' connections).
#[cfg(test)]
impl Pooled for Stream {
    type Io = Stream;
    fn stream_mut(&mut self) -> &mut Stream {
        self
    }
}

/// Idle connections to one backend.
type Idle<C> = VecDeque<(C, Instant)>;

/// Idle upstream connections by backend.
pub struct UpstreamPool<C: Pooled> {
    idle: Mutex<HashMap<u64, Idle<C>>>,
    /// The most idle connections kept per backend; the oldest is closed beyond it.
    max_idle: usize,
    /// An idle connection older than this is closed.
    idle_timeout: Duration,
}

impl<C: Pooled> UpstreamPool<C> {
    /// A pool keeping up to `max_idle` connections per backend for up to `idle_timeout`.
    pub fn new(max_idle: usize, idle_timeout: Duration) -> Self {
        UpstreamPool { idle: Mutex::new(HashMap::new()), max_idle, idle_timeout }
    }

    /// The most recently released live connection to `backend`, if any.
    pub fn take(&self, backend: u64, now: Instant) -> Option<C> {
        loop {
            let (stream, since) = {
                let mut idle = self.idle.lock();
                let stack = idle.get_mut(&backend)?;
                let popped = stack.pop_back()?;
                if now.saturating_duration_since(popped.1) > self.idle_timeout {
                    // Released in time order: everything below the top is older still.
                    stack.clear();
                    return None;
                }
                popped
            };
            let mut stream = stream;
            if is_open(stream.stream_mut()) {
                return Some(stream);
            }
            tracing::debug!(idle_for = ?now.saturating_duration_since(since), "dropped a closed idle connection");
        }
    }

    /// Keep `stream` for reuse by the next request to `backend`.
    pub fn put(&self, backend: u64, stream: C, now: Instant) {
        let mut idle = self.idle.lock();
        let stack = idle.entry(backend).or_default();
        stack.push_back((stream, now));
        if stack.len() > self.max_idle {
            stack.pop_front();
        }
    }

    /// Close idle connections that timed out or that the engine closed; forget empty backends.
    pub fn sweep(&self, now: Instant) {
        let mut idle = self.idle.lock();
        for stack in idle.values_mut() {
            stack.retain_mut(|(stream, since)| {
                now.saturating_duration_since(*since) <= self.idle_timeout && is_open(stream.stream_mut())
            });
        }
        idle.retain(|_, stack| !stack.is_empty());
    }

    /// Idle connections kept in all.
    #[cfg(test)]
    pub fn idle_count(&self) -> usize {
        self.idle.lock().values().map(VecDeque::len).sum()
    }
}

/// One [`UpstreamPool`] per core thread ([`crate::cores`]) and one for every other thread. A
/// connection's socket is registered with the reactor of the thread that opened it, so it
/// is reused only on that core: handed to another, each of its reads would wake a task
/// across threads. NGINX keeps its `keepalive` pool per worker process the same way.
pub struct Pools<C: Pooled> {
    /// `[0]`: threads that are not cores (pingora's runtimes); `[1 + i]`: core `i`.
    shards: Box<[UpstreamPool<C>]>,
}

impl<C: Pooled> Pools<C> {
    /// Pools for `cores` core threads (0: none, everything shares one), each keeping up to
    /// `max_idle` connections per backend for up to `idle_timeout`.
    pub fn new(cores: usize, max_idle: usize, idle_timeout: Duration) -> Self {
        Pools { shards: (0..=cores).map(|_| UpstreamPool::new(max_idle, idle_timeout)).collect() }
    }

    /// The pool of `core` (`None`: not a core thread). A core beyond those the pools were
    /// made for shares the first pool.
    pub fn of(&self, core: Option<usize>) -> &UpstreamPool<C> {
        let shard = core.map_or(0, |i| i + 1);
        self.shards.get(shard).unwrap_or(&self.shards[0])
    }

    /// [`UpstreamPool::sweep`] every pool.
    pub fn sweep(&self, now: Instant) {
        for pool in &self.shards {
            pool.sweep(now);
        }
    }
}

/// Whether an idle connection is still usable: a read must find nothing to read yet. End of
/// stream (the engine closed it), an error, or bytes nobody asked for all mean it is not.
fn is_open(stream: &mut (impl AsyncRead + Unpin)) -> bool {
    let mut byte = [0u8; 1];
    // `unconstrained`: tokio's cooperative budget could otherwise make a ready read look
    // pending.
    tokio::task::unconstrained(stream.read(&mut byte)).now_or_never().is_none()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;
    use tokio::net::{TcpListener, TcpStream};

    /// A connected pair: the pool's side as a pingora stream, and the far end.
    async fn pair() -> (Stream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let near = TcpStream::connect(listener.local_addr().unwrap()).await.unwrap();
        let (far, _) = listener.accept().await.unwrap();
        (Box::new(pingora::protocols::l4::stream::Stream::from(near)), far)
    }

    fn id(s: &Stream) -> i32 {
        s.id()
    }

    #[tokio::test]
    async fn the_last_connection_released_is_reused_first() {
        let pool = UpstreamPool::new(8, Duration::from_secs(60));
        let now = Instant::now();
        let (a, _fa) = pair().await;
        let (b, _fb) = pair().await;
        let (ida, idb) = (id(&a), id(&b));
        pool.put(1, a, now);
        pool.put(1, b, now);
        assert!(pool.take(2, now).is_none(), "another backend's connections are not shared");
        assert_eq!(pool.take(1, now).map(|s| id(&s)), Some(idb));
        assert_eq!(pool.take(1, now).map(|s| id(&s)), Some(ida));
        assert!(pool.take(1, now).is_none());
    }

    #[tokio::test]
    async fn connections_the_engine_closed_or_wrote_to_are_not_reused() {
        let pool = UpstreamPool::new(8, Duration::from_secs(60));
        let now = Instant::now();
        let (live, _keep) = pair().await;
        let (closed, far_closed) = pair().await;
        let (chatty, mut far_chatty) = pair().await;
        let live_id = id(&live);
        pool.put(1, live, now);
        pool.put(1, closed, now);
        pool.put(1, chatty, now);
        drop(far_closed);
        far_chatty.write_all(b"HTTP/1.1 408 Request Timeout\r\n\r\n").await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(pool.take(1, now).map(|s| id(&s)), Some(live_id), "the two bad ones were skipped");
        assert_eq!(pool.idle_count(), 0);
    }

    #[tokio::test]
    async fn idle_connections_time_out_and_the_pool_is_bounded() {
        let pool = UpstreamPool::new(2, Duration::from_secs(60));
        let t0 = Instant::now();
        let mut far = Vec::new();
        for _ in 0..3 {
            let (s, f) = pair().await;
            far.push(f);
            pool.put(1, s, t0);
        }
        assert_eq!(pool.idle_count(), 2, "the oldest beyond max_idle is closed");
        assert!(pool.take(1, t0 + Duration::from_secs(61)).is_none(), "timed out");
        assert_eq!(pool.idle_count(), 0, "and everything older with it");

        let (s, _f) = pair().await;
        pool.put(1, s, t0);
        let (s, f) = pair().await;
        pool.put(2, s, t0 + Duration::from_secs(30));
        drop(f);
        tokio::time::sleep(Duration::from_millis(50)).await;
        pool.sweep(t0 + Duration::from_secs(61));
        assert_eq!(pool.idle_count(), 0, "one timed out, the other was closed by its engine");
    }

    #[tokio::test]
    async fn each_core_reuses_only_its_own_connections() {
        let pools = Pools::new(2, 8, Duration::from_secs(60));
        let now = Instant::now();
        let (a, _fa) = pair().await;
        let (b, _fb) = pair().await;
        let (ida, idb) = (id(&a), id(&b));
        pools.of(Some(0)).put(1, a, now);
        pools.of(None).put(1, b, now);
        assert!(pools.of(Some(1)).take(1, now).is_none(), "core 1 has none of its own");
        assert_eq!(pools.of(Some(0)).take(1, now).map(|s| id(&s)), Some(ida));
        assert!(pools.of(Some(0)).take(1, now).is_none(), "nor does core 0 take the shared one");
        assert_eq!(pools.of(Some(7)).take(1, now).map(|s| id(&s)), Some(idb), "an unknown core shares the first");

        let (c, far) = pair().await;
        pools.of(Some(1)).put(1, c, now);
        drop(far);
        tokio::time::sleep(Duration::from_millis(50)).await;
        pools.sweep(now);
        assert_eq!(pools.of(Some(1)).idle_count(), 0, "sweep reaches every core's pool");
    }
}
