//! ONNX element types and how autopar holds them.
//!
//! autopar computes in four types ([`ir::DType`]): f32 (f64 under `--precision f64`), i64 and
//! bool. ONNX has more; the importer maps each onto one of these, exactly where it can:
//!
//! | ONNX type | held as | values |
//! |---|---|---|
//! | int8, int16, int32, uint8, uint16, uint32, int64 | i64 | exact |
//! | uint64 | i64 | exact up to `i64::MAX`; a larger value is an error naming the tensor |
//! | float16, bfloat16 | f32 | exact (every f16/bf16 value is an f32) |
//! | float64 | f32 | rounded to f32 (`--precision f64` then computes in f64) |
//! | bool | bool | exact |
//!
//! Graph inputs of these types are graph inputs of the held type: an int32 `.npy` feeds an int32
//! input as i64 (the reader widens it), and integer outputs are written as int64.
//!
//! A `Cast` is exact on constants ([`cast_constant`]): a cast to int8/uint8/int16/... wraps to
//! that width, and a cast to float16/bfloat16 rounds to that precision (to nearest, ties to
//! even), both then held in the wider type. A `Cast` of a computed value to a narrower integer
//! type is the cast to i64 (exact for values in the target's range, which is what index and mask
//! casts carry), and one to float16/bfloat16 keeps f32 precision: autopar has no kernel rounding
//! to half precision, so such a model computes in f32 where PyTorch rounded, and the importer
//! warns once per node.

use ir::{DType, Data, Tensor};
use tract_onnx::prelude::tract_data::half::{bf16, f16};

/// `TensorProto.DataType` codes the importer reads.
pub(crate) mod code {
    pub const FLOAT: i32 = 1;
    pub const UINT8: i32 = 2;
    pub const INT8: i32 = 3;
    pub const UINT16: i32 = 4;
    pub const INT16: i32 = 5;
    pub const INT32: i32 = 6;
    pub const INT64: i32 = 7;
    pub const BOOL: i32 = 9;
    pub const FLOAT16: i32 = 10;
    pub const DOUBLE: i32 = 11;
    pub const UINT32: i32 = 12;
    pub const UINT64: i32 = 13;
    pub const BFLOAT16: i32 = 16;
}

/// The autopar type an ONNX element type (`TensorProto.DataType` code) is held as: i64 for every
/// integer type, f32 for float16, bfloat16, float32 and float64, bool for bool; `None` for the
/// types autopar does not hold (string, complex, 8-bit and 4-bit floats, ...).
pub fn held_dtype(c: i32) -> Option<DType> {
    held_as(c)
}

pub(crate) fn held_as(c: i32) -> Option<DType> {
    use code::*;
    match c {
        FLOAT | FLOAT16 | BFLOAT16 | DOUBLE => Some(DType::F32),
        UINT8 | INT8 | UINT16 | INT16 | INT32 | INT64 | UINT32 | UINT64 => Some(DType::I64),
        BOOL => Some(DType::Bool),
        _ => None,
    }
}

/// True for the ONNX float types (held as f32, read as trainable parameters when initializers).
pub(crate) fn is_float(c: i32) -> bool {
    matches!(c, code::FLOAT | code::FLOAT16 | code::BFLOAT16 | code::DOUBLE)
}

/// Bytes per element in ONNX's raw data.
pub(crate) fn elem_bytes(c: i32) -> Option<u64> {
    use code::*;
    match c {
        UINT8 | INT8 | BOOL => Some(1),
        UINT16 | INT16 | FLOAT16 | BFLOAT16 => Some(2),
        FLOAT | INT32 | UINT32 => Some(4),
        INT64 | DOUBLE | UINT64 => Some(8),
        _ => None,
    }
}

fn u64_to_i64(x: u64) -> Result<i64, String> {
    i64::try_from(x).map_err(|_| format!("uint64 value {x} does not fit autopar's int64"))
}

