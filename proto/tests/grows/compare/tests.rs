//! The rules of `compare.rs` on small .proto files, compiled with protox as the release's
//! and the tree's are: each break is caught and named, each addition passes.

use super::*;

/// The descriptor set of one file, `test/v1/t.proto`, holding `body` in package `test.v1`.
fn compile(body: &str) -> FileDescriptorSet {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("test/v1/t.proto");
    std::fs::create_dir_all(path.parent().expect("a parent")).expect("create test/v1");
    std::fs::write(
        &path,
        format!("syntax = \"proto3\";\npackage test.v1;\n{body}"),
    )
    .expect("write t.proto");
    protox::compile(["test/v1/t.proto"], [dir.path()]).unwrap_or_else(|e| panic!("{e:?}\n{body}"))
}

/// The violations of `new` against `old`, as they are reported.
fn check(old: &str, new: &str) -> Vec<String> {
    violations(&compile(old), &compile(new))
        .iter()
        .map(ToString::to_string)
        .collect()
}

const MESSAGE: &str = "message M { string a = 1; string b = 2; }";

#[test]
fn the_same_proto_passes() {
    assert_eq!(check(MESSAGE, MESSAGE), Vec::<String>::new());
}

#[test]
fn a_removed_field_is_caught() {
    assert_eq!(
        check(MESSAGE, "message M { string a = 1; }"),
        ["test.v1.M.b (field 2): removed without reserving its number and name"]
    );
}

#[test]
fn a_removed_field_reserved_by_number_and_name_passes() {
    let new = "message M { string a = 1; reserved 2; reserved \"b\"; }";
    assert_eq!(check(MESSAGE, new), Vec::<String>::new());
}

#[test]
fn a_removed_field_reserved_by_only_one_of_number_and_name_is_caught() {
    assert_eq!(
        check(MESSAGE, "message M { string a = 1; reserved 2; }"),
        ["test.v1.M.b (field 2): removed without reserving its name"]
    );
    assert_eq!(
        check(MESSAGE, "message M { string a = 1; reserved \"b\"; }"),
        ["test.v1.M.b (field 2): removed without reserving its number"]
    );
}

#[test]
fn a_renumbered_field_is_caught() {
    assert_eq!(
        check(MESSAGE, "message M { string a = 1; string b = 3; }"),
        ["test.v1.M.b (field 2): renumbered to 3"]
    );
}

#[test]
fn a_renamed_field_is_caught() {
    assert_eq!(
        check(MESSAGE, "message M { string a = 1; string c = 2; }"),
        [
            "test.v1.M.b (field 2): renamed to c",
            "test.v1.M.b (field 2): JSON name changed from b to c",
        ]
    );
}

#[test]
fn a_retyped_field_is_caught() {
    assert_eq!(
        check(MESSAGE, "message M { string a = 1; bytes b = 2; }"),
        ["test.v1.M.b (field 2): type changed from string to bytes"]
    );
    let old = "message M { N n = 1; } message N {} message O {}";
    assert_eq!(
        check(old, "message M { O n = 1; } message N {} message O {}"),
        ["test.v1.M.n (field 1): type changed from test.v1.N to test.v1.O"]
    );
}

#[test]
fn a_changed_label_is_caught() {
    assert_eq!(
        check(
            MESSAGE,
            "message M { string a = 1; repeated string b = 2; }"
        ),
        ["test.v1.M.b (field 2): label changed from no label to repeated"]
    );
    assert_eq!(
        check(
            MESSAGE,
            "message M { string a = 1; optional string b = 2; }"
        ),
        ["test.v1.M.b (field 2): label changed from no label to optional"]
    );
    let old = "message M { optional uint64 a = 1; }";
    assert_eq!(
        check(old, "message M { uint64 a = 1; }"),
        ["test.v1.M.a (field 1): label changed from optional to no label"]
    );
}

#[test]
fn a_changed_json_name_is_caught() {
    assert_eq!(
        check(
            MESSAGE,
            "message M { string a = 1; string b = 2 [json_name = \"bee\"]; }"
        ),
        ["test.v1.M.b (field 2): JSON name changed from b to bee"]
    );
}

