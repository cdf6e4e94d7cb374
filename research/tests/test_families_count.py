"""families_count.py: the exact-count cases of gpu_families.py (issue 15), against a fake server."""

import json

import httpx
import pytest
from harness_modules import load_script

SHAPE = {"top_k": 8, "layers": 40}


@pytest.fixture(scope="module")
def fc():
    return load_script("families_count")


def test_parse_and_expected(fc):
    assert fc.parse_ints("1, 15,16,,38") == (1, 15, 16, 38) and fc.parse_ints("") == ()
    with pytest.raises(ValueError):
        fc.parse_ints("0,4")
    assert fc.expected_selections(38, 1, 8, 40) == 12160  # the run-10 case
    assert fc.expected_selections(16, 4, 8, 40) == 19 * 320
    assert (
        fc.vocab_size({"text_config": {"vocab_size": 248320}})
        == 248320
        == fc.vocab_size({"vocab_size": 248320})
    )


def test_token_prompt_is_exact_seeded_and_in_range(fc):
    p = fc.token_prompt(38, 248320, seed=7)
    assert (
        len(p) == 38 and p == fc.token_prompt(38, 248320, seed=7) and p != fc.token_prompt(38, 248320, seed=8)
    )
    assert all(1000 <= t < 30000 for t in p)
    small = fc.token_prompt(5, 512, seed=1)
    assert all(128 <= t < 512 for t in small)


class FakeE2E:
    """gpu_e2e's open_request / misses / log over a fake server whose counters drop the first
    `hidden` rows of every step (the run-10 fault when hidden=16)."""

    def __init__(self, hidden: int):
        self.hidden, self.opened, self.last = hidden, [], None

    def open_request(self, srv, rid):
        self.opened.append(rid)

    def misses(self, srv, rid):
        n, m = self.last
        tokens = max(0, n - self.hidden) + (0 if self.hidden else m - 1)  # decode rows are row 0
        per_layer = tokens * SHAPE["top_k"]
        layers = {str(i): {"observed_selections": per_layer} for i in range(SHAPE["layers"])}
        return {"totals": {"observed_selections": per_layer * SHAPE["layers"]}, "layers": layers}

    def log(self, *args):
        pass


def serve(monkeypatch, fake):
    def handler(request):
        body = json.loads(request.content)
        fake.last = (len(body["prompt"]), body["max_tokens"])
        assert body["ignore_eos"] is True and body["temperature"] == 0
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
        return httpx.Response(200, json={"usage": usage})

    client = httpx.Client(transport=httpx.MockTransport(handler))
    monkeypatch.setattr(httpx, "post", lambda url, **kw: client.post(url, **kw))


class Srv:
    url = "http://fake"


def test_exact_counters_pass_every_case(fc, monkeypatch):
    fake = FakeE2E(hidden=0)
    serve(monkeypatch, fake)
    got = fc.count_cases(Srv(), fake, SHAPE, 248320, (1, 15, 16, 17, 38), (1, 4))
    assert got["all_equal"] and len(got["cases"]) == 10 and len(set(fake.opened)) == 10
    assert set(got["missing_tokens"].values()) == {0}


def test_the_run10_fault_shows_as_missing_tokens(fc, monkeypatch):
    fake = FakeE2E(hidden=16)
    serve(monkeypatch, fake)
    got = fc.count_cases(Srv(), fake, SHAPE, 248320, (1, 15, 16, 17, 38), (1, 4))
    assert not got["all_equal"]
    missing = got["missing_tokens"]
    assert missing["38+1"] == 16 and missing["17+1"] == 16 and missing["15+1"] == 15
    assert missing["38+4"] == 19  # 16 prompt rows + 3 decode steps
    c = next(c for c in got["cases"] if (c["prompt_tokens"], c["max_tokens"]) == (38, 1))
    assert (c["observed"], c["expected"]) == (7040, 12160)  # the H200 numbers
    assert c["per_layer_min"] == c["per_layer_max"] == 176 and c["per_layer_expected"] == 304


class ConcurrentE2E(FakeE2E):
    """Counts what the fake server was sent (every request's n + m - 1 rows) plus `phantom` rows."""

    def __init__(self, phantom: int):
        super().__init__(hidden=0)
        self.phantom, self.sent, self.log_all = phantom, [], []

    def open_request(self, srv, rid):  # the counters reset: only this request's traffic counts
        super().open_request(srv, rid)
        self.log_all += self.sent
        self.sent = []

    def misses(self, srv, rid):
        tokens = sum(n + m - 1 for n, m in self.sent) + self.phantom
        return {"totals": {"observed_selections": tokens * SHAPE["top_k"] * SHAPE["layers"]}, "layers": {}}


def serve_concurrent(monkeypatch, fake):
    def handler(request):
        body = json.loads(request.content)
        fake.sent.append((len(body["prompt"]), body["max_tokens"]))
        return httpx.Response(200, json={"usage": {"completion_tokens": body["max_tokens"]}})

    client = httpx.Client(transport=httpx.MockTransport(handler))
    monkeypatch.setattr(httpx, "post", lambda url, **kw: client.post(url, **kw))


@pytest.mark.parametrize("phantom", [0, 3])
def test_concurrent_case_sums_the_requests_and_shows_phantom_rows(fc, monkeypatch, phantom):
    fake = ConcurrentE2E(phantom)
    serve_concurrent(monkeypatch, fake)
    got = fc.count_cases(Srv(), fake, SHAPE, 248320, (1,), (1,), concurrent=fc.DEFAULT_CONCURRENT)
    c = got["concurrent"]
    assert fake.log_all == [(1, 1)] and sorted(fake.sent) == [(n, 8) for n in (3, 5, 7, 9, 11)]
    assert c["expected"] == sum(n + 7 for n in (3, 5, 7, 9, 11)) * 8 * 40
    assert (
        c["extra_tokens"] == phantom and c["equal"] is (phantom == 0) and got["all_equal"] is (phantom == 0)
    )
    assert "count-concurrent" in fake.opened


def test_concurrent_case_reports_a_short_reply(fc, monkeypatch):
    fake = ConcurrentE2E(0)

    def handler(request):
        return httpx.Response(200, json={"error": "engine dead"})

    client = httpx.Client(transport=httpx.MockTransport(handler))
    monkeypatch.setattr(httpx, "post", lambda url, **kw: client.post(url, **kw))
    c = fc.concurrent_case(Srv(), fake, SHAPE, 248320, (3, 5), 8)
    assert "error" in c and len(c["error"]) == 2 and "equal" not in c