/// Decodes little-endian raw data of type `c` (its length already checked: a whole number of
/// elements) into the held type.
pub(crate) fn decode_raw(c: i32, r: &[u8]) -> Result<Data, String> {
    use code::*;
    let b2 = |x: &[u8]| u16::from_le_bytes([x[0], x[1]]);
    let b4 = |x: &[u8]| [x[0], x[1], x[2], x[3]];
    let b8 = |x: &[u8]| -> [u8; 8] { x.try_into().expect("8 bytes") };
    Ok(match c {
        FLOAT => Data::F32(r.chunks_exact(4).map(|x| f32::from_le_bytes(b4(x))).collect()),
        FLOAT16 => Data::F32(r.chunks_exact(2).map(|x| f16::from_bits(b2(x)).to_f32()).collect()),
        BFLOAT16 => Data::F32(r.chunks_exact(2).map(|x| bf16::from_bits(b2(x)).to_f32()).collect()),
        DOUBLE => Data::F32(r.chunks_exact(8).map(|x| f64::from_le_bytes(b8(x)) as f32).collect()),
        INT64 => Data::I64(r.chunks_exact(8).map(|x| i64::from_le_bytes(b8(x))).collect()),
        INT32 => Data::I64(r.chunks_exact(4).map(|x| i32::from_le_bytes(b4(x)) as i64).collect()),
        UINT32 => Data::I64(r.chunks_exact(4).map(|x| u32::from_le_bytes(b4(x)) as i64).collect()),
        INT16 => Data::I64(r.chunks_exact(2).map(|x| b2(x) as i16 as i64).collect()),
        UINT16 => Data::I64(r.chunks_exact(2).map(|x| b2(x) as i64).collect()),
        INT8 => Data::I64(r.iter().map(|&x| x as i8 as i64).collect()),
        UINT8 => Data::I64(r.iter().map(|&x| x as i64).collect()),
        UINT64 => {
            Data::I64(r.chunks_exact(8).map(|x| u64_to_i64(u64::from_le_bytes(b8(x)))).collect::<Result<_, _>>()?)
        }
        BOOL => Data::Bool(r.iter().map(|&b| b != 0).collect()),
        c => return Err(format!("element type code {c} has no raw decoding")),
    })
}

/// The typed-field data of a tensor of type `c` (ONNX keeps every type of at most 32 bits,
/// f16/bf16 as their bit patterns, in `int32_data`; uint32/uint64 in `uint64_data`), as the
/// number of elements present and a decoder of them.
pub(crate) fn decode_fields(t: &tract_onnx::pb::TensorProto) -> Result<(usize, Data), String> {
    use code::*;
    let ints = &t.int32_data;
    Ok(match t.data_type {
        FLOAT => (t.float_data.len(), Data::F32(t.float_data.clone())),
        DOUBLE => (t.double_data.len(), Data::F32(t.double_data.iter().map(|&x| x as f32).collect())),
        INT64 => (t.int64_data.len(), Data::I64(t.int64_data.clone())),
        FLOAT16 => (ints.len(), Data::F32(ints.iter().map(|&x| f16::from_bits(x as u16).to_f32()).collect())),
        BFLOAT16 => (ints.len(), Data::F32(ints.iter().map(|&x| bf16::from_bits(x as u16).to_f32()).collect())),
        // The narrow types are stored widened; their values are read through the declared width.
        INT32 => (ints.len(), Data::I64(ints.iter().map(|&x| x as i64).collect())),
        INT16 => (ints.len(), Data::I64(ints.iter().map(|&x| x as i16 as i64).collect())),
        INT8 => (ints.len(), Data::I64(ints.iter().map(|&x| x as i8 as i64).collect())),
        UINT16 => (ints.len(), Data::I64(ints.iter().map(|&x| x as u16 as i64).collect())),
        UINT8 => (ints.len(), Data::I64(ints.iter().map(|&x| x as u8 as i64).collect())),
        BOOL => (ints.len(), Data::Bool(ints.iter().map(|&x| x != 0).collect())),
        UINT32 => (t.uint64_data.len(), Data::I64(t.uint64_data.iter().map(|&x| x as u32 as i64).collect())),
        UINT64 => {
            (t.uint64_data.len(), Data::I64(t.uint64_data.iter().map(|&x| u64_to_i64(x)).collect::<Result<_, _>>()?))
        }
        c => return Err(format!("element type code {c} has no field decoding")),
    })
}

/// Rounds `x` to the nearest value of ONNX float type `c` (ties to even), held as f32.
pub(crate) fn round_float(c: i32, x: f32) -> f32 {
    match c {
        code::FLOAT16 => f16::from_f32(x).to_f32(),
        code::BFLOAT16 => bf16::from_f32(x).to_f32(),
        _ => x,
    }
}

/// Wraps an integer to ONNX integer type `c`'s width (two's complement, as a C cast does).
fn wrap_int(c: i32, x: i64) -> i64 {
    use code::*;
    match c {
        INT8 => x as i8 as i64,
        UINT8 => x as u8 as i64,
        INT16 => x as i16 as i64,
        UINT16 => x as u16 as i64,
        INT32 => x as i32 as i64,
        UINT32 => x as u32 as i64,
        // uint64 values past i64::MAX cannot be held; a negative i64 stays as it is (what a
        // later cast back to a signed type gives).
        _ => x,
    }
}

