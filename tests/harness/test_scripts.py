"""Agent scripts as data: each step kind plays as the puppet answers, and a script the
puppet could not play is refused before any agent runs it."""

from __future__ import annotations

import math

import pytest

from harness.act import scripts
from harness.act.puppet import Puppet


def tools(script: dict[str, object], n: int) -> list[str]:
    return [scripts.call_at(script, i, "a1", "http://p").tool for i in range(n)]


def test_steps_expand_repeat_and_finish() -> None:
    script = {"steps": [{"write_files": {"count": 3, "size": 10}},
                        {"repeat": {"times": 2, "steps": [{"shell": "echo {step}"}]}}]}
    assert tools(script, 7) == ["write_file"] * 3 + ["shell"] * 2 + ["finish", "finish"]
    first = scripts.call_at(script, 0, "a1", "http://p")
    assert len(first.args["content"]) == 10
    assert scripts.call_at(script, 4, "a1", "http://p").args == {"cmd": "echo 4"}


def test_cycle_never_ends_and_fail_tool_names_the_agent() -> None:
    script = {"steps": [{"cycle": [{"read_file": "a"}, {"fail_tool": {}}]}]}
    assert tools(script, 6) == ["read_file", "http_request"] * 3
    call = scripts.call_at(script, 1, "agent-7", "http://p")
    assert call.args["url"] == "http://p/puppet/fail?agent=agent-7&n=1"


def test_spend_reports_its_usage_and_nan() -> None:
    spend = scripts.call_at({"steps": [{"spend": {"prompt_tokens": 150000}}]}, 0, "a", "u")
    assert spend.prompt_tokens == 150000
    nan = scripts.call_at({"steps": [{"spend": {"prompt_tokens": "nan"}}]}, 0, "a", "u")
    assert math.isnan(nan.prompt_tokens)


@pytest.mark.parametrize("bad", [{"steps": []}, {"steps": [{"dance": 1}]}, {"nosteps": 1},
                                 {"steps": [{"repeat": {"times": 0, "steps": [{"shell": "x"}]}}]}])
def test_unplayable_scripts_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(scripts.ScriptError):
        scripts.validate(bad)


def test_every_fixture_loads_and_the_old_names_still_play() -> None:
    assert {"rm_rf", "spend_fast", "same_call", "read_write_cycle", "fail_always",
            "writer"} <= set(scripts.fixture_names())
    puppet = Puppet()
    for name in scripts.fixture_names():
        puppet.assign(name, name)
    puppet.assign("old", "rm_rf_loop")
    reply = puppet.answer("old", [], "http://p")
    assert reply["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "shell"
    reply = puppet.answer("rm_rf", [], "http://p")
    assert puppet.actions("rm_rf")[0].args == {"cmd": "rm -rf ./*"}
    with pytest.raises(ValueError, match="unknown behaviour"):
        puppet.assign("x", "no_such_thing")
