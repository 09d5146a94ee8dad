//! GGUF parser tests over files built byte by byte.

use super::*;

/// Builds GGUF bytes.
struct Writer {
    kvs: Vec<u8>,
    n_kv: u64,
    infos: Vec<u8>,
    n_tensors: u64,
    data: Vec<u8>,
    alignment: usize,
}

impl Writer {
    fn new() -> Self {
        Self { kvs: Vec::new(), n_kv: 0, infos: Vec::new(), n_tensors: 0, data: Vec::new(), alignment: 32 }
    }

    fn string(buf: &mut Vec<u8>, s: &str) {
        buf.extend_from_slice(&(s.len() as u64).to_le_bytes());
        buf.extend_from_slice(s.as_bytes());
    }

    /// A key with a raw type id and raw value bytes.
    fn kv_raw(&mut self, key: &str, ty: u32, value: &[u8]) -> &mut Self {
        Self::string(&mut self.kvs, key);
        self.kvs.extend_from_slice(&ty.to_le_bytes());
        self.kvs.extend_from_slice(value);
        self.n_kv += 1;
        self
    }

    fn kv_str(&mut self, key: &str, v: &str) -> &mut Self {
        let mut b = Vec::new();
        Self::string(&mut b, v);
        self.kv_raw(key, 8, &b)
    }

    /// A tensor whose data is `bytes`, placed at the next aligned offset.
    fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, bytes: &[u8]) -> &mut Self {
        let offset = self.data.len().div_ceil(self.alignment) * self.alignment;
        self.data.resize(offset, 0);
        self.data.extend_from_slice(bytes);
        Self::string(&mut self.infos, name);
        self.infos.extend_from_slice(&(dims.len() as u32).to_le_bytes());
        for d in dims {
            self.infos.extend_from_slice(&d.to_le_bytes());
        }
        self.infos.extend_from_slice(&ty.to_le_bytes());
        self.infos.extend_from_slice(&(offset as u64).to_le_bytes());
        self.n_tensors += 1;
        self
    }

    fn build_version(&self, version: u32) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend_from_slice(&version.to_le_bytes());
        out.extend_from_slice(&self.n_tensors.to_le_bytes());
        out.extend_from_slice(&self.n_kv.to_le_bytes());
        out.extend_from_slice(&self.kvs);
        out.extend_from_slice(&self.infos);
        out.resize(out.len().div_ceil(self.alignment) * self.alignment, 0);
        out.extend_from_slice(&self.data);
        out
    }

    fn build(&self) -> Vec<u8> {
        self.build_version(3)
    }
}

fn sample() -> Vec<u8> {
    let mut w = Writer::new();
    let mut arr = 8u32.to_le_bytes().to_vec();
    arr.extend_from_slice(&2u64.to_le_bytes());
    Writer::string(&mut arr, "<s>");
    Writer::string(&mut arr, "héllo");
    w.kv_str("general.architecture", "llama")
        .kv_raw("u8", 0, &[200])
        .kv_raw("i8", 1, &(-5i8).to_le_bytes())
        .kv_raw("u16", 2, &60000u16.to_le_bytes())
        .kv_raw("i16", 3, &(-300i16).to_le_bytes())
        .kv_raw("llama.block_count", 4, &30u32.to_le_bytes())
        .kv_raw("i32", 5, &(-7i32).to_le_bytes())
        .kv_raw("eps", 6, &1e-5f32.to_le_bytes())
        .kv_raw("flag", 7, &[1])
        .kv_raw("tokens", 9, &arr)
        .kv_raw("u64", 10, &(1u64 << 40).to_le_bytes())
        .kv_raw("i64", 11, &(-1i64).to_le_bytes())
        .kv_raw("f64", 12, &0.25f64.to_le_bytes())
        .tensor("norm", &[4], 0, &[0u8; 16])
        .tensor("w", &[64, 2], 3, &[7u8; 80])
        .tensor("emb", &[32, 3], 8, &[1u8; 102]);
    w.build()
}

#[test]
fn reads_every_metadata_type_and_tensor_extents() {
    let bytes = sample();
    let h = parse(&bytes).unwrap();
    assert_eq!(h.version, 3);
    assert_eq!(h.str("general.architecture").unwrap(), "llama");
    assert_eq!(h.get("u8"), Some(&Value::U8(200)));
    assert_eq!(h.get("i8"), Some(&Value::I8(-5)));
    assert_eq!(h.get("u16"), Some(&Value::U16(60000)));
    assert_eq!(h.get("i16"), Some(&Value::I16(-300)));
    assert_eq!(h.u64("llama.block_count").unwrap(), 30);
    assert_eq!(h.get("i32"), Some(&Value::I32(-7)));
    assert_eq!(h.f64("eps").unwrap() as f32, 1e-5);
    assert_eq!(h.get("flag").and_then(Value::as_bool), Some(true));
    assert_eq!(
        h.get("tokens").and_then(Value::as_array).unwrap(),
        &[Value::String("<s>".into()), Value::String("héllo".into())]
    );
    assert_eq!(h.u64("u64").unwrap(), 1 << 40);
    assert_eq!(h.get("i64"), Some(&Value::I64(-1)));
    assert_eq!(h.get("i64").unwrap().as_u64(), None, "a negative count is not a count");
    assert_eq!(h.f64("f64").unwrap(), 0.25);

    assert_eq!(h.data_start % 32, 0);
    let w = h.tensor("w").unwrap();
    assert_eq!((w.ty, w.row_len(), w.rows(), w.len), (GgmlType::Q4_1, 64, 2, 80));
    assert_eq!(&bytes[w.start..w.start + w.len], &[7u8; 80]);
    let e = h.tensor("emb").unwrap();
    assert_eq!((e.ty, e.len, e.start % 32), (GgmlType::Q8_0, 102, 0));
    assert!(matches!(h.u64("general.architecture"), Err(GgufError::BadMetadata { .. })));
    assert!(matches!(h.u64("missing"), Err(GgufError::BadMetadata { .. })));
}