/// `Cast(to = c)` of a constant, exactly as ONNX defines it, the result held in autopar's type:
/// floats to integers truncate toward zero (NaN to 0, out of range saturates) and then wrap to
/// the target width; integers wrap; casts to float16/bfloat16 round to that precision.
pub(crate) fn cast_constant(t: &Tensor, c: i32) -> Result<Tensor, String> {
    let to = held_as(c).ok_or_else(|| format!("Cast to {} is not supported", crate::dtype_name(c)))?;
    let data = match (t.data(), to) {
        (Data::F32(v), DType::F32) => Data::F32(v.iter().map(|&x| round_float(c, x)).collect()),
        (Data::F64(v), DType::F32) => Data::F32(v.iter().map(|&x| round_float(c, x as f32)).collect()),
        (Data::I64(v), DType::F32) => Data::F32(v.iter().map(|&x| round_float(c, x as f32)).collect()),
        (Data::Bool(v), DType::F32) => Data::F32(v.iter().map(|&x| if x { 1.0 } else { 0.0 }).collect()),
        (Data::F32(v), DType::I64) => Data::I64(v.iter().map(|&x| wrap_int(c, x as i64)).collect()),
        (Data::F64(v), DType::I64) => Data::I64(v.iter().map(|&x| wrap_int(c, x as i64)).collect()),
        (Data::I64(v), DType::I64) => Data::I64(v.iter().map(|&x| wrap_int(c, x)).collect()),
        (Data::Bool(v), DType::I64) => Data::I64(v.iter().map(|&x| x as i64).collect()),
        (Data::F32(v), _) => Data::Bool(v.iter().map(|&x| x != 0.0).collect()),
        (Data::F64(v), _) => Data::Bool(v.iter().map(|&x| x != 0.0).collect()),
        (Data::I64(v), _) => Data::Bool(v.iter().map(|&x| x != 0).collect()),
        (Data::Bool(v), _) => Data::Bool(v.clone()),
        (Data::BF16(_) | Data::F16(_), _) => return cast_constant(&t.clone().widened(), c),
    };
    Tensor::new(t.shape().to_vec(), data).map_err(|e| e.to_string())
}

/// True when a `Cast` to `c` of a computed value is not exact in autopar (a rounding to half
/// precision it does not perform).
pub(crate) fn cast_loses_rounding(c: i32) -> bool {
    matches!(c, code::FLOAT16 | code::BFLOAT16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_integer_type_is_held_exactly_as_i64() {
        let raw: Vec<u8> = vec![0xff, 0x7f, 0x80, 0x01];
        assert_eq!(decode_raw(code::INT8, &raw).unwrap(), Data::I64(vec![-1, 127, -128, 1]));
        assert_eq!(decode_raw(code::UINT8, &raw).unwrap(), Data::I64(vec![255, 127, 128, 1]));
        assert_eq!(decode_raw(code::INT16, &raw).unwrap(), Data::I64(vec![0x7fff, 0x0180]));
        assert_eq!(decode_raw(code::UINT16, &[0xff, 0xff]).unwrap(), Data::I64(vec![65535]));
        assert_eq!(decode_raw(code::INT32, &(-5i32).to_le_bytes()).unwrap(), Data::I64(vec![-5]));
        assert_eq!(decode_raw(code::UINT32, &u32::MAX.to_le_bytes()).unwrap(), Data::I64(vec![u32::MAX as i64]));
        assert_eq!(decode_raw(code::UINT64, &7u64.to_le_bytes()).unwrap(), Data::I64(vec![7]));
        assert!(decode_raw(code::UINT64, &u64::MAX.to_le_bytes()).unwrap_err().contains("does not fit"));
    }

    #[test]
    fn half_precision_widens_exactly() {
        // 1.5 in f16 is 0x3e00, in bf16 0x3fc0; the smallest f16 subnormal is 2^-24.
        assert_eq!(decode_raw(code::FLOAT16, &[0x00, 0x3e, 0x01, 0x00]).unwrap(), Data::F32(vec![1.5, 2f32.powi(-24)]));
        assert_eq!(decode_raw(code::BFLOAT16, &[0xc0, 0x3f]).unwrap(), Data::F32(vec![1.5]));
        assert_eq!(decode_raw(code::DOUBLE, &0.1f64.to_le_bytes()).unwrap(), Data::F32(vec![0.1]));
    }

    #[test]
    fn casts_of_constants_wrap_and_round_as_onnx_does() {
        let t = Tensor::i64(vec![3], vec![300, -1, 65537]);
        assert_eq!(cast_constant(&t, code::UINT8).unwrap().as_i64().unwrap(), &[44, 255, 1]);
        assert_eq!(cast_constant(&t, code::INT16).unwrap().as_i64().unwrap(), &[300, -1, 1]);
        let f = Tensor::f32(vec![4], vec![-2.7, 2.7, 1.0 + 1e-4, 1.0 / 3.0]);
        assert_eq!(cast_constant(&f, code::INT32).unwrap().as_i64().unwrap(), &[-2, 2, 1, 0]);
        // f16 has 10 fraction bits: 1 + 1e-4 rounds to 1, 1/3 to 0.333251953125.
        let h = cast_constant(&f, code::FLOAT16).unwrap();
        assert_eq!(h.to_f64_vec(), [-2.69921875, 2.69921875, 1.0, 0.333251953125]);
        // bf16 has 7: 1/3 rounds to 0.333984375.
        assert_eq!(cast_constant(&f, code::BFLOAT16).unwrap().to_f64_vec()[3], 0.333984375);
        assert_eq!(cast_constant(&f, code::BOOL).unwrap().as_bool().unwrap(), &[true, true, true, true]);
    }
}
