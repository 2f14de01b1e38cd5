//! Running the binary under caps, and building small ONNX models.
#![allow(dead_code)] // each hostile module uses a subset

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Virtual memory cap for every run (KiB for `ulimit -v`): far below what the crafted inputs ask
/// for, far above what a clean error needs.
pub const MEMORY_CAP_KIB: u64 = 4 << 20;
/// Wall-clock cap for every run.
pub const TIME_CAP: Duration = Duration::from_secs(60);

pub fn data(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data").join(rel)
}

pub fn model(name: &str) -> String {
    data("models").join(name).display().to_string()
}

pub fn tempdir() -> tempfile::TempDir {
    tempfile::tempdir().expect("creating a temporary directory")
}

/// Runs `autopar args` under [`MEMORY_CAP_KIB`] and [`TIME_CAP`] (killed past it; the test then
/// fails), in `dir` when given.
pub fn autopar_in(dir: Option<&Path>, args: &[&str]) -> Output {
    let mut cmd = Command::new("sh");
    cmd.arg("-c")
        .arg(format!("ulimit -v {MEMORY_CAP_KIB} && exec \"$0\" \"$@\""))
        .arg(env!("CARGO_BIN_EXE_autopar"))
        .args(args)
        .env_remove("AUTOPAR_LOG")
        .env("RUST_BACKTRACE", "0")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(d) = dir {
        cmd.current_dir(d);
    }
    let mut child = cmd.spawn().expect("running the autopar binary");
    // Drain the pipes on threads so a chatty child cannot block on a full pipe.
    let mut so = child.stdout.take().unwrap();
    let mut se = child.stderr.take().unwrap();
    let to = std::thread::spawn(move || {
        let mut v = Vec::new();
        so.read_to_end(&mut v).ok();
        v
    });
    let te = std::thread::spawn(move || {
        let mut v = Vec::new();
        se.read_to_end(&mut v).ok();
        v
    });
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().expect("waiting for autopar") {
            break s;
        }
        if start.elapsed() > TIME_CAP {
            child.kill().ok();
            child.wait().ok();
            panic!("autopar {} ran past the time cap of {:?}", args.join(" "), TIME_CAP);
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    Output { status, stdout: to.join().unwrap(), stderr: te.join().unwrap() }
}

pub fn autopar(args: &[&str]) -> Output {
    autopar_in(None, args)
}

pub fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Asserts a success under the caps and returns stdout.
pub fn ok_in(dir: Option<&Path>, args: &[&str]) -> String {
    let out = autopar_in(dir, args);
    assert!(out.status.success(), "autopar {} failed ({}):\n{}", args.join(" "), out.status, stderr(&out));
    stdout(&out)
}

pub fn ok(args: &[&str]) -> String {
    ok_in(None, args)
}

/// Asserts a clean failure under the caps: non-zero exit, one `error:` line on stderr containing
/// every phrase, no panic, no signal (an abort on a failed allocation is a signal). Returns the
/// line.
pub fn fails_in(dir: Option<&Path>, args: &[&str], phrases: &[&str]) -> String {
    let out = autopar_in(dir, args);
    let err = stderr(&out);
    let cmd = format!("autopar {}", args.join(" "));
    assert!(!out.status.success(), "{cmd} succeeded; stdout:\n{}\nstderr:\n{err}", stdout(&out));
    assert!(out.status.code().is_some(), "{cmd} was killed by a signal ({}):\n{err}", out.status);
    assert!(!err.contains("panicked"), "{cmd} panicked:\n{err}");
    let lines: Vec<&str> = err.lines().filter(|l| !l.starts_with("warning:")).collect();
    assert_eq!(lines.len(), 1, "{cmd}: expected one error line on stderr, got:\n{err}");
    assert!(lines[0].starts_with("error: "), "{cmd}: stderr does not start with `error: `: {err}");
    for p in phrases {
        assert!(lines[0].contains(p), "{cmd}: the error does not mention `{p}`: {err}");
    }
    lines[0].to_string()
}

pub fn fails(args: &[&str], phrases: &[&str]) -> String {
    fails_in(None, args, phrases)
}

pub mod onnx {
    //! Small ONNX models from tract-onnx's protobuf types, encoded with prost.

    use prost::Message;
    pub use tract_onnx::pb;
    pub use tract_onnx::pb::tensor_proto::DataType;
    use tract_onnx::pb::tensor_shape_proto::{Dimension, dimension};

    pub fn value_info(name: &str, elem: DataType, dims: &[i64]) -> pb::ValueInfoProto {
        let dim = dims
            .iter()
            .map(|&d| Dimension { value: Some(dimension::Value::DimValue(d)), ..Default::default() })
            .collect();
        pb::ValueInfoProto {
            name: name.into(),
            r#type: Some(pb::TypeProto {
                value: Some(pb::type_proto::Value::TensorType(pb::type_proto::Tensor {
                    elem_type: elem as i32,
                    shape: Some(pb::TensorShapeProto { dim }),
                })),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    pub fn node(name: &str, op_type: &str, inputs: &[&str], outputs: &[&str]) -> pb::NodeProto {
        pb::NodeProto {
            name: name.into(),
            op_type: op_type.into(),
            input: inputs.iter().map(|s| s.to_string()).collect(),
            output: outputs.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }
    }

    pub fn attr_ints(name: &str, v: &[i64]) -> pb::AttributeProto {
        pb::AttributeProto {
            name: name.into(),
            r#type: pb::attribute_proto::AttributeType::Ints as i32,
            ints: v.to_vec(),
            ..Default::default()
        }
    }

    pub fn attr_int(name: &str, v: i64) -> pb::AttributeProto {
        pb::AttributeProto {
            name: name.into(),
            r#type: pb::attribute_proto::AttributeType::Int as i32,
            i: v,
            ..Default::default()
        }
    }

    /// An int64 initializer.
    pub fn ints(name: &str, dims: &[i64], v: &[i64]) -> pb::TensorProto {
        pb::TensorProto {
            name: name.into(),
            dims: dims.to_vec(),
            data_type: DataType::Int64 as i32,
            int64_data: v.to_vec(),
            ..Default::default()
        }
    }

    /// An f32 initializer.
    pub fn floats(name: &str, dims: &[i64], v: &[f32]) -> pb::TensorProto {
        pb::TensorProto {
            name: name.into(),
            dims: dims.to_vec(),
            data_type: DataType::Float as i32,
            float_data: v.to_vec(),
            ..Default::default()
        }
    }

    /// A model (ONNX IR version 8, opset 17) with one graph, encoded.
    pub fn model(
        nodes: Vec<pb::NodeProto>,
        initializer: Vec<pb::TensorProto>,
        inputs: Vec<pb::ValueInfoProto>,
        outputs: Vec<pb::ValueInfoProto>,
    ) -> Vec<u8> {
        let m = pb::ModelProto {
            ir_version: 8,
            opset_import: vec![pb::OperatorSetIdProto { domain: String::new(), version: 17 }],
            producer_name: "autopar-hostile-tests".into(),
            graph: Some(pb::GraphProto {
                name: "hostile".into(),
                node: nodes,
                initializer,
                input: inputs,
                output: outputs,
                ..Default::default()
            }),
            ..Default::default()
        };
        m.encode_to_vec()
    }
}
