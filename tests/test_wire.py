"""The worker RPC contract: one resident-set encoding, strict models on both sides, and the real
worker logic answering through them (errors as replies, never raised)."""

import pytest
from pydantic import ValidationError
from reap_fakes import PLAN, FakeWorker

from reap_swap.engine import wire


def test_resident_sets_round_trip_in_one_wire_form():
    sets = {3: frozenset({5, 1}), 0: frozenset()}
    encoded = wire.encode_resident_sets(sets)
    assert encoded == {"0": [], "3": [1, 5]} and list(encoded) == ["0", "3"]
    assert wire.decode_resident_sets(encoded) == sets


def test_requests_and_replies_refuse_unknown_fields():
    with pytest.raises(ValidationError, match="keep"):
        wire.ApplyResidency.model_validate({"keep": {"0": [1]}})
    with pytest.raises(ValidationError, match="surprise"):
        wire.ResetReply.model_validate({"rank": 0, "surprise": 1})


def test_every_worker_reply_validates_against_its_model():
    w = FakeWorker(0, 1)
    resident = wire.encode_resident_sets(PLAN.core_sets())
    wire.StatusReply.model_validate(w.reap_status())
    ok = wire.ApplyReply.model_validate(w.reap_apply_residency(resident=resident, read_stats=True))
    assert (
        ok.error is None
        and ok.residency_mode == "accounting"
        and set(ok.stats) == {str(l) for l in PLAN.layers}
    )
    wire.StatsReply.model_validate(w.reap_read_stats(reset=True))
    wire.ResetReply.model_validate(w.reap_reset_stats())
    wire.ArmReply.model_validate(w.reap_arm_swap_fault(0))


@pytest.mark.parametrize(
    "request_kwargs,needle",
    [
        ({"resident": {"0": [0]}}, "lacks plan layers"),
        ({"keep": {"0": [0]}}, "resident"),  # an old-style call is answered, not raised
        ({"resident": {"0": ["x"]}}, "ValidationError"),
    ],
)
def test_a_bad_apply_request_is_answered_with_an_error(request_kwargs, needle):
    reply = wire.ApplyReply.model_validate(FakeWorker(1, 2).reap_apply_residency(**request_kwargs))
    assert reply.error.startswith("rank 1: ") and needle in reply.error
    assert reply.bytes_copied == 0 and reply.signature  # what the rank still holds
