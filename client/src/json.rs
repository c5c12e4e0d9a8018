//! Conversion between `google.protobuf.Struct` (how the log stores tool inputs) and JSON
//! (how providers and tools speak). Whole numbers come back as JSON integers, so an input
//! like `{"timeout_ms": 5000}` round-trips as the model wrote it.

use prost_types::{value::Kind, ListValue, Struct, Value};
use serde_json::{Map, Number};

/// A JSON object as a `Struct`.
pub fn object_to_struct(object: Map<String, serde_json::Value>) -> Struct {
    Struct {
        fields: object
            .into_iter()
            .map(|(key, value)| (key, json_to_value(value)))
            .collect(),
    }
}

/// A `Struct` as a JSON object; `None` (no input) is the empty object.
pub fn struct_to_object(input: Option<&Struct>) -> Map<String, serde_json::Value> {
    input
        .map(|s| {
            s.fields
                .iter()
                .map(|(key, value)| (key.clone(), value_to_json(value)))
                .collect()
        })
        .unwrap_or_default()
}

fn json_to_value(value: serde_json::Value) -> Value {
    let kind = match value {
        serde_json::Value::Null => Kind::NullValue(0),
        serde_json::Value::Bool(b) => Kind::BoolValue(b),
        // Struct numbers are doubles: integers beyond 2^53 lose precision, as in protobuf's
        // own JSON mapping.
        serde_json::Value::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or(0.0)),
        serde_json::Value::String(s) => Kind::StringValue(s),
        serde_json::Value::Array(items) => Kind::ListValue(ListValue {
            values: items.into_iter().map(json_to_value).collect(),
        }),
        serde_json::Value::Object(object) => Kind::StructValue(object_to_struct(object)),
    };
    Value { kind: Some(kind) }
}

fn value_to_json(value: &Value) -> serde_json::Value {
    match &value.kind {
        None | Some(Kind::NullValue(_)) => serde_json::Value::Null,
        Some(Kind::BoolValue(b)) => serde_json::Value::Bool(*b),
        Some(Kind::NumberValue(n)) => number_to_json(*n),
        Some(Kind::StringValue(s)) => serde_json::Value::String(s.clone()),
        Some(Kind::ListValue(list)) => {
            serde_json::Value::Array(list.values.iter().map(value_to_json).collect())
        }
        Some(Kind::StructValue(s)) => serde_json::Value::Object(struct_to_object(Some(s))),
    }
}

fn number_to_json(n: f64) -> serde_json::Value {
    const EXACT: f64 = 9_007_199_254_740_992.0; // 2^53: every whole double below is exact
    if n.fract() == 0.0 && n.abs() <= EXACT {
        serde_json::Value::Number(Number::from(n as i64))
    } else {
        Number::from_f64(n).map_or(serde_json::Value::Null, serde_json::Value::Number)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn objects_round_trip_with_integers_intact() {
        let json = serde_json::json!({
            "command": "echo hi",
            "timeout_ms": 5000,
            "ratio": 0.5,
            "flags": [true, null, {"deep": -3}],
        });
        let serde_json::Value::Object(object) = json.clone() else {
            unreachable!()
        };
        let back = struct_to_object(Some(&object_to_struct(object)));
        assert_eq!(serde_json::Value::Object(back), json);
        assert_eq!(
            serde_json::to_string(&struct_to_object(None))
                .ok()
                .as_deref(),
            Some("{}")
        );
    }
}
