"""Checks that the Grafana dashboard is valid JSON and names only metrics the binaries export.

usage: check_dashboard.py DASHBOARD.json BIN_DIR

Starts the real `event-store` (on a temp data dir) and `runner` (against it) with
`--metrics-listen 127.0.0.1:0`, scrapes `/metrics` from both, and checks every
`agentlog_*` series name in every panel's query against the scraped sample names. Every
metric family is exposed from the start, so nothing has to happen first (the runner is
given a fallback model, so that its usual fallback series exists too).
"""

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import urllib.request

problems = []


def start(argv, env):
    """Starts a binary; returns (process, {"listen_addr": ..., "metrics_addr": ...})."""
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **env})
    found = {}
    ready = threading.Event()

    def read():
        for line in proc.stderr:
            for key in ("listen_addr", "metrics_addr"):
                m = re.search(rf"{key}=(\S+)", line)
                if m:
                    found[key] = m.group(1).strip('"')
            if "metrics_addr" in found:
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(60) or "metrics_addr" not in found:
        proc.kill()
        sys.exit(f"{argv[0]} did not log its metrics address")
    return proc, found


def scrape(addr):
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as response:
        body = response.read().decode()
    return {line.split("{")[0].split(" ")[0] for line in body.splitlines()
            if line and not line.startswith("#")}


def main(dashboard_path, bin_dir):
    try:
        dashboard = json.load(open(dashboard_path))
    except json.JSONDecodeError as e:
        sys.exit(f"{dashboard_path}: not valid JSON: {e}")
    exprs = [(p.get("title", "?"), t["expr"]) for p in dashboard.get("panels", [])
             for t in p.get("targets", [])]
    if not exprs:
        sys.exit(f"{dashboard_path}: no panel queries")

    exported = set()
    with tempfile.TemporaryDirectory() as data:
        env = {"RUST_LOG": "info", "OTEL_EXPORTER_OTLP_ENDPOINT": ""}
        store, store_addrs = start([f"{bin_dir}/event-store", "--listen", "127.0.0.1:0",
                                    "--data-dir", data, "--metrics-listen", "127.0.0.1:0"], env)
        runner = None
        try:
            runner, runner_addrs = start(
                [f"{bin_dir}/runner", "--event-store", f"http://{store_addrs['listen_addr']}",
                 "--runner-id", "dashboard-check", "--workspace-root", f"{data}/workspaces",
                 "--model", "anthropic:check", "--fallback-model", "anthropic:check-fallback",
                 "--metrics-listen", "127.0.0.1:0"],
                {**env, "ANTHROPIC_API_KEY": "unused"})
            exported |= scrape(store_addrs["metrics_addr"])
            exported |= scrape(runner_addrs["metrics_addr"])
        finally:
            for proc in (runner, store):
                if proc:
                    proc.send_signal(signal.SIGTERM)
                    proc.wait(30)

    named = set()
    for title, expr in exprs:
        names = set(re.findall(r"\bagentlog_[a-z0-9_]+", expr))
        if not names:
            problems.append(f"panel {title!r}: query names no agentlog metric: {expr}")
        for name in names - exported:
            problems.append(f"panel {title!r}: {name} is not exported by the binaries")
        named |= names
    for p in problems:
        print(f"MISMATCH {dashboard_path}: {p}")
    if problems:
        sys.exit(1)
    print(f"{dashboard_path}: valid JSON; its {len(named)} series are all exported "
          f"({len(exported)} exported)")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