#[test]
fn a_field_moved_into_or_out_of_a_oneof_is_caught() {
    let in_oneof = "message M { string a = 1; oneof kind { string b = 2; } }";
    assert_eq!(
        check(MESSAGE, in_oneof),
        ["test.v1.M.b (field 2): oneof changed from no oneof to kind"]
    );
    assert_eq!(
        check(in_oneof, MESSAGE),
        ["test.v1.M.b (field 2): oneof changed from kind to no oneof"]
    );
    let other_oneof = "message M { string a = 1; oneof other { string b = 2; } }";
    assert_eq!(
        check(in_oneof, other_oneof),
        ["test.v1.M.b (field 2): oneof changed from kind to other"]
    );
}

#[test]
fn a_reserved_number_or_name_used_again_is_caught() {
    let old = "message M { string a = 1; reserved 2, 5 to 7; reserved \"b\"; }";
    assert_eq!(
        check(
            old,
            "message M { string a = 1; string c = 2; reserved 5 to 7; reserved \"b\"; }"
        ),
        ["test.v1.M.c (field 2): uses number 2, which the release reserved"]
    );
    assert_eq!(
        check(
            old,
            "message M { string a = 1; string b = 3; reserved 2, 5 to 7; }"
        ),
        ["test.v1.M.b (field 3): uses name b, which the release reserved"]
    );
    assert_eq!(
        check(
            old,
            "message M { string a = 1; int32 c = 6; reserved 2, 5, 7; reserved \"b\"; }"
        ),
        ["test.v1.M.c (field 6): uses number 6, which the release reserved"]
    );
}

#[test]
fn a_dropped_reservation_is_caught() {
    let old = "message M { string a = 1; reserved 2, 5 to 7; reserved \"b\"; }";
    assert_eq!(
        check(old, "message M { string a = 1; reserved 2, 5; }"),
        [
            "test.v1.M: numbers 6 to 7 are no longer reserved",
            "test.v1.M: name b is no longer reserved",
        ]
    );
}

#[test]
fn reservations_may_be_rearranged_and_grown() {
    let old = "message M { string a = 1; reserved 2, 5 to 7; reserved \"b\"; }";
    let new =
        "message M { string a = 1; reserved 2 to 3, 4 to 6, 7 to max; reserved \"b\", \"z\"; }";
    assert_eq!(check(old, new), Vec::<String>::new());
}

#[test]
fn a_removed_message_or_enum_is_caught_nested_ones_too() {
    let old = "message M { message Inner { string x = 1; } enum E { E_UNSPECIFIED = 0; } } \
               message Gone {} enum Level { LEVEL_UNSPECIFIED = 0; }";
    assert_eq!(
        check(old, "message M {}"),
        [
            "test.v1.Gone: message removed",
            "test.v1.M.Inner: message removed",
            "test.v1.Level: enum removed",
            "test.v1.M.E: enum removed",
        ]
    );
}

const ENUM: &str = "enum Level { LEVEL_UNSPECIFIED = 0; LEVEL_LOW = 1; LEVEL_HIGH = 2; }";

#[test]
fn a_removed_enum_value_is_caught() {
    assert_eq!(
        check(ENUM, "enum Level { LEVEL_UNSPECIFIED = 0; LEVEL_LOW = 1; }"),
        ["test.v1.Level.LEVEL_HIGH (value 2): removed without reserving its number and name"]
    );
}

#[test]
fn a_removed_enum_value_reserved_by_number_and_name_passes() {
    let new = "enum Level { LEVEL_UNSPECIFIED = 0; LEVEL_LOW = 1; \
               reserved 2; reserved \"LEVEL_HIGH\"; }";
    assert_eq!(check(ENUM, new), Vec::<String>::new());
}

