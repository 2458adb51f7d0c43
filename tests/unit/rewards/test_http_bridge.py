"""The HTTP bridge against a real reward server on 127.0.0.1 (http.server in a thread).

Run: pytest tests/unit/rewards/test_http_bridge.py -q   (~10 s)
"""
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from areal_mq.messages import RewardJob
from areal_mq.rewards import HttpBridgeConfig, HttpRewardBridge, HttpRewardError, RewardConfig, RewardExecutor, TaskConfig


class RewardServer:
    """Scores completions by length; the path picks a behaviour (ok, slow, flaky, bad400, garbage, ...)."""

    def __init__(self):
        self.hits: dict[str, int] = {}
        self.bodies: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.hits[self.path] = server.hits.get(self.path, 0) + 1
                    server.bodies.append(body)
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                try:
                    answer = self.behave(body, server.hits[self.path])
                finally:  # before replying: the client's next request may start as soon as the reply arrives
                    with server.lock:
                        server.in_flight -= 1
                self.reply(*answer)

            def behave(self, body, hit):
                path = self.path
                if path == "/slow":
                    time.sleep(3)
                if path == "/flaky" and hit == 1:
                    return 503, b"busy"
                if path == "/bad400":
                    return 400, b"missing field"
                if path == "/garbage":
                    return 200, b"not json"
                if path == "/wrongcount":
                    return 200, json.dumps({"rewards": [1.0]}).encode()
                if path == "/concurrent":
                    time.sleep(0.3)
                rewards = [float(len(c)) for c in body["completions"]]
                return 200, json.dumps({"rewards": rewards, "details": [{"len": int(r)} for r in rewards]}).encode()

            def reply(self, code, data):
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        class Server(ThreadingHTTPServer):
            def handle_error(self, request, client_address):
                pass  # the slow path writes to clients that gave up: expected, not worth a traceback

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


@pytest.fixture
def server():
    s = RewardServer()
    yield s
    s.close()


def bridge(server, path, **kw):
    cfg = dict(url=server.url + path, timeout_s=1.0, retries=2, backoff_s=0.01)
    return HttpRewardBridge(HttpBridgeConfig(**{**cfg, **kw}))


JOB = RewardJob(task="remote", prompt_id="p1", prompt="q", completions=["a", "abc"], reference={"x": 1},
                truncated=[False, True], meta={"level": 2})


def test_scores_through_the_endpoint_with_the_documented_body(server):
    out = bridge(server, "/ok").score("job-1", JOB)
    assert out == [(1.0, {"len": 1}), (3.0, {"len": 3})]
    body = server.bodies[0]
    assert body == {"job_id": "job-1", "task": "remote", "prompt_id": "p1", "prompt": "q",
                    "completions": ["a", "abc"], "reference": {"x": 1}, "truncated": [False, True],
                    "meta": {"level": 2}}


def test_a_server_that_times_out_is_retried_then_reported(server):
    t0 = time.monotonic()
    with pytest.raises(HttpRewardError, match=r"no complete response within 1.0s \(attempt 2/2\)"):
        bridge(server, "/slow", retries=1).score("j", JOB)
    assert server.hits["/slow"] == 2 and time.monotonic() - t0 < 10


def test_transient_errors_are_retried(server):
    assert bridge(server, "/flaky").score("j", JOB)[0][0] == 1.0
    assert server.hits["/flaky"] == 2


@pytest.mark.parametrize("path,match", [
    ("/bad400", "HTTP 400: missing field"), ("/garbage", "unusable body"), ("/wrongcount", "expected 2 rewards"),
])
def test_client_errors_and_bad_bodies_fail_at_once(server, path, match):
    with pytest.raises(HttpRewardError, match=match) as info:
        bridge(server, path).score("j", JOB)
    assert not info.value.retryable and server.hits[path] == 1


def test_connection_refused_is_retried_then_reported():
    with pytest.raises(HttpRewardError, match=r"ConnectionRefusedError.*attempt 3/3"):
        HttpRewardBridge(HttpBridgeConfig(url="http://127.0.0.1:9/r", retries=2, backoff_s=0.01)).score("j", JOB)


def test_concurrency_limit(server):
    b = bridge(server, "/concurrent", max_concurrency=2)
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda i: b.score(f"j{i}", JOB), range(6)))
    assert len(results) == 6 and server.max_in_flight == 2


def test_http_tasks_through_the_executor(server):
    cfg = RewardConfig(processes=1, tasks={
        "remote": TaskConfig(http=HttpBridgeConfig(url=server.url + "/ok", timeout_s=2.0)),
        "stuck": TaskConfig(http=HttpBridgeConfig(url=server.url + "/slow", timeout_s=0.5, retries=0),
                            default_reward=-2.0),
    })
    errors = []
    with RewardExecutor(cfg, on_error=errors.append) as ex:
        ok = ex.score(JOB, job_id="h1", timeout=30)
        assert ok.rewards == [1.0, 3.0] and ok.errors == [None, None]
        stuck = ex.score(JOB.model_copy(update={"task": "stuck"}), job_id="h2", timeout=30)
        assert stuck.rewards == [-2.0, -2.0] and "h2" in stuck.errors[0] and "no complete response" in stuck.errors[0]
        assert errors[0]["job"] == "h2" and errors[0]["kind"] == "http"


def test_one_endpoint_limit_holds_for_every_task_name_a_star_entry_catches(server):
    """'*' is one configured task: jobs naming different tasks share its bridge (and its max_concurrency)
    instead of each wire name building its own."""
    cfg = RewardConfig(processes=1, tasks={"*": TaskConfig(http=HttpBridgeConfig(
        url=server.url + "/concurrent", timeout_s=5.0, max_concurrency=1))})
    with RewardExecutor(cfg) as ex:
        futs = [ex.submit(JOB.model_copy(update={"task": f"name-{i}"}), job_id=f"s{i}") for i in range(4)]
        assert [f.result(30).rewards for f in futs] == [[1.0, 3.0]] * 4
    assert server.max_in_flight == 1


def test_every_address_of_a_name_is_tried_within_the_deadline(server):
    port = int(server.url.rsplit(":", 1)[1])

    def two_addresses(host, *args):  # the first refuses (as ::1 does for a server bound to 127.0.0.1 only)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", 9)),
                (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))]

    b = HttpRewardBridge(HttpBridgeConfig(url=f"http://reward.test:{port}/ok", retries=0), resolve=two_addresses)
    assert b.score("j", JOB)[0][0] == 1.0


def test_a_tls_handshake_trickled_byte_by_byte_is_cut_at_the_deadline():
    """The server answers the ClientHello with a record header promising 16 KiB, then one byte every 0.2 s:
    every read meets a per-read timeout, only the attempt's deadline ends it."""
    srv = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def feed():
        conn, _ = srv.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"\x16\x03\x03\x40\x00")
            while not stop.wait(0.2):
                try:
                    conn.sendall(b"\x02")
                except OSError:
                    return

    threading.Thread(target=feed, daemon=True).start()
    b = HttpRewardBridge(HttpBridgeConfig(url=f"https://127.0.0.1:{srv.getsockname()[1]}/r", timeout_s=1.0,
                                          retries=0))
    t0 = time.monotonic()
    try:
        with pytest.raises(HttpRewardError, match="no complete response within 1.0s"):
            b.score("j", JOB)
        assert time.monotonic() - t0 < 2.5, f"held {time.monotonic() - t0:.1f}s"
    finally:
        stop.set()
        srv.close()
