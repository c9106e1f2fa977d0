"""Agent scripts: what the puppet model answers an agent, step by step, as data.

A script is a list of steps; each step is one model reply with one tool call, and a step
may expand into several (`write_files`) or repeat others (`repeat`, `cycle`). When the steps
run out the agent finishes. Scripts live in `fixtures/scripts/*.yaml` (by name) or inline
in a scenario, as the same mapping:

    steps:
      - write_files: {count: 20, size: 4096}
      - repeat: {times: forever, steps: [{shell: "rm -rf ./*"}]}

The kinds of step:
* `write_files: {count, size, prefix}`: `count` write_file calls of `size` bytes each;
* `shell: CMD` (or `{cmd, prompt_tokens, completion_tokens}`): one shell call; `{step}` in
  CMD is replaced by the step's number;
* `spend: {prompt_tokens, completion_tokens}`: one harmless call whose reply reports that
  usage (priced by the daemon at its model's price); a count of `nan` reports NaN;
* `fail_tool: {}`: an http_request to the puppet's failing service, which counts each call;
* `read_file: PATH`, `write_file: {path, content}`: one call each;
* `repeat: {times: N | forever, steps: [...]}`, `cycle: [...]` (repeat forever);
* `finish: RESULT`.

Beside its steps a script may say `honours_max_tokens: false`: the puppet then answers the
usage it is scripted with even beyond the completion the request allowed (an endpoint that
ignores `max_tokens`); by default it cuts the answer off there, as a model does.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "scripts"
KINDS = ("write_files", "shell", "spend", "fail_tool", "read_file", "write_file", "repeat",
         "cycle", "finish")


class ScriptError(ValueError):
    """A script that cannot be played: the message says which step and why."""


@dataclass(frozen=True)
class Call:
    """One step: a tool call, and the usage its reply reports."""

    tool: str
    args: dict[str, Any]
    prompt_tokens: float = 100
    completion_tokens: float = 20


def fixture_names() -> list[str]:
    return sorted(p.stem for p in FIXTURES.glob("*.yaml")) if FIXTURES.is_dir() else []


def load(name: str) -> dict[str, Any]:
    """The script of `fixtures/scripts/NAME.yaml`."""
    path = FIXTURES / f"{name}.yaml"
    if not path.is_file():
        raise ScriptError(f"no script {name!r} in {FIXTURES}; known: "
                          f"{', '.join(fixture_names()) or 'none'}")
    data = yaml.safe_load(path.read_text())
    validate(data, where=str(path))
    return dict(data)


def validate(script: Any, where: str = "script") -> None:
    """Refuse a script the puppet could not play, before any agent runs it."""
    if not isinstance(script, Mapping) or not isinstance(script.get("steps"), list):
        raise ScriptError(f"{where}: a script is a mapping with a list of `steps`")
    _validate_steps(script["steps"], where)
    if not isinstance(script.get("honours_max_tokens", True), bool):
        raise ScriptError(f"{where}: honours_max_tokens is true or false")
    list(itertools.islice(calls(script, "check", "http://puppet"), 1))


def _validate_steps(steps: Any, where: str) -> None:
    if not isinstance(steps, list) or not steps:
        raise ScriptError(f"{where}: steps must be a non-empty list")
    for n, step in enumerate(steps):
        if not isinstance(step, Mapping) or len(step) != 1 or next(iter(step)) not in KINDS:
            raise ScriptError(f"{where}, step {n}: each step is one of {', '.join(KINDS)}, "
                              f"not {step!r}")
        kind, arg = next(iter(step.items()))
        if kind == "repeat":
            if not isinstance(arg, Mapping):
                raise ScriptError(f"{where}, step {n}: repeat takes {{times, steps}}")
            times = arg.get("times", "forever")
            if times != "forever" and not (isinstance(times, int) and times >= 1):
                raise ScriptError(f"{where}, step {n}: repeat times is a positive number "
                                  f"or `forever`, not {times!r}")
            _validate_steps(arg.get("steps"), f"{where}, step {n}")
        elif kind == "cycle":
            _validate_steps(arg, f"{where}, step {n}")


def _count(value: Any) -> float:
    return float("nan") if value == "nan" else int(value)


def _expand(steps: list[Any], agent_id: str, base_url: str, counter: Iterator[int]
            ) -> Iterator[Call]:
    for step in steps:
        kind, arg = next(iter(step.items()))
        if kind == "repeat" or kind == "cycle":
            inner = arg if kind == "cycle" else arg["steps"]
            times = "forever" if kind == "cycle" else arg.get("times", "forever")
            rounds = itertools.count() if times == "forever" else range(int(times))
            for _ in rounds:
                yield from _expand(inner, agent_id, base_url, counter)
            continue
        if kind == "write_files":
            spec = arg or {}
            size, prefix = int(spec.get("size", 1024)), str(spec.get("prefix", "work"))
            for i in range(int(spec.get("count", 1))):
                next(counter)
                yield Call("write_file", {"path": f"{prefix}-{i:04d}.txt",
                                          "content": (f"{prefix} {i} " * size)[:size]})
            continue
        n = next(counter)
        if kind == "shell":
            spec = arg if isinstance(arg, Mapping) else {"cmd": arg}
            yield Call("shell", {"cmd": str(spec["cmd"]).replace("{step}", str(n))},
                       _count(spec.get("prompt_tokens", 100)),
                       _count(spec.get("completion_tokens", 20)))
        elif kind == "spend":
            spec = arg or {}
            yield Call("shell", {"cmd": f"echo spend {n}"},
                       _count(spec.get("prompt_tokens", 100)),
                       _count(spec.get("completion_tokens", 20)))
        elif kind == "fail_tool":
            yield Call("http_request", {"url": f"{base_url}/puppet/fail?agent={agent_id}"
                                               f"&n={n}"})
        elif kind == "read_file":
            yield Call("read_file", {"path": str(arg)})
        elif kind == "write_file":
            yield Call("write_file", {"path": str(arg["path"]), "content": str(arg["content"])})
        elif kind == "finish":
            yield Call("finish", {"result": str(arg)})
            return


def calls(script: Mapping[str, Any], agent_id: str, base_url: str) -> Iterator[Call]:
    """Every call of the script in order; it ends with the first finish."""
    for call in _expand(script["steps"], agent_id, base_url, itertools.count()):
        yield call
        if call.tool == "finish":
            return
    yield Call("finish", {"result": "script done"})


def call_at(script: Mapping[str, Any], step: int, agent_id: str, base_url: str) -> Call:
    """The call of step `step` (counted from 0); past the end, finish again."""
    played = list(itertools.islice(calls(script, agent_id, base_url), step + 1))
    return played[-1] if played else Call("finish", {"result": "script done"})


def dumps(script: Mapping[str, Any]) -> str:
    return json.dumps(script, sort_keys=True)
