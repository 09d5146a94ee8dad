//! GGUF reader: header, metadata, tensor infos and tensor data of a `.gguf` file.
//!
//! The layout (little-endian throughout):
//!
//! ```text
//! "GGUF" u32:version u64:tensor_count u64:kv_count
//! kv_count × { string:key  u32:value_type  value }
//! tensor_count × { string:name  u32:n_dims  n_dims × u64:dim (innermost first)  u32:ggml_type  u64:offset }
//! padding to `general.alignment` (default 32)
//! tensor data; each tensor at data_start + offset
//! ```
//!
//! A string is `u64:len` + UTF-8 bytes; an array is `u32:elem_type u64:n` + values.
//! [`parse`] is pure (it reads a byte slice and validates every length and offset against
//! it, so a truncated or corrupt file is an error, never a panic or an out-of-bounds read);
//! [`GgufFile::open`] memory-maps a file and parses it.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

/// Why a GGUF file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// The file cannot be opened or mapped.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The first four bytes are not `GGUF`.
    #[error("not a GGUF file (magic {0:02x?}, expected \"GGUF\")")]
    BadMagic([u8; 4]),
    /// A version this reader does not know.
    #[error("unsupported GGUF version {0} (supported: 2, 3)")]
    UnsupportedVersion(u32),
    /// The file ends before `what` is complete.
    #[error("truncated file: {what} at byte {offset} needs {needed} bytes, {available} left")]
    Truncated {
        /// What was being read.
        what: String,
        /// Where it starts.
        offset: usize,
        /// Bytes it needs.
        needed: u64,
        /// Bytes left in the file.
        available: usize,
    },
    /// A string is not UTF-8.
    #[error("{what} at byte {offset} is not valid UTF-8")]
    InvalidUtf8 {
        /// What was being read.
        what: String,
        /// Where it starts.
        offset: usize,
    },
    /// A metadata value type outside the specification.
    #[error("metadata `{key}`: unknown value type {ty}")]
    UnknownValueType {
        /// The key.
        key: String,
        /// The type id found.
        ty: u32,
    },
    /// A tensor type this engine cannot compute with.
    #[error("tensor `{name}`: unsupported ggml type {ty}")]
    UnsupportedTensorType {
        /// The tensor.
        name: String,
        /// The type id found.
        ty: u32,
    },
    /// A tensor's shape is unusable (no dimensions, a zero or overflowing size, rows not a
    /// whole number of quantization blocks).
    #[error("tensor `{name}`: {reason}")]
    BadTensor {
        /// The tensor.
        name: String,
        /// What is wrong.
        reason: String,
    },
    /// A metadata value has the wrong type for what it means.
    #[error("metadata `{key}`: {reason}")]
    BadMetadata {
        /// The key.
        key: String,
        /// What is wrong.
        reason: String,
    },
}

/// Tensor element types (ggml type ids) this engine reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    /// 32-bit float.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    BF16,
    /// Blocks of 32: `f16 d; u8 qs[16]`, `w = (q - 8)·d`.
    Q4_0,
    /// Blocks of 32: `f16 d; f16 m; u8 qs[16]`, `w = q·d + m`.
    Q4_1,
    /// Blocks of 32: `f16 d; i8 qs[32]`, `w = q·d`.
    Q8_0,
    /// Blocks of 32: `f16 d; f16 s; i8 qs[32]` (activations in llama.cpp).
    Q8_1,
    /// K-quant super-blocks of 256 weights, 4 bits.
    Q4K,
    /// K-quant super-blocks of 256 weights, 6 bits.
    Q6K,
}

