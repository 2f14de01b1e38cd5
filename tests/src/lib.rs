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
