//! tests: helpers shared by the integration tests of this crate.

use tract_onnx::pb;
use tract_onnx::pb::tensor_proto::DataType;
use tract_onnx::pb::tensor_shape_proto::{Dimension, dimension};

/// A graph input or output declaration of an f32 tensor of static shape `dims`.
pub fn f32_value_info(name: &str, dims: &[usize]) -> pb::ValueInfoProto {
    let dim = dims
        .iter()
        .map(|&d| Dimension { value: Some(dimension::Value::DimValue(d as i64)), ..Default::default() })
        .collect();
    pb::ValueInfoProto {
        name: name.into(),
        r#type: Some(pb::TypeProto {
            value: Some(pb::type_proto::Value::TensorType(pb::type_proto::Tensor {
                elem_type: DataType::Float as i32,
                shape: Some(pb::TensorShapeProto { dim }),
            })),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// A tensor of uniform values in [-1, 1) from `seed` (xorshift): the same values on every run.
pub fn random_tensor(shape: &[usize], seed: u64) -> ir::Tensor {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let n: usize = shape.iter().product();
    let v = (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        })
        .collect();
    ir::Tensor::f32(shape.to_vec(), v)
}

/// `t` repeated `m` times along its first dim (`m` equal microbatches of it).
pub fn repeat_rows(t: &ir::Tensor, m: usize) -> ir::Tensor {
    if m <= 1 {
        return t.clone();
    }
    let mut shape = t.shape().to_vec();
    if let Some(d) = shape.first_mut() {
        *d *= m;
    }
    let data = match t.data() {
        ir::Data::F32(v) => ir::Data::F32(v.repeat(m)),
        ir::Data::F64(v) => ir::Data::F64(v.repeat(m)),
        ir::Data::BF16(v) => ir::Data::BF16(v.repeat(m)),
        ir::Data::F16(v) => ir::Data::F16(v.repeat(m)),
        ir::Data::I64(v) => ir::Data::I64(v.repeat(m)),
        ir::Data::Bool(v) => ir::Data::Bool(v.repeat(m)),
    };
    ir::Tensor::new(shape, data).expect("same elements, repeated")
}
