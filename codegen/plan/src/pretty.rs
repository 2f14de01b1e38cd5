//! The plan's JSON layout: indented like `serde_json::to_string_pretty`, except that an array
//! holding only numbers, strings, flags or nulls stays on one line (`"shape": [2, 16, 64]`), so
//! shapes, value lists and specs read as they are written and a plan is a third of the size.

use std::io::{self, Write};

use serde::Serialize;
use serde_json::ser::{CharEscape, CompactFormatter, Formatter};

/// One open array: whether it has an element yet, and whether it went multi-line.
struct Array {
    first: bool,
    broken: bool,
}

#[derive(Default)]
struct Layout {
    indent: usize,
    /// Open arrays, innermost last; an object pushes `None`.
    open: Vec<Option<Array>>,
    /// Whether each open object has a key yet, innermost last.
    keys: Vec<bool>,
    /// An array element has begun but nothing of it is written yet.
    pending: bool,
}

impl Layout {
    fn newline<W: ?Sized + Write>(&self, w: &mut W) -> io::Result<()> {
        w.write_all(b"\n")?;
        for _ in 0..self.indent {
            w.write_all(b"  ")?;
        }
        Ok(())
    }

    /// Before a scalar: an array element written inline.
    fn scalar<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
        if std::mem::take(&mut self.pending)
            && let Some(Some(a)) = self.open.last_mut()
        {
            if a.broken {
                self.newline(w)?;
            } else if !a.first {
                w.write_all(b", ")?;
            }
        }
        Ok(())
    }

    /// Before an object or array: an array element on a line of its own, which breaks the
    /// array it is in.
    fn container<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
        if std::mem::take(&mut self.pending)
            && let Some(Some(a)) = self.open.last_mut()
        {
            if !a.first && !a.broken {
                w.write_all(b",")?;
            }
            a.broken = true;
            self.newline(w)?;
        }
        Ok(())
    }
}

macro_rules! scalars {
    ($($name:ident($t:ty)),* $(,)?) => {
        $(fn $name<W: ?Sized + Write>(&mut self, w: &mut W, v: $t) -> io::Result<()> {
            self.scalar(w)?;
            CompactFormatter.$name(w, v)
        })*
    };
}

impl Formatter for Layout {
    scalars!(
        write_bool(bool),
        write_i8(i8),
        write_i16(i16),
        write_i32(i32),
        write_i64(i64),
        write_i128(i128),
        write_u8(u8),
        write_u16(u16),
        write_u32(u32),
        write_u64(u64),
        write_u128(u128),
        write_f32(f32),
        write_f64(f64),
        write_number_str(&str),
        write_raw_fragment(&str),
    );

    fn write_null<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.scalar(w)?;
        w.write_all(b"null")
    }

    fn begin_string<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.scalar(w)?;
        w.write_all(b"\"")
    }

    fn write_char_escape<W: ?Sized + Write>(&mut self, w: &mut W, c: CharEscape) -> io::Result<()> {
        CompactFormatter.write_char_escape(w, c)
    }

    fn begin_array<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.container(w)?;
        self.indent += 1;
        self.open.push(Some(Array { first: true, broken: false }));
        w.write_all(b"[")
    }

    fn end_array<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.indent -= 1;
        if let Some(Some(a)) = self.open.pop()
            && a.broken
        {
            self.newline(w)?;
        }
        w.write_all(b"]")
    }

    fn begin_array_value<W: ?Sized + Write>(&mut self, w: &mut W, first: bool) -> io::Result<()> {
        if let Some(Some(a)) = self.open.last_mut() {
            a.first = first;
            // A broken array separates here; an inline one when the element is written.
            if a.broken && !first {
                w.write_all(b",")?;
            }
        }
        self.pending = true;
        Ok(())
    }

    fn end_array_value<W: ?Sized + Write>(&mut self, _w: &mut W) -> io::Result<()> {
        Ok(())
    }

    fn begin_object<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.container(w)?;
        self.indent += 1;
        self.open.push(None);
        self.keys.push(false);
        w.write_all(b"{")
    }

    fn end_object<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.indent -= 1;
        self.open.pop();
        if self.keys.pop().unwrap_or(false) {
            self.newline(w)?;
        }
        w.write_all(b"}")
    }

    fn begin_object_key<W: ?Sized + Write>(&mut self, w: &mut W, first: bool) -> io::Result<()> {
        if !first {
            w.write_all(b",")?;
        }
        if let Some(k) = self.keys.last_mut() {
            *k = true;
        }
        self.newline(w)
    }

    fn begin_object_value<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
        w.write_all(b": ")
    }
}

/// `value` as JSON in the plan's layout (see the module docs).
pub(crate) fn to_string<T: Serialize>(value: &T) -> serde_json::Result<String> {
    let mut out = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(&mut out, Layout::default());
    value.serialize(&mut ser)?;
    Ok(String::from_utf8(out).expect("serde_json writes UTF-8"))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    #[test]
    fn flat_arrays_stay_on_one_line() {
        let v = json!({"a": [1, 2, 3], "b": [[2, 16], [4]], "c": [{"x": "y"}, [1]], "d": [], "e": {}});
        let s = super::to_string(&v).unwrap();
        assert_eq!(
            s,
            "{\n  \"a\": [1, 2, 3],\n  \"b\": [\n    [2, 16],\n    [4]\n  ],\n  \"c\": [\n    {\n      \"x\": \"y\"\n    },\n    [1]\n  ],\n  \"d\": [],\n  \"e\": {}\n}"
        );
        let back: serde_json::Value = serde_json::from_str(&s).unwrap();
        assert_eq!(back, v);
    }
}
