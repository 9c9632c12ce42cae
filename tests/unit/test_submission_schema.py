"""docs/submission.schema.json, what other systems validate against, stays in step with the spec
intake decodes (``gpuherd.events.JobSpec``): the same fields, the same required ones, no others."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from gpuherd import events as ev

SCHEMA = Path(__file__).resolve().parents[2] / "docs" / "submission.schema.json"
SET_BY_INTAKE = {"array_of", "workflow_of"}  # (a submitter may not send them: intake refuses them)


def test_the_published_schema_names_every_field_of_a_job_spec_and_no_other() -> None:
    published = json.loads(SCHEMA.read_text())["$defs"]
    generated = msgspec.json.schema(ev.JobSpec)["$defs"]
    for name, definition in generated.items():
        if name in {"ArrayMember", "WorkflowMember"}:
            continue
        fields = set(definition.get("properties", {})) - SET_BY_INTAKE
        assert set(published[name].get("properties", {})) == fields, name
        assert set(published[name].get("required", [])) == set(definition.get("required", [])) - SET_BY_INTAKE, name
    assert not set(published["JobSpec"]["properties"]) & SET_BY_INTAKE