#[test]
fn every_truncation_is_an_error_never_a_panic() {
    let bytes = sample();
    for n in 0..bytes.len() {
        let err = parse(&bytes[..n]).expect_err(&format!("prefix of {n} bytes parsed"));
        assert!(matches!(err, GgufError::Truncated { .. }), "prefix {n}: {err}");
    }
}

#[test]
fn corrupt_headers_are_named() {
    let mut bytes = sample();
    bytes[0] = b'X';
    assert!(matches!(parse(&bytes), Err(GgufError::BadMagic(_))));
    let w = Writer::new();
    assert!(matches!(parse(&w.build_version(1)), Err(GgufError::UnsupportedVersion(1))));
    assert!(parse(&w.build_version(2)).is_ok());

    let mut w = Writer::new();
    w.kv_raw("weird", 13, &[0; 8]);
    let err = parse(&w.build()).unwrap_err();
    assert!(matches!(err, GgufError::UnknownValueType { ty: 13, .. }), "{err}");
    assert!(err.to_string().contains("weird"));

    let mut w = Writer::new();
    w.kv_raw("b", 7, &[2]);
    assert!(matches!(parse(&w.build()), Err(GgufError::BadMetadata { .. })));

    let mut w = Writer::new();
    w.kv_raw("s", 8, &[2, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xfe]);
    assert!(matches!(parse(&w.build()), Err(GgufError::InvalidUtf8 { .. })));
}

#[test]
fn a_huge_array_count_is_truncation_not_an_allocation() {
    let mut arr = 4u32.to_le_bytes().to_vec();
    arr.extend_from_slice(&u64::MAX.to_le_bytes());
    let mut w = Writer::new();
    w.kv_raw("a", 9, &arr);
    assert!(matches!(parse(&w.build()), Err(GgufError::Truncated { .. })));
    // And a huge string length.
    let mut w = Writer::new();
    w.kv_raw("s", 8, &u64::MAX.to_le_bytes());
    assert!(matches!(parse(&w.build()), Err(GgufError::Truncated { .. })));
}

#[test]
fn bad_tensors_are_named() {
    let mut w = Writer::new();
    w.tensor("x", &[4], 6, &[0; 16]); // Q5_0: not supported
    let err = parse(&w.build()).unwrap_err();
    assert!(matches!(err, GgufError::UnsupportedTensorType { ty: 6, .. }) && err.to_string().contains("`x`"), "{err}");

    let mut w = Writer::new();
    w.tensor("q", &[48], 3, &[0; 40]); // a Q4_1 row of 48 is not whole blocks
    assert!(matches!(parse(&w.build()), Err(GgufError::BadTensor { .. })));

    let mut w = Writer::new();
    w.tensor("z", &[0, 4], 0, &[]);
    assert!(matches!(parse(&w.build()), Err(GgufError::BadTensor { .. })));

    let mut w = Writer::new();
    w.tensor("big", &[u64::MAX, 4], 0, &[]);
    assert!(matches!(parse(&w.build()), Err(GgufError::BadTensor { .. })));

    // Data running past the end of the file.
    let mut w = Writer::new();
    w.tensor("t", &[32, 2], 0, &[0; 100]); // needs 256 bytes
    let err = parse(&w.build()).unwrap_err();
    assert!(matches!(err, GgufError::Truncated { .. }) && err.to_string().contains("`t`"), "{err}");

    let mut w = Writer::new();
    w.kv_raw("general.alignment", 4, &3u32.to_le_bytes());
    assert!(matches!(parse(&w.build()), Err(GgufError::BadMetadata { .. })));
}

#[test]
fn custom_alignment_places_data() {
    let mut w = Writer::new();
    w.alignment = 64;
    w.kv_raw("general.alignment", 4, &64u32.to_le_bytes()).tensor("a", &[3], 0, &[1; 12]).tensor("b", &[2], 0, &[2; 8]);
    let bytes = w.build();
    let h = parse(&bytes).unwrap();
    assert_eq!(h.data_start % 64, 0);
    let b = h.tensor("b").unwrap();
    assert_eq!((b.start - h.data_start, &bytes[b.start..b.start + 8]), (64, &[2u8; 8][..]));
}

#[test]
fn open_maps_a_file_and_reports_missing_ones() {
    let dir = std::env::temp_dir().join(format!("switchyard-gguf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("m.gguf");
    std::fs::write(&path, sample()).unwrap();
    let f = GgufFile::open(&path).unwrap();
    let w = f.header.tensor("w").unwrap().clone();
    assert_eq!(f.data(&w), &[7u8; 80]);
    let err = GgufFile::open(&dir.join("absent.gguf")).unwrap_err();
    assert!(matches!(err, GgufError::Io { .. }) && err.to_string().contains("absent.gguf"));
    std::fs::remove_dir_all(&dir).unwrap();
}
