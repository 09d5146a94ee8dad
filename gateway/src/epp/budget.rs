//! gRPC messages on their way in, held against `limits.max_buffered_body_bytes`.
//!
//! tonic gathers a message whole before the picker sees it, so a message still arriving sits
//! in tonic's buffer where the request driver's body budget cannot see it: ten streams each
//! sending 10 MiB of a message and stopping held 92 MB past a 32 MiB cap. [`BudgetLayer`]
//! wraps every request body of the gRPC server: as a message's 5-byte prefix arrives, its
//! declared length is reserved in the process-wide [`BodyBudget`] (as an HTTP request's
//! `Content-Length` is), and given back once the message is whole — it is then the
//! driver's, which holds a request body in the same budget for the request's life. A
//! message that does not fit ends its stream with `RESOURCE_EXHAUSTED`, which the picker
//! answers as HTTP's 503 ([`is_budget_error`]).

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use tonic::Status;

use crate::body_budget::{BodyBudget, BodyReservation};
use crate::state::GatewayState;

/// What ends a stream whose message would pass the cap.
const BUDGET_ERROR: &str = "switchyard epp: request bodies held now are at limits.max_buffered_body_bytes";

/// Whether `status` is the one [`BudgetedBody`] ends a stream with.
pub(super) fn is_budget_error(status: &Status) -> bool {
    status.code() == tonic::Code::ResourceExhausted && status.message() == BUDGET_ERROR
}

/// Where a stream of gRPC length-prefixed messages stands (pure): the prefix of the message
/// in progress, or how much of its payload is still to come.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(super) struct Framing {
    prefix: [u8; 5],
    prefix_len: usize,
    /// The message in progress: its prefix and declared payload, in bytes.
    message: u64,
    /// Payload bytes of it still to come.
    left: u64,
}

impl Framing {
    /// Take `data`, the next bytes of the stream: the size of the message then in progress
    /// (its declared length and prefix; 5 while a prefix is incomplete; 0 between messages).
    pub(super) fn feed(&mut self, mut data: &[u8]) -> u64 {
        while !data.is_empty() {
            if self.left > 0 {
                let n = (self.left.min(data.len() as u64)) as usize;
                self.left -= n as u64;
                data = &data[n..];
                if self.left == 0 {
                    self.message = 0;
                }
                continue;
            }
            let n = (5 - self.prefix_len).min(data.len());
            self.prefix[self.prefix_len..self.prefix_len + n].copy_from_slice(&data[..n]);
            self.prefix_len += n;
            data = &data[n..];
            if self.prefix_len == 5 {
                self.prefix_len = 0;
                let len = u32::from_be_bytes([self.prefix[1], self.prefix[2], self.prefix[3], self.prefix[4]]);
                self.left = u64::from(len);
                self.message = if len == 0 { 0 } else { 5 + u64::from(len) };
            }
        }
        match self.prefix_len {
            0 => self.message,
            _ => 5,
        }
    }
}

/// A request body whose message in progress holds its size in the budget.
pub(super) struct BudgetedBody<B> {
    inner: B,
    framing: Framing,
    budget: Arc<BodyBudget>,
    /// The cap when the stream opened (`limits.max_buffered_body_bytes`).
    cap: u64,
    held: Option<BodyReservation>,
    /// A message did not fit: the stream ends after the frame that began it (whose whole
    /// messages, such as the request headers before it, still pass).
    refused: bool,
}

impl<B> BudgetedBody<B> {
    fn new(inner: B, budget: Arc<BodyBudget>, cap: u64) -> Self {
        BudgetedBody { inner, framing: Framing::default(), budget, cap, held: None, refused: false }
    }

    /// Hold what the message in progress declares after `data`; false when it does not fit.
    fn account(&mut self, data: &[u8]) -> bool {
        let size = self.framing.feed(data);
        if size == 0 {
            self.held = None;
            return true;
        }
        let cap = self.cap;
        match &mut self.held {
            Some(r) => r.resize(size, cap),
            None => {
                self.held = self.budget.reserve(size, cap);
                self.held.is_some()
            }
        }
    }
}

