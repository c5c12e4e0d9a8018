//! Whether one proto only grows from another, judged from their descriptor sets.
//!
//! [`violations`] lists everything of the old set that the new one breaks, each named in
//! proto terms (`agentlog.v1.ToolResult.content (field 2): type changed from string to
//! bytes`); an empty list means the new set only grows. The rules:
//! - every message, enum and service of the old set (by full name, nested ones too) is in
//!   the new one;
//! - every field keeps its number, name, JSON name, type, label and oneof; every enum
//!   value its number and name; every RPC its request and response types and streaming;
//! - a field or enum value that leaves has its number and its name reserved in the new set;
//! - what the old set reserved stays reserved: no number or name of it is used again.
//!
//! Adding (fields, values, messages, enums, services, RPCs, reservations) is always allowed.

use std::collections::BTreeMap;
use std::fmt;

use prost_types::field_descriptor_proto::{Label, Type};
use prost_types::{
    DescriptorProto, EnumDescriptorProto, FieldDescriptorProto, FileDescriptorSet,
    ServiceDescriptorProto,
};

/// One way the new set breaks the old one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// The element of the old set, e.g. `agentlog.v1.Event.seq (field 2)`.
    pub element: String,
    /// What happened to it, e.g. `removed without reserving its name`.
    pub problem: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.element, self.problem)
    }
}

/// Everything of `old` that `new` removes, renames, renumbers, retypes or reuses, in the
/// order of the old set's full names.
pub fn violations(old: &FileDescriptorSet, new: &FileDescriptorSet) -> Vec<Violation> {
    let (old, new) = (Elements::of(old), Elements::of(new));
    let mut found = Vec::new();
    for (name, old_message) in &old.messages {
        match new.messages.get(name) {
            Some(new_message) => compare_messages(name, old_message, new_message, &mut found),
            None => found.push(violation(name, "message removed")),
        }
    }
    for (name, old_enum) in &old.enums {
        match new.enums.get(name) {
            Some(new_enum) => compare_enums(name, old_enum, new_enum, &mut found),
            None => found.push(violation(name, "enum removed")),
        }
    }
    for (name, old_service) in &old.services {
        match new.services.get(name) {
            Some(new_service) => compare_services(name, old_service, new_service, &mut found),
            None => found.push(violation(name, "service removed")),
        }
    }
    found
}

fn violation(element: impl Into<String>, problem: impl Into<String>) -> Violation {
    Violation {
        element: element.into(),
        problem: problem.into(),
    }
}

/// A descriptor set's messages, enums and services by full name (without the leading dot).
struct Elements<'a> {
    messages: BTreeMap<String, Message<'a>>,
    enums: BTreeMap<String, &'a EnumDescriptorProto>,
    services: BTreeMap<String, &'a ServiceDescriptorProto>,
}

/// A message and whether its file is proto2, where a field with no label has presence.
struct Message<'a> {
    descriptor: &'a DescriptorProto,
    proto2: bool,
}

impl<'a> Elements<'a> {
    fn of(set: &'a FileDescriptorSet) -> Self {
        let mut elements = Elements {
            messages: BTreeMap::new(),
            enums: BTreeMap::new(),
            services: BTreeMap::new(),
        };
        for file in &set.file {
            let proto2 = matches!(file.syntax(), "" | "proto2");
            let package = file.package();
            for message in &file.message_type {
                elements.add_message(package, message, proto2);
            }
            for enumeration in &file.enum_type {
                elements
                    .enums
                    .insert(qualified(package, enumeration.name()), enumeration);
            }
            for service in &file.service {
                elements
                    .services
                    .insert(qualified(package, service.name()), service);
            }
        }
        elements
    }

    fn add_message(&mut self, scope: &str, message: &'a DescriptorProto, proto2: bool) {
        let name = qualified(scope, message.name());
        for nested in &message.nested_type {
            self.add_message(&name, nested, proto2);
        }
        for enumeration in &message.enum_type {
            self.enums
                .insert(qualified(&name, enumeration.name()), enumeration);
        }
        self.messages.insert(
            name,
            Message {
                descriptor: message,
                proto2,
            },
        );
    }
}

fn qualified(scope: &str, name: &str) -> String {
    if scope.is_empty() {
        name.to_owned()
    } else {
        format!("{scope}.{name}")
    }
}

fn compare_messages(name: &str, old: &Message, new: &Message, found: &mut Vec<Violation>) {
    let old_members = members(old.descriptor.field.iter().map(|f| (f.name(), f.number())));
    let new_members = members(new.descriptor.field.iter().map(|f| (f.name(), f.number())));
    let new_reserved = Reserved::of_message(new.descriptor);
    for (old_field, old_member) in old.descriptor.field.iter().zip(&old_members) {
        let element = format!("{name}.{} (field {})", old_member.name, old_member.number);
        match fate(old_member, &new_members) {
            Fate::Kept(index) => compare_fields(
                &element,
                old_field,
                old,
                &new.descriptor.field[index],
                new,
                found,
            ),
            Fate::Renamed(index) => {
                let new_field = &new.descriptor.field[index];
                found.push(violation(
                    &element,
                    format!("renamed to {}", new_field.name()),
                ));
                compare_fields(&element, old_field, old, new_field, new, found);
            }
            Fate::Renumbered(number) => {
                found.push(violation(element, format!("renumbered to {number}")))
            }
            Fate::Removed => check_removal(element, old_member, &new_reserved, found),
        }
    }
    check_reservations_kept(
        name,
        "field",
        &Reserved::of_message(old.descriptor),
        &new_reserved,
        &new_members,
        found,
    );
}

