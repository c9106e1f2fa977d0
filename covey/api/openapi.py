"""The OpenAPI document, made true: every status a route answers, in the one error shape,
with the credentials it takes and links between the operations.

FastAPI on its own lists the success and a 422 in its `{"detail"}` shape that this server
never sends; tools that test from the document then called every 401, 403, 404 and 409
undocumented. What a route can answer follows from how it is declared (its role
dependency, its path and body), so it is derived here once rather than restated per route.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI
from fastapi.dependencies.models import Dependant
from fastapi.openapi.utils import get_openapi

from covey.admission import is_bounded_read
from covey.api.deps import ROLE_CHECKS, SESSION_COOKIE, current_principal
from covey.config import HEARTBEAT_MIN_S
from covey.errors import ErrorOut, api_routes

ERROR_REF = "#/components/schemas/ErrorOut"
SECURITY_SCHEMES = {
    "bearer": {"type": "http", "scheme": "bearer",
               "description": "An API token from POST /api/v1/auth/tokens."},
    "session": {"type": "apiKey", "in": "cookie", "name": SESSION_COOKIE,
                "description": "The session cookie set by POST /api/v1/auth/login."},
}
DESCRIPTIONS = {
    400: "Malformed JSON",
    401: "Not signed in, or the session or token is unknown",
    403: "Your role may not do this",
    404: "No such resource in your organisation",
    409: "Conflicts with the current state",
    413: "Request body too large",
    422: "Invalid request: `details` says where and what",
    429: "Too many reads at once: retry after the `Retry-After` seconds",
    503: "Database unreachable",
}
# (creating operation, its success status) -> operations its answer leads to, with how to
# fill their path parameters: what the stateful phase of a fuzzer follows.
AGENT = {"agent_id": "$response.body#/id"}
LINKS: dict[tuple[str, str], list[tuple[str, str, dict[str, str]]]] = {
    ("post", "/api/v1/agents"): [
        *((m, p, AGENT) for m, p in (
            ("get", "/api/v1/agents/{agent_id}"), ("get", "/api/v1/agents/{agent_id}/backlog"),
            ("post", "/api/v1/agents/{agent_id}/tasks"), ("post", "/api/v1/agents/{agent_id}/wake"),
            ("get", "/api/v1/agents/{agent_id}/heartbeats"),
            ("post", "/api/v1/agents/{agent_id}/heartbeats"),
            ("get", "/api/v1/agents/{agent_id}/recording"),
            ("get", "/api/v1/agents/{agent_id}/sessions"),
            ("get", "/api/v1/agents/{agent_id}/sandboxes"),
            ("post", "/api/v1/agents/{agent_id}/kill"),
            ("post", "/api/v1/agents/{agent_id}/resume"))),
        ("post", "/api/trigger/{token}", {"token": "$response.body#/trigger_token"}),
    ],
    ("post", "/api/v1/agents/{agent_id}/tasks"): [
        (m, "/api/v1/agents/{agent_id}/tasks/{task_id}",
         {"agent_id": "$response.body#/agent_id", "task_id": "$response.body#/id"})
        for m in ("get", "patch")
    ],
    ("post", "/api/v1/agents/{agent_id}/heartbeats"): [
        ("post", "/api/v1/agents/{agent_id}/heartbeats/{name}/fire",
         {"agent_id": "$request.path.agent_id", "name": "$response.body#/name"}),
    ],
}


def _calls(dependant: Dependant) -> Iterator[Any]:
    for dep in dependant.dependencies:
        yield dep.call
        yield from _calls(dep)


def statuses(route: Any) -> set[int]:
    """The error statuses this route can answer, from how it is declared."""
    codes: set[int] = set()
    calls = set(_calls(route.dependant))
    if current_principal in calls:
        codes.add(401)
    if calls & ROLE_CHECKS:
        codes.add(403)
    if route.dependant.path_params:
        codes |= {404, 422}
    if route.dependant.query_params:
        codes.add(422)
    if route.body_field is not None:
        codes |= {400, 413, 422}
    if any(is_bounded_read(method, route.path_format) for method in route.methods or ()):
        codes.add(429)
    return codes


def _error_response(description: str) -> dict[str, Any]:
    return {"description": description,
            "content": {"application/json": {"schema": {"$ref": ERROR_REF}}}}


def document(app: FastAPI, heartbeat_min_s: int = HEARTBEAT_MIN_S) -> dict[str, Any]:
    """`heartbeat_min_s`: the running plane's shortest heartbeat period (COVEY_HEARTBEAT_MIN_S),
    which no static schema knows."""
    if app.openapi_schema:
        return app.openapi_schema
    doc = get_openapi(title=app.title, version=app.version, description=app.description,
                      routes=app.routes)
    components = doc.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    schemas["HeartbeatIn"]["properties"]["every_seconds"]["minimum"] = heartbeat_min_s
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    error_schema = ErrorOut.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(error_schema.pop("$defs", {}))
    schemas["ErrorOut"] = error_schema
    components["securitySchemes"] = SECURITY_SCHEMES
    operation_ids: dict[tuple[str, str], str] = {}
    for route in api_routes(app):
        if not route.include_in_schema:
            continue
        for method in route.methods or ():
            operation = doc["paths"][route.path_format][method.lower()]
            operation_ids[(method.lower(), route.path_format)] = operation["operationId"]
            responses = operation["responses"]
            for code in statuses(route):
                responses.setdefault(str(code), {"description": DESCRIPTIONS[code]})
            for code, response in responses.items():
                if code[0] in "45":
                    responses[code] = _error_response(
                        response.get("description") or DESCRIPTIONS[int(code)])
            if 401 in statuses(route):
                operation["security"] = [{"bearer": []}, {"session": []}]
    for (method, path), targets in LINKS.items():
        operation = doc["paths"][path][method]
        success = next(c for c in operation["responses"] if c.startswith("2"))
        operation["responses"][success]["links"] = {
            operation_ids[(m, p)]: {"operationId": operation_ids[(m, p)], "parameters": params}
            for m, p, params in targets
        }
    app.openapi_schema = doc
    return doc
