//! Typed references to the values of a program: what an instruction reads, writes and frees.

use std::fmt;
use std::str::FromStr;

use ir::{NodeIndex, Value};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A value of the SPMD program: output `slot` of graph node `node`, or converted copy `copy` of
/// it (a layout conversion's result).
///
/// In JSON it is its text form, with exactly one spelling per value: `%node` (slot 0),
/// `%node.slot`, and `@copy` after either for a converted copy (`%12`, `%12.1`, `%12@3`). No
/// leading zeros and no `.0`, so two spellings never name one value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ValueRef {
    /// Program node id (`%node` in the plan's graph).
    pub node: usize,
    /// Output slot of the node.
    pub slot: usize,
    /// Which converted copy (`None`: the value as its node wrote it).
    pub copy: Option<usize>,
}

impl ValueRef {
    /// Output `slot` of node `node`, as written.
    pub fn new(node: usize, slot: usize) -> ValueRef {
        ValueRef { node, slot, copy: None }
    }

    /// The graph value, as written.
    pub fn of(v: Value) -> ValueRef {
        ValueRef::new(v.node.index(), v.slot)
    }

    /// Converted copy `k` of this value.
    pub fn with_copy(self, k: usize) -> ValueRef {
        ValueRef { copy: Some(k), ..self }
    }

    /// The graph value this refers to (a copy refers to the value it converts).
    pub fn value(self) -> Value {
        Value::new(NodeIndex::new(self.node), self.slot)
    }

    /// The value as written (without the copy).
    pub fn base(self) -> ValueRef {
        ValueRef { copy: None, ..self }
    }
}

impl From<Value> for ValueRef {
    fn from(v: Value) -> ValueRef {
        ValueRef::of(v)
    }
}

impl fmt::Display for ValueRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "%{}", self.node)?;
        if self.slot != 0 {
            write!(f, ".{}", self.slot)?;
        }
        if let Some(k) = self.copy {
            write!(f, "@{k}")?;
        }
        Ok(())
    }
}

/// Why a text is not a value reference.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not a value id (%N, %N.S, %N@K)")]
pub struct BadValueRef(pub String);

impl FromStr for ValueRef {
    type Err = BadValueRef;
    fn from_str(id: &str) -> Result<ValueRef, BadValueRef> {
        let bad = || BadValueRef(id.to_string());
        let num = |s: &str| -> Option<usize> {
            let ok = !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) && (s == "0" || !s.starts_with('0'));
            if ok { s.parse().ok() } else { None }
        };
        let (base, copy) = match id.split_once('@') {
            Some((b, c)) => (b, Some(num(c).ok_or_else(bad)?)),
            None => (id, None),
        };
        let base = base.strip_prefix('%').ok_or_else(bad)?;
        let (node, slot) = match base.split_once('.') {
            // `%5.0` is spelled `%5`.
            Some((n, s)) => (num(n).ok_or_else(bad)?, num(s).filter(|&s| s != 0).ok_or_else(bad)?),
            None => (num(base).ok_or_else(bad)?, 0),
        };
        Ok(ValueRef { node, slot, copy })
    }
}

impl Serialize for ValueRef {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ValueRef {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<ValueRef, D::Error> {
        let s = std::borrow::Cow::<str>::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

impl schemars::JsonSchema for ValueRef {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "ValueRef".into()
    }
    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "type": "string",
            "description": "A value of the program: `%node` (output 0 of a graph node), `%node.slot` (another output), with `@copy` for a converted copy (a layout conversion's result).",
            "pattern": "^%(0|[1-9][0-9]*)(\\.[1-9][0-9]*)?(@(0|[1-9][0-9]*))?$"
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn value_ids_have_one_spelling() {
        assert_eq!("%5".parse(), Ok(ValueRef::new(5, 0)));
        assert_eq!("%5.2@17".parse(), Ok(ValueRef::new(5, 2).with_copy(17)));
        assert_eq!("%0@0".parse(), Ok(ValueRef::new(0, 0).with_copy(0)));
        for bad in ["5", "%", "%05", "%5.0", "%+5", "%5.", "%5@", "%5@x", "%5@01", "%-1", "%5.1.2", " %5", ""] {
            assert!(bad.parse::<ValueRef>().is_err(), "{bad}");
        }
        for v in [ValueRef::new(0, 0), ValueRef::new(12, 1), ValueRef::new(3, 0).with_copy(9)] {
            assert_eq!(v.to_string().parse(), Ok(v));
            let json = serde_json::to_string(&v).unwrap();
            assert_eq!(serde_json::from_str::<ValueRef>(&json).unwrap(), v);
        }
    }
}
