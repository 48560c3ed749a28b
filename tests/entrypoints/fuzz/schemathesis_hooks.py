"""Schemathesis hooks for the fuzz test: generated generation requests are capped so that each costs milliseconds
(the limits themselves are tested in test_hostile_requests.py)."""

import schemathesis

CAPS = {"max_tokens": 4, "max_completion_tokens": 4, "max_output_tokens": 4, "n": 2, "best_of": 2, "min_tokens": 0}
GENERATE_PATHS = ("/v1/chat/completions", "/v1/completions")


def cap(path, body):
    """Cap the fields that multiply a request's work (a missing max_tokens means the whole context)."""
    if isinstance(body, dict):
        if path in GENERATE_PATHS and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = CAPS["max_tokens"]
        if path == "/v1/responses" and body.get("max_output_tokens") is None:
            body["max_output_tokens"] = CAPS["max_output_tokens"]
        for key, cap_value in CAPS.items():
            value = body.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > cap_value:
                body[key] = cap_value
    return body


@schemathesis.hook
def map_body(ctx, body):
    """Cap the generated bodies (fuzzing and stateful phases)."""
    return cap(ctx.operation.path, body)


@schemathesis.hook
def before_call(ctx, case, kwargs):
    """Cap the bodies of the coverage phase too, which map_body does not see."""
    cap(case.operation.path, case.body)
