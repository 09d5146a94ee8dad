//! The tensor type of the model: [`Matrix`], a weight's raw bytes (any GGML type, quantized or
//! not) as a range of a shared buffer — a memory-mapped file or an owned vector — with its
//! shape. Views of rows share the buffer; column ranges are copied (row-parallel segments).

use std::ops::Range;
use std::sync::Arc;

use super::gguf::GgmlType;
use super::quant::{dequantize_row, QuantError};

/// Raw bytes of a weight: a range of a shared buffer (a mapped file or an owned vector).
#[derive(Clone)]
pub struct Matrix {
    buf: Arc<dyn AsRef<[u8]> + Send + Sync>,
    start: usize,
    /// Element type.
    pub ty: GgmlType,
    /// Output rows.
    pub rows: usize,
    /// Weights per row.
    pub cols: usize,
}

impl std::fmt::Debug for Matrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Matrix({} × {} {})", self.rows, self.cols, self.ty)
    }
}

impl Matrix {
    /// A matrix over `buf[start..]`; `buf` must hold `rows` rows of `cols` weights of `ty`.
    pub fn new(
        buf: Arc<dyn AsRef<[u8]> + Send + Sync>,
        start: usize,
        ty: GgmlType,
        rows: usize,
        cols: usize,
    ) -> Result<Self, QuantError> {
        let need = ty.bytes_for(cols) * rows;
        let have = (*buf).as_ref().len().saturating_sub(start);
        if !cols.is_multiple_of(ty.block_len()) || need > have {
            return Err(QuantError::Shape { ty, row: cols, bytes: have, n: need });
        }
        Ok(Self { buf, start, ty, rows, cols })
    }

    fn row_bytes(&self) -> usize {
        self.ty.bytes_for(self.cols)
    }

    /// The bytes of row `r`.
    pub fn row(&self, r: usize) -> &[u8] {
        let n = self.row_bytes();
        let all: &[u8] = (*self.buf).as_ref();
        &all[self.start + r * n..self.start + (r + 1) * n]
    }

    /// The bytes of rows `r..r + n`.
    pub fn rows_bytes(&self, r: usize, n: usize) -> &[u8] {
        let b = self.row_bytes();
        let all: &[u8] = (*self.buf).as_ref();
        &all[self.start + r * b..self.start + (r + n) * b]
    }

    /// Row `r` as f32.
    pub fn row_f32(&self, r: usize, out: &mut [f32]) -> Result<(), QuantError> {
        dequantize_row(self.ty, self.row(r), out)
    }

    /// Rows `r` as a matrix over the same buffer (no copy).
    pub fn row_range(&self, r: Range<usize>) -> Matrix {
        debug_assert!(r.end <= self.rows);
        Matrix { start: self.start + r.start * self.row_bytes(), rows: r.len(), ..self.clone() }
    }

    /// Columns `c` of every row, copied into a new buffer; `c` must fall on quantization
    /// blocks.
    pub fn col_range(&self, c: Range<usize>) -> Result<Matrix, QuantError> {
        let (b0, b1) = (self.ty.bytes_for(c.start), self.ty.bytes_for(c.end));
        if !c.start.is_multiple_of(self.ty.block_len()) || !c.end.is_multiple_of(self.ty.block_len()) {
            return Err(QuantError::Shape { ty: self.ty, row: c.len(), bytes: b1 - b0, n: b1 - b0 });
        }
        let mut out = Vec::with_capacity(self.rows * (b1 - b0));
        for r in 0..self.rows {
            out.extend_from_slice(&self.row(r)[b0..b1]);
        }
        Matrix::new(Arc::new(out), 0, self.ty, self.rows, c.len())
    }
}
