//! Blocks read by `InitializerIndex` equal the same blocks of the importer's parameters, for the
//! bundled models (raw data) and a hand-built model with external data and packed float_data.

use std::path::PathBuf;

use ir::Tensor;
use prost::Message;
use tracer::{ImportOptions, InitializerIndex, import_file};
use tract_onnx::pb;

fn model(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/data/models").join(name)
}

/// The block of `t` at `off` with shape `size`, by direct indexing.
fn block(t: &Tensor, off: &[usize], size: &[usize]) -> Vec<f32> {
    let v = t.as_f32().expect("f32");
    let shape = t.shape();
    let n: usize = size.iter().product();
    (0..n)
        .map(|mut flat| {
            let mut src = 0;
            let mut stride = 1;
            let mut idx = vec![0; size.len()];
            for d in (0..size.len()).rev() {
                idx[d] = flat % size[d];
                flat /= size[d];
            }
            for d in (0..size.len()).rev() {
                src += (off[d] + idx[d]) * stride;
                stride *= shape[d];
            }
            v[src]
        })
        .collect()
}

fn check_model(path: &std::path::Path) {
    let g = import_file(path, &ImportOptions::default()).unwrap();
    let index = InitializerIndex::open(path).unwrap();
    assert!(!g.param_data.is_empty());
    for (name, t) in &g.param_data {
        let shape = t.shape().to_vec();
        let whole = index.read_block(name, &vec![0; shape.len()], &shape).unwrap().unwrap();
        assert_eq!(whole.as_slice(), t.as_f32().unwrap(), "{name} whole");
        // Halves and quarters along every dim that divides.
        for d in 0..shape.len() {
            for parts in [2, 4] {
                if shape[d] % parts != 0 {
                    continue;
                }
                let mut size = shape.clone();
                size[d] /= parts;
                let mut off = vec![0; shape.len()];
                off[d] = size[d] * (parts - 1);
                let got = index.read_block(name, &off, &size).unwrap().unwrap();
                assert_eq!(got, block(t, &off, &size), "{name} dim {d} / {parts}");
            }
        }
        // A block split on two dims at once.
        if shape.len() >= 2 && shape[0] % 2 == 0 && shape[1] % 2 == 0 {
            let size: Vec<usize> = [shape[0] / 2, shape[1] / 2].into_iter().chain(shape[2..].iter().copied()).collect();
            let mut off = vec![0; shape.len()];
            off[0] = size[0];
            off[1] = size[1];
            let got = index.read_block(name, &off, &size).unwrap().unwrap();
            assert_eq!(got, block(t, &off, &size), "{name} 2-D block");
        }
    }
}

#[test]
fn blocks_equal_imported_parameters() {
    for m in ["mlp.onnx", "gpt2-tiny.onnx", "bert-tiny.onnx", "resnet18.onnx"] {
        check_model(&model(m));
    }
}

#[test]
fn weight_free_model_has_no_data() {
    let index = InitializerIndex::open(&model("gpt2-small-graph-only.onnx")).unwrap();
    assert!(index.is_empty());
    assert_eq!(index.read_block("transformer.wte.weight", &[0, 0], &[2, 2]).unwrap(), None);
}

#[test]
fn external_data_and_packed_float_data() {
    let dir = tempfile::tempdir().unwrap();
    let w: Vec<f32> = (0..24).map(|i| i as f32 * 0.5 - 3.0).collect();
    let b: Vec<f32> = (0..4).map(|i| i as f32 + 0.25).collect();
    let mut ext = vec![0u8; 16]; // the data starts at offset 16
    ext.extend(w.iter().flat_map(|x| x.to_le_bytes()));
    std::fs::write(dir.path().join("w.bin"), &ext).unwrap();
    let kv = |k: &str, v: &str| pb::StringStringEntryProto { key: k.into(), value: v.into() };
    let wt = pb::TensorProto {
        name: "w".into(),
        dims: vec![6, 4],
        data_type: 1,
        data_location: Some(1),
        external_data: vec![kv("location", "w.bin"), kv("offset", "16"), kv("length", "96")],
        ..Default::default()
    };
    let bt =
        pb::TensorProto { name: "b".into(), dims: vec![4], data_type: 1, float_data: b.clone(), ..Default::default() };
    let m = pb::ModelProto {
        graph: Some(pb::GraphProto { name: "g".into(), initializer: vec![wt, bt], ..Default::default() }),
        ..Default::default()
    };
    let path = dir.path().join("m.onnx");
    std::fs::write(&path, m.encode_to_vec()).unwrap();
    let index = InitializerIndex::open(&path).unwrap();
    assert_eq!(index.len(), 2);
    let wt = Tensor::f32(vec![6, 4], w);
    assert_eq!(index.read_block("w", &[2, 2], &[2, 2]).unwrap().unwrap(), block(&wt, &[2, 2], &[2, 2]));
    assert_eq!(index.read_block("b", &[2], &[2]).unwrap().unwrap(), b[2..].to_vec());
    assert!(index.read_block("w", &[5, 0], &[2, 4]).is_err());
    // A truncated file is a clear error, not a panic.
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 7]).unwrap();
    assert!(InitializerIndex::open(&path).is_err());
}
