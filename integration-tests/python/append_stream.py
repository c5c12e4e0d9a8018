"""A standard Python grpcio client streaming appends at full speed on one AppendStream.

It respects HTTP/2 flow control and waits for nothing else: a sender thread hands every
request to grpcio as fast as grpcio takes them, and the answers are read on the main thread,
starting only after --read-after seconds (so that, for that long, nothing the store sends
is read and the store's answers, then its reading of requests, wait on flow control).

Run by integration-tests/tests/store_python_client.rs, which installs grpcio and
grpcio-tools when missing. Stubs are generated from the repository's proto/ into a temp
dir at start. Prints one JSON line: what arrived; exits 1 on any failure.

    python3 append_stream.py --proto-dir proto --addr 127.0.0.1:50051 --session s --count 50000
"""

import argparse
import atexit
import json
import os
import shutil
import sys
import tempfile
import threading
import time


def generate_stubs(proto_dir, out_dir):
    import grpc_tools
    from grpc_tools import protoc

    well_known = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    files = ["agentlog/v1/events.proto", "agentlog/v1/event_store.proto"]
    code = protoc.main(
        ["protoc", "-I" + proto_dir, "-I" + well_known, "--python_out=" + out_dir,
         "--grpc_python_out=" + out_dir] + files
    )
    if code != 0:
        sys.exit("protoc failed on %s" % proto_dir)
    sys.path.insert(0, out_dir)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--proto-dir", required=True)
    parser.add_argument("--addr", required=True)
    parser.add_argument("--session", required=True)
    parser.add_argument("--count", type=int, default=50000)
    parser.add_argument("--read-after", type=float, default=0.0)
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()

    import grpc

    out_dir = tempfile.mkdtemp(prefix="agentlog-stubs-")
    atexit.register(shutil.rmtree, out_dir, True)
    generate_stubs(args.proto_dir, out_dir)
    from agentlog.v1 import event_store_pb2, event_store_pb2_grpc, events_pb2

    sent = [0]

    def requests():
        for i in range(args.count):
            yield event_store_pb2.AppendRequest(
                session_id=args.session,
                events=[events_pb2.Event(
                    event_id="e%d" % i,
                    user_message=events_pb2.UserMessage(text="m%d" % i),
                )],
            )
            sent[0] = i + 1

    channel = grpc.insecure_channel(args.addr)
    stub = event_store_pb2_grpc.EventStoreStub(channel)
    started = time.monotonic()
    answers = stub.AppendStream(requests(), timeout=args.timeout)
    time.sleep(args.read_after)
    result = {"sent": 0, "answered": 0, "refused": [], "wrong_seq": 0, "error": None}
    try:
        for i, answer in enumerate(answers):
            which = answer.WhichOneof("result")
            if which == "error":
                result["refused"].append([i, answer.error.code, answer.error.message])
            elif list(answer.response.seqs) != [i + 1]:
                result["wrong_seq"] += 1
            result["answered"] = i + 1
    except grpc.RpcError as e:
        result["error"] = "%s: %s" % (e.code(), e.details())
    result["sent"] = sent[0]
    result["seconds"] = round(time.monotonic() - started, 3)
    print(json.dumps(result))
    ok = (result["error"] is None and result["answered"] == args.count
          and not result["refused"] and result["wrong_seq"] == 0)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
