//! A network namespace joined to this one by a veth pair, whose link can be cut so that
//! packets are dropped silently (nothing refused, nothing reset), as when a network
//! partition or a dead switch takes a host away: a peer in it (a PostgreSQL started with
//! [`crate::pg::Postgres::init_in_netns`]) stops answering while every socket stays open.
//!
//! Needs root (`ip netns`, `ip link`). Each namespace gets a name and a /30 of its own, made
//! from the process id and a counter; it is deleted when dropped.

use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::{ensure, Context, Result};

/// A namespace with one address, reached from here over a veth pair.
pub struct NetNs {
    pub name: String,
    /// The address inside the namespace.
    pub addr: String,
    /// The veth end inside the namespace (set down to cut the link).
    inner: String,
}

fn ip(args: &[&str]) -> Result<String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .context("run ip (iproute2)")?;
    ensure!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

impl NetNs {
    /// Creates the namespace and its link, up.
    pub fn create() -> Result<NetNs> {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let id = std::process::id();
        let tag = format!("{:x}{n}", id % 0xfffff);
        // 10.200.0.0/14, a /30 per namespace: from the pid and the counter.
        let net = ((id % 0x3fff) << 2 | (n & 3)) << 2;
        let octets = |host: u32| {
            let a = (10 << 24) | (200 << 16) | (net + host);
            format!(
                "{}.{}.{}.{}",
                a >> 24,
                (a >> 16) & 0xff,
                (a >> 8) & 0xff,
                a & 0xff
            )
        };
        let ns = NetNs {
            name: format!("agentlog-{tag}"),
            addr: octets(2),
            inner: format!("al{tag}b"),
        };
        let outer = format!("al{tag}a");
        let here = octets(1);
        let inside = |args: &[&str]| {
            let mut all = vec!["netns", "exec", &ns.name, "ip"];
            all.extend_from_slice(args);
            ip(&all)
        };
        ip(&["netns", "add", &ns.name])?;
        ip(&[
            "link", "add", &outer, "type", "veth", "peer", "name", &ns.inner,
        ])?;
        ip(&["link", "set", &ns.inner, "netns", &ns.name])?;
        ip(&["addr", "add", &format!("{here}/30"), "dev", &outer])?;
        ip(&["link", "set", &outer, "up"])?;
        inside(&["addr", "add", &format!("{}/30", ns.addr), "dev", &ns.inner])?;
        inside(&["link", "set", &ns.inner, "up"])?;
        inside(&["link", "set", "lo", "up"])?;
        // A permanent neighbour entry on this side: with the link cut, packets to the
        // namespace are dropped, where an ARP lookup would fail and refuse them.
        let inner_mac = inside(&["-br", "link", "show", &ns.inner])?
            .split_whitespace()
            .nth(2)
            .unwrap_or_default()
            .to_string();
        ip(&[
            "neigh",
            "replace",
            &ns.addr,
            "lladdr",
            &inner_mac,
            "dev",
            &outer,
            "nud",
            "permanent",
        ])?;
        Ok(ns)
    }

    /// Cuts the link: from now on every packet between here and the namespace is dropped.
    pub fn cut(&self) -> Result<()> {
        ip(&[
            "netns",
            "exec",
            &self.name,
            "ip",
            "link",
            "set",
            &self.inner,
            "down",
        ])
        .map(drop)
    }

    /// Restores the link.
    pub fn heal(&self) -> Result<()> {
        ip(&[
            "netns",
            "exec",
            &self.name,
            "ip",
            "link",
            "set",
            &self.inner,
            "up",
        ])
        .map(drop)
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        // The veth pair goes with the namespace.
        let _ = ip(&["netns", "delete", &self.name]);
    }
}
