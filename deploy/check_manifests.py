"""Checks that rendered manifests agree with the binaries they run.

usage: check_manifests.py RENDERED.yaml BIN_DIR

- every `--flag` a container passes exists in `<binary> --help`;
- every AGENTLOG_* variable it sets (directly or through a ConfigMap) is one the binary
  reads (clap prints `[env: NAME=...]`);
- the gRPC port is the same everywhere: `--listen`, the named container port, the probes,
  the Services' ports, and the store URL the runners are given;
- a ServiceMonitor selects the Services of both binaries and scrapes a port they name;
- the metrics port too: `--metrics-listen` (or AGENTLOG_METRICS_LISTEN), the container port
  named `metrics`, and the Services' `metrics` ports;
- every workload runs as shipped in a restricted namespace: non-root, every capability
  dropped, no privilege escalation, RuntimeDefault seccomp, a read-only root filesystem, no
  privileged container and no host namespace or host path;
- the runner's secret files are mounted where its tools may not read (Landlock allows the
  system directories and the workspace root only), and the object store's credentials come
  from a Secret;
- the runner's workspaces follow its sessions: on a ReadWriteMany claim, or on the pod's own
  emptyDir with the checkpoints in an object store (`--checkpoint-store s3://`, `gs://`,
  `az://`), from which a runner taking a session over brings its workspace;
- the runner's readiness probe asks its `/ready` on the metrics port;
- each pod's `terminationGracePeriodSeconds` covers its SIGTERM drain: a runner's
  `--drain-timeout` (AGENTLOG_DRAIN_TIMEOUT, else the default its --help shows) plus the 3 s
  it exits within past it plus room, the store's 50 s before it cuts the connections still
  open plus room.
"""

import re
import subprocess
import sys
from urllib.parse import urlparse

import yaml

# Read by the binaries outside clap (model clients, tracing, the tools' environment).
# AGENTLOG_TOKEN is read outside clap on purpose: a secret must have no command-line flag.
OTHER_ENV = {"ANTHROPIC_API_KEY", "ANTHROPIC_BASE_URL", "OPENAI_API_KEY", "OPENAI_BASE_URL",
             "RUST_LOG", "HOME", "AGENTLOG_TOKEN"}
# The runner's object-store client reads its cloud's standard variables (taken at start by
# runner/src/secrets.rs); of them, these are credentials, which come from a Secret.
OBJECT_STORE_ENV = ("AWS_", "GOOGLE_", "AZURE_")
OBJECT_STORE_CREDENTIALS = {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                            "GOOGLE_SERVICE_ACCOUNT_KEY", "AZURE_STORAGE_ACCOUNT_KEY",
                            "AZURE_STORAGE_ACCESS_KEY", "AZURE_STORAGE_SAS_KEY",
                            "AZURE_CLIENT_SECRET"}
# Each image's program, as its entry point runs it.
BINARIES = {"agentlog/event-store": ["event-store"], "agentlog/runner": ["runner"],
            "agentlog/web": ["agentlog", "web"]}
# After the drain's budget the runner exits within this (runner/src/drain.rs EXIT_MARGIN).
RUNNER_EXIT_MARGIN_S = 3
# The store cuts connections still open this long after SIGTERM (event-store/src/incoming.rs).
STORE_SHUTDOWN_GRACE_S = 50
# The web view gives responses in flight this long after SIGTERM (cli/src/web/mod.rs).
WEB_SHUTDOWN_GRACE_S = 5
# What a pod needs beyond that: the process's last steps, the kubelet's own delays.
GRACE_ROOM_S = 5

problems = []


def fail(msg):
    problems.append(msg)


def check_cnpg_cluster(cluster):
    """What the store's promises need of a CloudNativePG Cluster (kubernetes-validate has
    no schema for the CRD): several instances, a synchronous quorum that is required, and
    the generated Secrets the store reads named after it."""
    name = cluster["metadata"]["name"]
    spec = cluster.get("spec", {})
    if spec.get("instances", 1) < 3:
        fail(f"Cluster/{name}: fewer than 3 instances")
    sync = spec.get("postgresql", {}).get("synchronous", {})
    if sync.get("method") not in ("any", "first") or sync.get("number", 0) < 1:
        fail(f"Cluster/{name}: no synchronous quorum (postgresql.synchronous method/number)")
    if sync.get("dataDurability") != "required":
        fail(f"Cluster/{name}: postgresql.synchronous.dataDurability is not 'required'")
    allowed = {"instances", "imageName", "primaryUpdateStrategy", "postgresql", "bootstrap",
               "storage", "affinity", "resources", "walStorage", "monitoring", "backup"}
    for key in spec:
        if key not in allowed:
            fail(f"Cluster/{name}: spec.{key} is not a field this check knows")