impl GgmlType {
    /// The type of ggml id `id`, if this engine supports it.
    pub fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            8 => Self::Q8_0,
            9 => Self::Q8_1,
            12 => Self::Q4K,
            14 => Self::Q6K,
            30 => Self::BF16,
            _ => return None,
        })
    }

    /// Weights per block.
    pub fn block_len(self) -> usize {
        match self {
            Self::F32 | Self::F16 | Self::BF16 => 1,
            Self::Q4_0 | Self::Q4_1 | Self::Q8_0 | Self::Q8_1 => 32,
            Self::Q4K | Self::Q6K => 256,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::BF16 => 2,
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q8_0 => 34,
            Self::Q8_1 => 36,
            Self::Q4K => 144,
            Self::Q6K => 210,
        }
    }

    /// Bytes holding `n` weights (`n` a multiple of [`Self::block_len`]).
    pub fn bytes_for(self, n: usize) -> usize {
        n / self.block_len() * self.block_bytes()
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            Self::F32 => "F32",
            Self::F16 => "F16",
            Self::BF16 => "BF16",
            Self::Q4_0 => "Q4_0",
            Self::Q4_1 => "Q4_1",
            Self::Q8_0 => "Q8_0",
            Self::Q8_1 => "Q8_1",
            Self::Q4K => "Q4_K",
            Self::Q6K => "Q6_K",
        };
        f.write_str(s)
    }
}

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// Type 0.
    U8(u8),
    /// Type 1.
    I8(i8),
    /// Type 2.
    U16(u16),
    /// Type 3.
    I16(i16),
    /// Type 4.
    U32(u32),
    /// Type 5.
    I32(i32),
    /// Type 6.
    F32(f32),
    /// Type 7.
    Bool(bool),
    /// Type 8.
    String(String),
    /// Type 9 (elements all of one type).
    Array(Vec<Value>),
    /// Type 10.
    U64(u64),
    /// Type 11.
    I64(i64),
    /// Type 12.
    F64(f64),
}

impl Value {
    /// The value as an unsigned integer, whatever integer type stored it (counts are u32 in
    /// some files and u64 in others).
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Self::U8(v) => Some(v.into()),
            Self::U16(v) => Some(v.into()),
            Self::U32(v) => Some(v.into()),
            Self::U64(v) => Some(v),
            Self::I8(v) => u64::try_from(v).ok(),
            Self::I16(v) => u64::try_from(v).ok(),
            Self::I32(v) => u64::try_from(v).ok(),
            Self::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a float (either float type).
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Self::F32(v) => Some(v.into()),
            Self::F64(v) => Some(v),
            _ => None,
        }
    }

    /// The value as a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Self::String(s) => Some(s),
            _ => None,
        }
    }

    /// The value as a bool.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Self::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// The value as an array.
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Self::Array(v) => Some(v),
            _ => None,
        }
    }
}

/// Where a tensor lives and what it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// Tensor name (`blk.0.attn_q.weight`).
    pub name: String,
    /// Dimensions, innermost (contiguous) first: a matrix of `rows` rows of `cols` weights
    /// is `[cols, rows]`.
    pub dims: Vec<u64>,
    /// Element type.
    pub ty: GgmlType,
    /// Absolute byte offset of the data in the file.
    pub start: usize,
    /// Byte length of the data.
    pub len: usize,
}

impl TensorInfo {
    /// Number of elements.
    pub fn elements(&self) -> usize {
        self.dims.iter().product::<u64>() as usize
    }

    /// Length of the innermost dimension (a row).
    pub fn row_len(&self) -> usize {
        self.dims[0] as usize
    }

    /// Number of rows (product of the outer dimensions).
    pub fn rows(&self) -> usize {
        self.dims[1..].iter().product::<u64>() as usize
    }
}

/// The parsed header of a GGUF file.
#[derive(Debug, Clone, PartialEq)]
pub struct Header {
    /// Format version.
    pub version: u32,
    /// Metadata, by key.
    pub metadata: BTreeMap<String, Value>,
    /// Tensors, in file order.
    pub tensors: Vec<TensorInfo>,
    /// Absolute offset where tensor data begins.
    pub data_start: usize,
}

impl Header {
    /// A metadata value.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    /// A required unsigned integer.
    pub fn u64(&self, key: &str) -> Result<u64, GgufError> {
        self.required(key)?.as_u64().ok_or_else(|| bad(key, "expected an unsigned integer"))
    }

    /// A required float.
    pub fn f64(&self, key: &str) -> Result<f64, GgufError> {
        self.required(key)?.as_f64().ok_or_else(|| bad(key, "expected a float"))
    }