impl<B> Body for BudgetedBody<B>
where
    B: Body<Data = Bytes, Error = Status> + Unpin,
{
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        if self.refused {
            return Poll::Ready(Some(Err(Status::resource_exhausted(BUDGET_ERROR))));
        }
        let frame = std::task::ready!(Pin::new(&mut self.inner).poll_frame(cx));
        if let Some(Ok(Some(data))) = frame.as_ref().map(|f| f.as_ref().map(Frame::data_ref)) {
            if !self.account(data) {
                self.held = None;
                self.refused = true;
            }
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The layer putting every request body of the picker's server in the budget.
#[derive(Clone)]
pub(super) struct BudgetLayer {
    pub(super) state: Arc<GatewayState>,
}

impl<S> tower_layer::Layer<S> for BudgetLayer {
    type Service = Budgeted<S>;

    fn layer(&self, inner: S) -> Budgeted<S> {
        Budgeted { inner, state: self.state.clone() }
    }
}

/// [`BudgetLayer`]'s service.
#[derive(Clone)]
pub(super) struct Budgeted<S> {
    inner: S,
    state: Arc<GatewayState>,
}

impl<S> tower_service::Service<http::Request<tonic::body::Body>> for Budgeted<S>
where
    S: tower_service::Service<http::Request<tonic::body::Body>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        let cap = self.state.active.load().config.limits.max_buffered_body_bytes;
        let budget = self.state.bodies.clone();
        let req = req.map(|inner| tonic::body::Body::new(BudgetedBody::new(inner, budget, cap)));
        self.inner.call(req)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(len: u32) -> Vec<u8> {
        let mut m = vec![0];
        m.extend_from_slice(&len.to_be_bytes());
        m.extend(std::iter::repeat_n(b'x', len as usize));
        m
    }

    #[test]
    fn the_message_in_progress_is_sized_by_its_prefix_whatever_the_chunking() {
        let mut f = Framing::default();
        // Whole messages leave nothing in progress.
        assert_eq!(f.feed(&[message(3), message(0), message(10)].concat()), 0);
        // A prefix in two pieces, then the payload in pieces.
        let m = message(1000);
        assert_eq!(f.feed(&m[..2]), 5);
        assert_eq!(f.feed(&m[2..5]), 1005);
        assert_eq!(f.feed(&m[5..500]), 1005);
        assert_eq!(f.feed(&m[500..]), 0);
        // The end of one message and the start of the next in one chunk.
        let two = [message(4), message(20)].concat();
        assert_eq!(f.feed(&two[..12]), 5);
        assert_eq!(f.feed(&two[12..16]), 25);
        assert_eq!(f.feed(&two[16..]), 0);
    }

    #[tokio::test]
    async fn a_partial_message_holds_its_declared_size_and_one_past_the_cap_is_refused() {
        let gauge = prometheus::IntGauge::new("g", "g").unwrap();
        let budget = BodyBudget::new(gauge);
        let body = |chunks: Vec<Vec<u8>>| {
            let frames = chunks.into_iter().map(|c| Ok::<_, Status>(Frame::data(Bytes::from(c))));
            let inner = http_body_util::StreamBody::new(futures_util::stream::iter(frames));
            BudgetedBody::new(inner, budget.clone(), 1 << 20)
        };
        use http_body_util::BodyExt;
        let m = message(600_000);
        // The first 100 bytes of a 600 kB message hold 600 kB.
        let mut a = body(vec![m[..100].to_vec(), m[100..].to_vec()]);
        a.frame().await.unwrap().unwrap();
        assert_eq!(budget.held(), 600_005);
        // A second such message does not fit under the 1 MiB cap: the frame passes (a whole
        // message before it would reach the picker), then the stream ends.
        let mut b = body(vec![m[..100].to_vec(), m[100..200].to_vec()]);
        b.frame().await.unwrap().unwrap();
        let err = b.frame().await.unwrap().unwrap_err();
        assert!(is_budget_error(&err), "{err:?}");
        assert_eq!(budget.held(), 600_005);
        // The first completes: given back.
        a.frame().await.unwrap().unwrap();
        assert_eq!(budget.held(), 0);
    }
}