def seconds(duration):
    """`20s`, `1500ms`, `2m`, `1m 30s`: the forms `runner --drain-timeout` takes."""
    units = {"ms": 0.001, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600}
    parts = re.findall(r"([0-9]+)\s*([a-z]+)", duration)
    if not parts or re.sub(r"[0-9]+\s*[a-z]+|\s", "", duration):
        raise ValueError(f"not a duration: {duration!r}")
    return sum(int(n) * units[u] for n, u in parts)


def check_grace(where, pod, binary, args, env, help_text):
    grace = pod["spec"].get("terminationGracePeriodSeconds", 30)
    if binary == "runner":
        drain = (args[args.index("--drain-timeout") + 1] if "--drain-timeout" in args
                 else env.get("AGENTLOG_DRAIN_TIMEOUT"))
        if drain is None:
            m = re.search(r"--drain-timeout[^[]*\[env: AGENTLOG_DRAIN_TIMEOUT=?[^]]*\]\s*\[default: ([^]]+)\]",
                          help_text)
            if not m:
                fail(f"{where}: no default --drain-timeout in `runner --help`")
                return
            drain = m.group(1)
        need = seconds(drain) + RUNNER_EXIT_MARGIN_S + GRACE_ROOM_S
    elif binary == "web":
        need = WEB_SHUTDOWN_GRACE_S + GRACE_ROOM_S
    else:
        need = STORE_SHUTDOWN_GRACE_S + GRACE_ROOM_S
    if grace < need:
        fail(f"{where}: terminationGracePeriodSeconds {grace} < {need:g} (its SIGTERM drain)")


# What tools may read (runner/src/tools/sandbox/process.rs, SYSTEM_DIRS).
TOOL_READABLE = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt")
SECRET_FILE_ENV = ("AGENTLOG_TOKEN_FILE", "ANTHROPIC_API_KEY_FILE", "OPENAI_API_KEY_FILE",
                   "AGENTLOG_TLS_CLIENT_KEY")


def check_hardening(where, pod, container):
    """The pod runs as shipped under the restricted Pod Security Standard."""
    pod_ctx = pod.get("securityContext", {})
    ctx = container.get("securityContext", {})
    if not (ctx.get("runAsNonRoot", pod_ctx.get("runAsNonRoot")) and
            ctx.get("runAsUser", pod_ctx.get("runAsUser", 1)) != 0):
        fail(f"{where}: does not run as a non-root user")
    if ctx.get("capabilities", {}).get("drop") != ["ALL"] or ctx.get("capabilities", {}).get("add"):
        fail(f"{where}: does not drop every capability")
    if ctx.get("allowPrivilegeEscalation") is not False:
        fail(f"{where}: allowPrivilegeEscalation is not false")
    if ctx.get("privileged"):
        fail(f"{where}: privileged")
    seccomp = ctx.get("seccompProfile", pod_ctx.get("seccompProfile", {})).get("type")
    if seccomp != "RuntimeDefault":
        fail(f"{where}: seccomp profile {seccomp}, not RuntimeDefault")
    if ctx.get("readOnlyRootFilesystem") is not True:
        fail(f"{where}: the root filesystem is writable")
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field):
            fail(f"{where}: {field}")
    for volume in pod.get("volumes", []):
        if "hostPath" in volume:
            fail(f"{where}: hostPath volume {volume['name']}")


def check_secret_files(where, env):
    """The runner's secret files lie outside every path its tools may read."""
    root = env.get("AGENTLOG_WORKSPACE_ROOT", "").rstrip("/")
    for name in SECRET_FILE_ENV:
        path = env.get(name)
        if not path:
            continue
        readable = [d for d in TOOL_READABLE + ((root,) if root else ())
                    if path == d or path.startswith(d + "/")]
        if readable:
            fail(f"{where}: {name} {path} lies under {readable[0]}, which tools may read")