fn compare_fields(
    element: &str,
    old: &FieldDescriptorProto,
    old_message: &Message,
    new: &FieldDescriptorProto,
    new_message: &Message,
    found: &mut Vec<Violation>,
) {
    let mut changed = |what: &str, before: String, after: String| {
        if before != after {
            found.push(violation(
                element,
                format!("{what} changed from {before} to {after}"),
            ));
        }
    };
    changed("type", type_of(old), type_of(new));
    changed(
        "label",
        label_of(old, old_message.proto2),
        label_of(new, new_message.proto2),
    );
    changed(
        "oneof",
        oneof_of(old, old_message.descriptor),
        oneof_of(new, new_message.descriptor),
    );
    // The JSON mapping (the export format) names fields by it.
    changed(
        "JSON name",
        old.json_name().to_owned(),
        new.json_name().to_owned(),
    );
}

/// A field's type as written in a .proto file: `string`, `bytes`, or the full name of a
/// message or enum.
fn type_of(field: &FieldDescriptorProto) -> String {
    match field.r#type() {
        Type::Message | Type::Enum | Type::Group => {
            field.type_name().trim_start_matches('.').to_owned()
        }
        scalar => scalar
            .as_str_name()
            .trim_start_matches("TYPE_")
            .to_ascii_lowercase(),
    }
}

fn label_of(field: &FieldDescriptorProto, proto2: bool) -> String {
    let label = match field.label() {
        Label::Repeated => "repeated",
        Label::Required => "required",
        Label::Optional if proto2 || field.proto3_optional() => "optional",
        Label::Optional => "no label",
    };
    label.to_owned()
}

/// The oneof a field is written in, or `no oneof`; a proto3 `optional` field's own
/// synthetic oneof is its label, not a oneof.
fn oneof_of(field: &FieldDescriptorProto, message: &DescriptorProto) -> String {
    let oneof = field
        .oneof_index
        .filter(|_| !field.proto3_optional())
        .and_then(|index| usize::try_from(index).ok())
        .and_then(|index| message.oneof_decl.get(index));
    match oneof {
        Some(oneof) => oneof.name().to_owned(),
        None => "no oneof".to_owned(),
    }
}

fn compare_enums(
    name: &str,
    old: &EnumDescriptorProto,
    new: &EnumDescriptorProto,
    found: &mut Vec<Violation>,
) {
    let old_members = members(old.value.iter().map(|v| (v.name(), v.number())));
    let new_members = members(new.value.iter().map(|v| (v.name(), v.number())));
    let new_reserved = Reserved::of_enum(new);
    for old_member in &old_members {
        let element = format!("{name}.{} (value {})", old_member.name, old_member.number);
        match fate(old_member, &new_members) {
            Fate::Kept(_) => {}
            Fate::Renamed(index) => found.push(violation(
                element,
                format!("renamed to {}", new_members[index].name),
            )),
            Fate::Renumbered(number) => {
                found.push(violation(element, format!("renumbered to {number}")))
            }
            Fate::Removed => check_removal(element, old_member, &new_reserved, found),
        }
    }
    check_reservations_kept(
        name,
        "value",
        &Reserved::of_enum(old),
        &new_reserved,
        &new_members,
        found,
    );
}

fn compare_services(
    name: &str,
    old: &ServiceDescriptorProto,
    new: &ServiceDescriptorProto,
    found: &mut Vec<Violation>,
) {
    for old_method in &old.method {
        let element = format!("{name}.{}", old_method.name());
        let Some(new_method) = new.method.iter().find(|m| m.name() == old_method.name()) else {
            found.push(violation(element, "RPC removed"));
            continue;
        };
        let mut changed = |what: &str, before: String, after: String| {
            if before != after {
                found.push(violation(
                    &element,
                    format!("{what} changed from {before} to {after}"),
                ));
            }
        };
        let message_name = |name: &str| name.trim_start_matches('.').to_owned();
        changed(
            "input type",
            message_name(old_method.input_type()),
            message_name(new_method.input_type()),
        );
        changed(
            "output type",
            message_name(old_method.output_type()),
            message_name(new_method.output_type()),
        );
        let streaming = |yes: bool| if yes { "stream" } else { "single" }.to_owned();
        changed(
            "client streaming",
            streaming(old_method.client_streaming()),
            streaming(new_method.client_streaming()),
        );
        changed(
            "server streaming",
            streaming(old_method.server_streaming()),
            streaming(new_method.server_streaming()),
        );
    }
}