    /// A required string.
    pub fn str(&self, key: &str) -> Result<&str, GgufError> {
        self.required(key)?.as_str().ok_or_else(|| bad(key, "expected a string"))
    }

    /// A tensor by name.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    fn required(&self, key: &str) -> Result<&Value, GgufError> {
        self.metadata.get(key).ok_or_else(|| bad(key, "missing"))
    }
}

fn bad(key: &str, reason: &str) -> GgufError {
    GgufError::BadMetadata { key: key.to_string(), reason: reason.to_string() }
}

/// A memory-mapped GGUF file.
pub struct GgufFile {
    /// The parsed header.
    pub header: Header,
    map: std::sync::Arc<memmap2::Mmap>,
}

impl fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GgufFile").field("header.version", &self.header.version).finish_non_exhaustive()
    }
}

impl GgufFile {
    /// Map and parse `path`.
    pub fn open(path: &Path) -> Result<Self, GgufError> {
        let io = |source| GgufError::Io { path: path.to_path_buf(), source };
        let file = std::fs::File::open(path).map_err(io)?;
        // SAFETY: the map is read-only and private to this process. Another process
        // truncating the file while it is mapped would fault (SIGBUS) — the same contract as
        // llama.cpp's and candle's mmap loaders; model files are not rewritten in place.
        #[allow(unsafe_code)]
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        let header = parse(&map)?;
        Ok(Self { header, map: std::sync::Arc::new(map) })
    }

    /// The whole mapped file, shareable with the weights that point into it.
    pub fn map(&self) -> std::sync::Arc<memmap2::Mmap> {
        self.map.clone()
    }

    /// The bytes of a tensor (bounds were checked by [`parse`]).
    pub fn data(&self, t: &TensorInfo) -> &[u8] {
        &self.map[t.start..t.start + t.len]
    }
}

