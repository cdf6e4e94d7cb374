"""serving.Server: the one server lifecycle (start, /health, stop of the whole process family).

The "server" is a few lines of stdlib Python that answer /health and fork a child that leaves
the process group (setsid), which a plain killpg would miss.
"""

from __future__ import annotations

import sys
import textwrap

import pytest

from reap_swap.bench import server_driver as serving
from reap_swap.bench.processes import process_family, process_table

FAKE_SERVER = textwrap.dedent(
    """
    import http.server, os, subprocess, sys
    port = int(sys.argv[sys.argv.index("--port") + 1])
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *a):
            pass
    print("env", os.environ.get("REAP_STRAY"), os.environ.get("EXTRA"), flush=True)
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
    """
)


def test_start_waits_for_health_and_stop_kills_the_family(tmp_path, monkeypatch):
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    monkeypatch.setenv("REAP_STRAY", "1")
    srv = serving.Server(
        "fake",
        [sys.executable, str(script)],
        tmp_path,
        env={"EXTRA": "x"},
        port=serving.free_port(),
        startup_timeout_s=60,
        base_env=serving.environ_without_reap(),
        poll_s=0.2,
        announce=lambda _m: None,
    )
    with srv:
        assert srv.healthy() and srv.startup_s is not None
        pids = process_family(srv.proc.pid)
        outside = {p for p in pids if process_table()[p][1] != srv.proc.pid}
        assert srv.proc.pid in srv.known and outside, "the child left the group"
        assert outside <= srv.known
    assert not set(process_table()) & srv.known
    assert "env None x" in srv.log_path.read_text()  # REAP_* stripped, env laid over base_env


def test_a_server_that_exits_is_a_server_error_with_its_log(tmp_path):
    srv = serving.Server(
        "dies",
        [sys.executable, "-c", "print('bad flag'); raise SystemExit(3)"],
        tmp_path,
        port=serving.free_port(),
        poll_s=0.1,
    )
    with pytest.raises(serving.ServerError, match="exited with 3 during startup(.|\n)*bad flag"):
        srv.start()
    assert srv.stop() == (srv.known, set())
