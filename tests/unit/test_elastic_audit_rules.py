"""The audit of an elastic log that has recorded no rules: the service before rules were versioned
(rules 1) recorded none, so its first proposal is re-decided where nothing in the state says which
rules made it (the proposal's own are folded only after its ``based_on``). It was re-decided by
this service's rules, and reported as differing; it is re-decided by the rules it carries."""

from __future__ import annotations

import msgspec

from gpuherd import events as ev
from gpuherd.log import Record
from gpuherd.runtime.audit import audit
from gpuherd.runtime.decider import decide_stamped, replay
from services.elastic.decide import ElasticDecider
from services.elastic.state import ElasticState
from tests.unit.test_resize import started


class FirstRulesElastic(ElasticDecider):
    """The elastic service before its rules were versioned: rules 1, and none recorded."""

    def rules_for(self, state: ElasticState) -> int:
        return 1


def _as_stored_before_rules(proposal: ev.Event) -> ev.Event:
    """``proposal`` as that service stored it: RescaleProposed v1, without ``rules``."""
    raw = msgspec.to_builtins(proposal)
    del raw["rules"]
    return ev.decode(msgspec.json.encode({**raw, "v": 1}))


def _with_first_proposal(decider: ElasticDecider, stored: bool = False) -> list[Record]:
    """An elastic job running on 2 of 8 GPUs with nothing waiting, and ``decider``'s proposal to grow
    it, decided on its JobStarted, appended as the runtime appends it."""
    log = started()
    (proposal,) = decide_stamped(decider, replay(decider, log), log[-1])
    assert isinstance(proposal, ev.RescaleProposed) and proposal.gpus == 3
    return [*log, Record(len(log) + 1, _as_stored_before_rules(proposal) if stored else proposal)]


def test_an_old_log_s_first_proposal_audits_clean_by_the_rules_it_was_decided_by() -> None:
    log = _with_first_proposal(FirstRulesElastic(), stored=True)
    assert log[-1].event.rules == 1 and ElasticDecider().rules_for(replay(ElasticDecider(), log[:-1])) != 1
    report = audit(log, ElasticDecider())
    assert report.ok and report.decisions_checked == 1, report.mismatches


def test_what_the_first_rules_would_not_have_decided_is_still_reported() -> None:
    """The proposal's rules say which rules re-decide it, not what they decide: a grow to another
    size than rules 1 proposed differs."""
    log = _with_first_proposal(FirstRulesElastic(), stored=True)
    forged = msgspec.structs.replace(log[-1].event, gpus=4)
    (mismatch,) = audit([*log[:-1], Record(log[-1].seq, forged)], ElasticDecider()).mismatches
    assert mismatch.kind == "differs" and '"gpus":3' in mismatch.detail, mismatch.detail


def test_a_new_log_without_its_rules_recorded_is_still_decided_by_this_service_s_own() -> None:
    """What this service decides is unchanged: on a log that recorded no rules (it records its own
    once caught up), its own rules, and that log audits clean too."""
    log = _with_first_proposal(ElasticDecider())
    assert log[-1].event.rules == ev.ELASTIC_RULES
    report = audit(log, ElasticDecider())
    assert report.ok and report.decisions_checked == 1, report.mismatches