/// Reads little-endian values from a byte slice, every read bounds-checked.
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: u64, what: &dyn Fn() -> String) -> Result<&'a [u8], GgufError> {
        let available = self.bytes.len() - self.pos;
        if n > available as u64 {
            return Err(GgufError::Truncated { what: what(), offset: self.pos, needed: n, available });
        }
        let s = &self.bytes[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N], GgufError> {
        let s = self.take(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32, GgufError> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64, GgufError> {
        self.array(what).map(u64::from_le_bytes)
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String, GgufError> {
        let len = self.u64(what)?;
        let offset = self.pos;
        let bytes = self.take(len, what)?;
        std::str::from_utf8(bytes).map(str::to_owned).map_err(|_| GgufError::InvalidUtf8 { what: what(), offset })
    }

    fn value(&mut self, ty: u32, key: &str, depth: u32) -> Result<Value, GgufError> {
        let what = || format!("value of `{key}`");
        Ok(match ty {
            0 => Value::U8(self.array::<1>(&what)?[0]),
            1 => Value::I8(i8::from_le_bytes(self.array(&what)?)),
            2 => Value::U16(u16::from_le_bytes(self.array(&what)?)),
            3 => Value::I16(i16::from_le_bytes(self.array(&what)?)),
            4 => Value::U32(self.u32(&what)?),
            5 => Value::I32(i32::from_le_bytes(self.array(&what)?)),
            6 => Value::F32(f32::from_le_bytes(self.array(&what)?)),
            7 => match self.array::<1>(&what)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(bad(key, &format!("bool byte {b} is neither 0 nor 1"))),
            },
            8 => Value::String(self.string(&what)?),
            9 => {
                if depth > 0 {
                    return Err(bad(key, "nested arrays are not supported"));
                }
                let elem = self.u32(&what)?;
                let n = self.u64(&what)?;
                // Every element takes at least one byte: a count larger than the bytes left
                // is corrupt, and must not drive a huge allocation.
                let available = self.bytes.len() - self.pos;
                if n > available as u64 {
                    return Err(GgufError::Truncated { what: what(), offset: self.pos, needed: n, available });
                }
                let mut items = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    items.push(self.value(elem, key, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64(&what)?),
            11 => Value::I64(i64::from_le_bytes(self.array(&what)?)),
            12 => Value::F64(f64::from_le_bytes(self.array(&what)?)),
            ty => return Err(GgufError::UnknownValueType { key: key.to_string(), ty }),
        })
    }
}

/// Parse a whole GGUF file held in `bytes`, validating every tensor's extent against it.
pub fn parse(bytes: &[u8]) -> Result<Header, GgufError> {
    let mut c = Cursor { bytes, pos: 0 };
    let magic: [u8; 4] = c.array(&|| "magic".into())?;
    if &magic != b"GGUF" {
        return Err(GgufError::BadMagic(magic));
    }
    let version = c.u32(&|| "version".into())?;
    if !(2..=3).contains(&version) {
        return Err(GgufError::UnsupportedVersion(version));
    }
    let n_tensors = c.u64(&|| "tensor count".into())?;
    let n_kv = c.u64(&|| "metadata count".into())?;

    let mut metadata = BTreeMap::new();
    for i in 0..n_kv {
        let key = c.string(&|| format!("metadata key #{i}"))?;
        let ty = c.u32(&|| format!("type of `{key}`"))?;
        let value = c.value(ty, &key, 0)?;
        metadata.insert(key, value);
    }

    let mut raw = Vec::new();
    for i in 0..n_tensors {
        let name = c.string(&|| format!("name of tensor #{i}"))?;
        let what = || format!("info of tensor `{name}`");
        let n_dims = c.u32(&what)?;
        if n_dims == 0 || n_dims > 4 {
            return Err(GgufError::BadTensor { name, reason: format!("{n_dims} dimensions (1..=4 supported)") });
        }
        let dims = (0..n_dims).map(|_| c.u64(&what)).collect::<Result<Vec<_>, _>>()?;
        let ty_id = c.u32(&what)?;
        let offset = c.u64(&what)?;
        let ty = GgmlType::from_id(ty_id).ok_or(GgufError::UnsupportedTensorType { name: name.clone(), ty: ty_id })?;
        raw.push((name, dims, ty, offset));
    }

    let alignment = match metadata.get("general.alignment") {
        None => 32,
        Some(v) => match v.as_u64() {
            Some(a) if a > 0 && a.is_power_of_two() => a as usize,
            _ => return Err(bad("general.alignment", "expected a power of two")),
        },
    };
    let data_start = c.pos.div_ceil(alignment) * alignment;

    let mut tensors = Vec::with_capacity(raw.len());
    for (name, dims, ty, offset) in raw {
        let bad_tensor = |reason: String| GgufError::BadTensor { name: name.clone(), reason };
        let elements = dims.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d)).filter(|&n| n > 0);
        let Some(elements) = elements else {
            return Err(bad_tensor(format!("dimensions {dims:?} are empty or overflow")));
        };
        if !dims[0].is_multiple_of(ty.block_len() as u64) {
            return Err(bad_tensor(format!(
                "row length {} is not a multiple of {ty}'s block of {}",
                dims[0],
                ty.block_len()
            )));
        }
        if !offset.is_multiple_of(alignment as u64) {
            return Err(bad_tensor(format!("data offset {offset} is not aligned to {alignment}")));
        }
        let len = (elements / ty.block_len() as u64) * ty.block_bytes() as u64;
        let end = (data_start as u64).checked_add(offset).and_then(|s| s.checked_add(len));
        match end {
            Some(end) if end <= bytes.len() as u64 => {}
            _ => {
                return Err(GgufError::Truncated {
                    what: format!("data of tensor `{name}` ({ty}, {dims:?})"),
                    offset: (data_start as u64).saturating_add(offset).min(usize::MAX as u64) as usize,
                    needed: len,
                    available: bytes.len().saturating_sub(data_start.saturating_add(offset as usize)),
                });
            }
        }
        tensors.push(TensorInfo { name, dims, ty, start: data_start + offset as usize, len: len as usize });
    }
    Ok(Header { version, metadata, tensors, data_start })
}

#[cfg(test)]
mod tests;