/// A field or an enum value: what a message or an enum numbers.
struct Member<'a> {
    name: &'a str,
    number: i32,
}

fn members<'a>(pairs: impl Iterator<Item = (&'a str, i32)>) -> Vec<Member<'a>> {
    pairs
        .map(|(name, number)| Member { name, number })
        .collect()
}

/// What became of an old member in the new message or enum.
enum Fate {
    /// The same name at the same number (at this index of the new members).
    Kept(usize),
    /// Its number is there under another name.
    Renamed(usize),
    /// Its name is there under another number.
    Renumbered(i32),
    /// Neither its number nor its name is there.
    Removed,
}

fn fate(old: &Member, new: &[Member]) -> Fate {
    let same_name = new.iter().position(|m| m.name == old.name);
    let same_number = new.iter().position(|m| m.number == old.number);
    match (same_name, same_number) {
        (Some(index), _) if new[index].number == old.number => Fate::Kept(index),
        (Some(index), _) => Fate::Renumbered(new[index].number),
        (None, Some(index)) => Fate::Renamed(index),
        (None, None) => Fate::Removed,
    }
}

/// A removed member is allowed only when its number and its name are both reserved, so
/// that neither can come back meaning something else.
fn check_removal(element: String, old: &Member, new: &Reserved, found: &mut Vec<Violation>) {
    let problem = match (new.has_number(old.number), new.has_name(old.name)) {
        (true, true) => return,
        (true, false) => "removed without reserving its name",
        (false, true) => "removed without reserving its number",
        (false, false) => "removed without reserving its number and name",
    };
    found.push(violation(element, problem));
}

/// What the old message or enum reserved stays reserved in the new one; a number or name
/// of it in use again is reported at the member that uses it.
fn check_reservations_kept(
    name: &str,
    kind: &str,
    old: &Reserved,
    new: &Reserved,
    new_members: &[Member],
    found: &mut Vec<Violation>,
) {
    for &(start, end) in &old.ranges {
        for (start, end) in new.uncovered(start, end) {
            let mut reused = false;
            for member in new_members {
                let number = i64::from(member.number);
                if (start..end).contains(&number) {
                    reused = true;
                    found.push(violation(
                        format!("{name}.{} ({kind} {number})", member.name),
                        format!("uses number {number}, which the release reserved"),
                    ));
                }
            }
            if !reused {
                let numbers = if end - start == 1 {
                    format!("number {start} is")
                } else {
                    format!("numbers {start} to {} are", end - 1)
                };
                found.push(violation(name, format!("{numbers} no longer reserved")));
            }
        }
    }
    for reserved in &old.names {
        if new.has_name(reserved) {
            continue;
        }
        match new_members.iter().find(|m| m.name == reserved) {
            Some(member) => found.push(violation(
                format!("{name}.{} ({kind} {})", member.name, member.number),
                format!("uses name {reserved}, which the release reserved"),
            )),
            None => found.push(violation(
                name,
                format!("name {reserved} is no longer reserved"),
            )),
        }
    }
}

/// A message's or enum's `reserved` numbers (as half-open ranges) and names.
struct Reserved {
    ranges: Vec<(i64, i64)>,
    names: Vec<String>,
}

impl Reserved {
    fn of_message(message: &DescriptorProto) -> Self {
        Reserved {
            // A message's reserved ranges already end exclusively.
            ranges: message
                .reserved_range
                .iter()
                .map(|r| (i64::from(r.start()), i64::from(r.end())))
                .collect(),
            names: message.reserved_name.clone(),
        }
    }

    fn of_enum(enumeration: &EnumDescriptorProto) -> Self {
        Reserved {
            // An enum's reserved ranges end inclusively.
            ranges: enumeration
                .reserved_range
                .iter()
                .map(|r| (i64::from(r.start()), i64::from(r.end()) + 1))
                .collect(),
            names: enumeration.reserved_name.clone(),
        }
    }

    fn has_number(&self, number: i32) -> bool {
        let number = i64::from(number);
        self.ranges
            .iter()
            .any(|&(start, end)| (start..end).contains(&number))
    }

    fn has_name(&self, name: &str) -> bool {
        self.names.iter().any(|reserved| reserved == name)
    }

    /// The parts of `start..end` that no range of `self` covers.
    fn uncovered(&self, start: i64, end: i64) -> Vec<(i64, i64)> {
        let mut covering: Vec<(i64, i64)> = self
            .ranges
            .iter()
            .copied()
            .filter(|&(s, e)| s < end && e > start)
            .collect();
        covering.sort_unstable();
        let mut gaps = Vec::new();
        let mut next = start;
        for (s, e) in covering {
            if s > next {
                gaps.push((next, s));
            }
            next = next.max(e);
        }
        if next < end {
            gaps.push((next, end));
        }
        gaps
    }
}

#[cfg(test)]
mod tests;