def check_workspaces(where, pod, container, env, claims):
    """Workspaces a session's next runner can see: a shared claim, or an object store."""
    root = env.get("AGENTLOG_WORKSPACE_ROOT", "").rstrip("/")
    store = env.get("AGENTLOG_CHECKPOINT_STORE", "file://")
    remote = urlparse(store).scheme in ("s3", "gs", "az")
    mount = next((m for m in container.get("volumeMounts", []) if m["mountPath"].rstrip("/") == root),
                 None)
    volume = next((v for v in pod.get("volumes", []) if mount and v["name"] == mount["name"]), {})
    if "persistentVolumeClaim" in volume:
        claim = claims.get(volume["persistentVolumeClaim"]["claimName"])
        if not remote and (claim is None or "ReadWriteMany" not in claim["spec"].get("accessModes", [])):
            fail(f"{where}: workspaces on a claim that is not ReadWriteMany, checkpoints in {store}: "
                 "a session taken over by another pod would not find its workspace")
    elif not remote:
        fail(f"{where}: workspaces on the pod's own {'emptyDir' if volume else 'filesystem'} need "
             f"an object store for their checkpoints (AGENTLOG_CHECKPOINT_STORE is {store})")
    for e in container.get("env", []):
        if e["name"] in OBJECT_STORE_CREDENTIALS and "secretKeyRef" not in e.get("valueFrom", {}):
            fail(f"{where}: {e['name']} is a credential: it comes from a Secret (secretKeyRef)")
    probe = container.get("readinessProbe", {}).get("httpGet", {})
    ports = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
    if probe.get("path") != "/ready" or ports.get(probe.get("port"), probe.get("port")) != ports.get("metrics"):
        fail(f"{where}: no readiness probe asking /ready on the metrics port")