#[test]
fn a_renamed_or_renumbered_enum_value_is_caught() {
    assert_eq!(
        check(
            ENUM,
            "enum Level { LEVEL_UNSPECIFIED = 0; LEVEL_LOW = 1; LEVEL_TOP = 2; }"
        ),
        ["test.v1.Level.LEVEL_HIGH (value 2): renamed to LEVEL_TOP"]
    );
    assert_eq!(
        check(
            ENUM,
            "enum Level { LEVEL_UNSPECIFIED = 0; LEVEL_LOW = 1; LEVEL_HIGH = 3; }"
        ),
        ["test.v1.Level.LEVEL_HIGH (value 2): renumbered to 3"]
    );
}

#[test]
fn a_reserved_enum_number_used_again_is_caught() {
    // An enum's reserved ranges end inclusively: 2 to 3 reserves 3.
    let old = "enum Level { LEVEL_UNSPECIFIED = 0; reserved 2 to 3; }";
    assert_eq!(
        check(
            old,
            "enum Level { LEVEL_UNSPECIFIED = 0; LEVEL_MID = 3; reserved 2; }"
        ),
        ["test.v1.Level.LEVEL_MID (value 3): uses number 3, which the release reserved"]
    );
}

const SERVICE: &str = "message Req {} message Resp {} \
    service S { rpc Get(Req) returns (Resp); rpc Watch(Req) returns (stream Resp); }";

#[test]
fn a_removed_rpc_or_service_is_caught() {
    let new = "message Req {} message Resp {} service S { rpc Get(Req) returns (Resp); }";
    assert_eq!(check(SERVICE, new), ["test.v1.S.Watch: RPC removed"]);
    assert_eq!(
        check(SERVICE, "message Req {} message Resp {}"),
        ["test.v1.S: service removed"]
    );
}

#[test]
fn a_changed_streaming_flag_is_caught() {
    let new = "message Req {} message Resp {} service S { \
               rpc Get(stream Req) returns (Resp); rpc Watch(Req) returns (Resp); }";
    assert_eq!(
        check(SERVICE, new),
        [
            "test.v1.S.Get: client streaming changed from single to stream",
            "test.v1.S.Watch: server streaming changed from stream to single",
        ]
    );
}

#[test]
fn a_changed_request_or_response_type_is_caught() {
    let new = "message Req {} message Resp {} message Other {} service S { \
               rpc Get(Other) returns (Resp); rpc Watch(Req) returns (stream Other); }";
    assert_eq!(
        check(SERVICE, new),
        [
            "test.v1.S.Get: input type changed from test.v1.Req to test.v1.Other",
            "test.v1.S.Watch: output type changed from test.v1.Resp to test.v1.Other",
        ]
    );
}

#[test]
fn additions_pass() {
    let old = format!("{MESSAGE} {ENUM} {SERVICE}");
    let new = "message M { string a = 1; string b = 2; optional int64 c = 3; \
                 oneof kind { string d = 4; } message Inner {} } \
               message Added { repeated string x = 1; map<string, string> y = 2; } \
               enum Level { LEVEL_UNSPECIFIED = 0; LEVEL_LOW = 1; LEVEL_HIGH = 2; LEVEL_MAX = 3; } \
               enum Added2 { ADDED2_UNSPECIFIED = 0; } \
               message Req {} message Resp {} \
               service S { rpc Get(Req) returns (Resp); rpc Watch(Req) returns (stream Resp); \
                           rpc Put(stream Req) returns (Resp); } \
               service T { rpc Get(Req) returns (Resp); }";
    assert_eq!(check(&old, new), Vec::<String>::new());
}

#[test]
fn every_break_is_reported_not_only_the_first() {
    let old = format!("{MESSAGE} {ENUM} {SERVICE}");
    let new = "message M { bytes a = 1; } enum Level { LEVEL_UNSPECIFIED = 0; } \
               message Req {} message Resp {} service S {}";
    assert_eq!(
        check(&old, new),
        [
            "test.v1.M.a (field 1): type changed from string to bytes",
            "test.v1.M.b (field 2): removed without reserving its number and name",
            "test.v1.Level.LEVEL_LOW (value 1): removed without reserving its number and name",
            "test.v1.Level.LEVEL_HIGH (value 2): removed without reserving its number and name",
            "test.v1.S.Get: RPC removed",
            "test.v1.S.Watch: RPC removed",
        ]
    );
}