def main(rendered, bin_dir):
    docs = [d for d in yaml.safe_load_all(open(rendered)) if d]
    configmaps = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}
    services = [d for d in docs if d["kind"] == "Service"]
    claims = {d["metadata"]["name"]: d for d in docs if d["kind"] == "PersistentVolumeClaim"}
    grpc_port = None
    store_urls = []
    for doc in docs:
        if doc["kind"] not in ("StatefulSet", "Deployment"):
            continue
        pod = doc["spec"]["template"]
        for c in pod["spec"]["containers"]:
            image = c["image"].split("@")[0].rsplit(":", 1)[0]
            program = BINARIES.get(image)
            if program is None:
                fail(f"{doc['metadata']['name']}: unknown image {c['image']}")
                continue
            binary = program[-1]
            help_text = subprocess.run([f"{bin_dir}/{program[0]}", *program[1:], "--help"],
                                       check=True, capture_output=True, text=True).stdout
            where = f"{doc['kind']}/{doc['metadata']['name']}"
            check_hardening(where, pod["spec"], c)
            args = c.get("args", [])
            for a in args:
                if a.startswith("--") and not re.search(rf"(^|\s){re.escape(a)}(\s|$|=)", help_text, re.M):
                    fail(f"{where}: flag {a} is not in `{' '.join(program)} --help`")
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            if "--database-url" in args or "AGENTLOG_DATABASE_URL" in env:
                if "--data-dir" in args or doc["kind"] != "Deployment":
                    fail(f"{where}: over PostgreSQL the store is a Deployment without --data-dir")
            for ref in c.get("envFrom", []):
                name = ref.get("configMapRef", {}).get("name")
                if name not in configmaps:
                    fail(f"{where}: envFrom names a missing ConfigMap {name}")
                    continue
                env.update(configmaps[name])
            for name in env:
                if name in OTHER_ENV or (binary == "runner" and name.startswith(OBJECT_STORE_ENV)):
                    continue
                # clap prints `[env: NAME=value]`, or `[env: NAME]` for a secret's variable.
                if f"[env: {name}=" not in help_text and f"[env: {name}]" not in help_text:
                    fail(f"{where}: env {name} is not read by {binary} (not in --help)")
            check_grace(where, pod, binary, args, env, help_text)
            if binary == "runner":
                check_secret_files(where, env)
                check_workspaces(where, pod["spec"], c, env, claims)
            if "AGENTLOG_EVENT_STORE" in env:
                store_urls.append((where, env["AGENTLOG_EVENT_STORE"]))
            ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
            metrics_listen = (args[args.index("--metrics-listen") + 1] if "--metrics-listen" in args
                              else env.get("AGENTLOG_METRICS_LISTEN"))
            metrics_port = int(metrics_listen.rsplit(":", 1)[1]) if metrics_listen else None
            if ports.get("metrics") != metrics_port:
                fail(f"{where}: container port 'metrics' {ports.get('metrics')} != --metrics-listen port {metrics_port}")
            for s in services:
                if s["spec"]["selector"] != doc["spec"]["selector"]["matchLabels"]:
                    continue
                for sp in s["spec"]["ports"]:
                    if sp.get("name") == "metrics" and ports.get(sp.get("targetPort")) != metrics_port:
                        fail(f"Service/{s['metadata']['name']}: port 'metrics' does not reach --metrics-listen")
            if binary == "event-store":
                listen = args[args.index("--listen") + 1] if "--listen" in args else None
                if listen is None:
                    fail(f"{where}: no --listen")
                    continue
                grpc_port = int(listen.rsplit(":", 1)[1])
                if ports.get("grpc") != grpc_port:
                    fail(f"{where}: container port 'grpc' {ports.get('grpc')} != --listen port {grpc_port}")
                # With TLS the probes use the plaintext --health-listen port (kubelet's gRPC
                # probes cannot speak TLS); without it, the gRPC port.
                probe_port = grpc_port
                if "--health-listen" in args:
                    probe_port = int(args[args.index("--health-listen") + 1].rsplit(":", 1)[1])
                    if ports.get("health") != probe_port:
                        fail(f"{where}: container port 'health' {ports.get('health')} != --health-listen port {probe_port}")
                elif "--tls-cert" in args:
                    fail(f"{where}: --tls-cert without --health-listen: kubelet's gRPC probes cannot speak TLS")
                for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                    p = c.get(probe)
                    if not p or "grpc" not in p:
                        fail(f"{where}: {probe} is not a native gRPC probe")
                    elif p["grpc"]["port"] != probe_port:
                        fail(f"{where}: {probe} port {p['grpc']['port']} != probe port {probe_port}")
                for s in services:
                    if s["spec"]["selector"] != doc["spec"]["selector"]["matchLabels"]:
                        continue
                    for sp in s["spec"]["ports"]:
                        if sp.get("name") == "metrics":
                            continue  # checked above, for both binaries
                        target = sp.get("targetPort")
                        target = ports.get(target) if isinstance(target, str) else target
                        if target != grpc_port:
                            fail(f"Service/{s['metadata']['name']}: targetPort {sp.get('targetPort')} is not the gRPC port")
    store_services = {s["metadata"]["name"]: s["spec"]["ports"][0]["port"] for s in services
                      if s["spec"].get("clusterIP") != "None"}
    for where, url in store_urls:
        u = urlparse(url)
        host = u.hostname.split(".")[0] if u.hostname else None
        if host not in store_services:
            fail(f"{where}: AGENTLOG_EVENT_STORE {url} names no ClusterIP Service")
        elif u.port != store_services[host]:
            fail(f"{where}: AGENTLOG_EVENT_STORE port {u.port} != Service port {store_services[host]}")
    for d in docs:
        if d["kind"] == "Cluster" and d["apiVersion"].startswith("postgresql.cnpg.io/"):
            check_cnpg_cluster(d)
    if grpc_port is None:
        fail("no event-store workload found")
    # No Kubernetes schema covers the Prometheus operator's ServiceMonitor: check that it
    # selects both workloads' Services and scrapes a port they name.
    for monitor in (d for d in docs if d["kind"] == "ServiceMonitor"):
        wanted = monitor["spec"]["selector"].get("matchLabels", {})
        selected = [s for s in services
                    if wanted.items() <= s["metadata"].get("labels", {}).items()]
        names = {s["spec"]["selector"].get("app.kubernetes.io/name") for s in selected}
        if names != {"event-store", "runner"}:
            fail(f"ServiceMonitor/{monitor['metadata']['name']}: selects the Services of {sorted(names)}, "
                 "not of event-store and runner")
        for endpoint in monitor["spec"]["endpoints"]:
            for s in selected:
                if endpoint.get("port") not in {p.get("name") for p in s["spec"]["ports"]}:
                    fail(f"ServiceMonitor/{monitor['metadata']['name']}: Service/{s['metadata']['name']} "
                         f"has no port {endpoint.get('port')!r}")
    for p in problems:
        print(f"MISMATCH {rendered}: {p}")
    if problems:
        sys.exit(1)
    print(f"{rendered}: flags, env and ports agree with the binaries")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
